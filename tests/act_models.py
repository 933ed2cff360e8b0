"""Models and data that plant one training pathology each, for the report/dirty/rollback tests.

build/step functions live at module level (replay imports them by name). Every builder seeds
itself, so a run recorded twice is bit-identical; every batch generator is seeded too.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.models import MLP, TinyLM

# --- regression data: y = 0.5 * x0 + noise ------------------------------------------------------


def regression_batches(n: int, batch: int = 16, seed: int = 1, noise: float = 0.1, first: int = 0):
    """(batch, sample_ids) pairs for steps first..first+n-1; ids are 1000 * step + row."""
    g = torch.Generator().manual_seed(seed)
    for i in range(first + n):
        x = torch.randn(batch, 8, generator=g)
        y = x[:, :1] * 0.5 + noise * torch.randn(batch, 1, generator=g)
        if i >= first:
            yield (x, y), [1000 * i + r for r in range(batch)]


def noise_batches(n: int, batch: int = 16, seed: int = 1):
    """Targets independent of the inputs: nothing to learn, the loss stays flat (minibatch noise)."""
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        x = torch.randn(batch, 8, generator=g)
        y = torch.randn(batch, 1, generator=g)
        yield (x, y), [1000 * i + r for r in range(batch)]


# --- healthy: the tiny MLP with a sane AdamW learning rate --------------------------------------


def build_healthy():
    torch.manual_seed(0)
    model = MLP()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


# --- oscillation: plain SGD with a learning rate ~20x too high; clipping keeps it bounded, ------
# so the loss bounces (up, down, up) instead of diverging.


def build_high_lr():
    torch.manual_seed(0)
    model = MLP()
    # The run is chaotic: the CPU's vector kernels decide its details. At 4.0 they decide
    # between oscillating and dying (every ReLU dead under AVX-512, oscillating under AVX2);
    # at 2.0 the second half improves by 10% under AVX2 (no oscillation by the rule) and
    # worsens under the default kernels. 2.5 oscillates without improving under both.
    return model, torch.optim.SGD(model.parameters(), lr=2.5)


# --- overfitting: a wide MLP memorizes 16 noisy samples; validation turns up ----------------------


def build_overfit():
    torch.manual_seed(0)
    model = MLP(hidden=256)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)


def overfit_data(seed: int = 3, n: int = 32):
    """(train x, train y, val x, val y): 32 training samples with heavy label noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n + 256, 8, generator=g)
    y = x[:, :1] * 0.5 + 0.5 * torch.randn(n + 256, 1, generator=g)
    return x[:n], y[:n], x[n:], y[n:]


def overfit_batches(n: int):
    """The whole training set every step: the model memorizes its noise."""
    x, y, _, _ = overfit_data()
    for _i in range(n):
        yield (x, y), list(range(len(x)))


def overfit_validate(every: int = 5):
    _, _, vx, vy = overfit_data()

    def validate(i, model):
        if (i + 1) % every:
            return None
        with torch.no_grad():
            return {"val_loss": F.mse_loss(model(vx), vy).item()}

    return validate


# --- plateau: a learning rate stuck near zero for the first 40% of the run, then normal -----------


def build_plateau():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, plateau_factor)
    return model, opt, sched


def plateau_factor(step: int) -> float:
    return 1e-4 if step < 120 else 1.0


# --- frozen layer: fc1 is left out of the optimizer (a classic bug), so it never moves -------------


def build_frozen():
    torch.manual_seed(0)
    model = MLP()
    return model, torch.optim.AdamW(model.fc2.parameters(), lr=1e-2)


# --- imbalanced layer: the middle layer is re-parametrized w = 1e-3 * W, so its gradient is ------
# 1e-3 of what its neighbours see while the forward pass is unchanged.


class ScaledLinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, scale: float):
        super().__init__()
        ref = nn.Linear(d_in, d_out)
        self.scale = scale
        self.weight = nn.Parameter(ref.weight.detach() / scale)
        self.bias = nn.Parameter(ref.bias.detach() / scale)

    def forward(self, x):
        return F.linear(x, self.weight * self.scale, self.bias * self.scale)


class DeepMLP(nn.Module):
    def __init__(self, scale_middle: float = 1.0):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = ScaledLinear(32, 32, scale_middle) if scale_middle != 1.0 else nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 32)
        self.fc4 = nn.Linear(32, 1)

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        x = torch.relu(self.fc3(x))
        return self.fc4(x)


def build_deep():
    torch.manual_seed(0)
    model = DeepMLP()
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def build_imbalanced():
    torch.manual_seed(0)
    model = DeepMLP(scale_middle=1e-3)
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


# --- dirty data ----------------------------------------------------------------------------------
# Token batches: {"ids": int64[B, T] right-padded with PAD, "quality": float32[B]} with sample ids
# "doc-<step>-<row>". Planted, one of each kind (step, row):
DIRTY_VOCAB, DIRTY_PAD, DIRTY_SEQ = 64, 0, 17
PLANTED = {
    (5, 2): "all_padding",  # every token is the pad id
    (7, 1): "out_of_range",  # token id 500 >= vocab 64
    (9, 3): "length",  # 2 real tokens where rows hold 12..17
    (11, 0): "duplicate",  # the content of (3, 4) under another sample id
    (13, 5): "nonfinite",  # quality = NaN
    (15, 6): "extreme",  # quality = 1e6 (others ~ N(1, 0.1))
}


def dirty_lm_batches(n: int = 24, batch: int = 8, seed: int = 5, plant: bool = True):
    g = torch.Generator().manual_seed(seed)
    keep = {}
    for step in range(n):
        ids = torch.randint(1, DIRTY_VOCAB, (batch, DIRTY_SEQ), generator=g)
        lengths = torch.randint(12, DIRTY_SEQ + 1, (batch,), generator=g)
        ids[torch.arange(DIRTY_SEQ) >= lengths[:, None]] = DIRTY_PAD
        quality = 1 + 0.1 * torch.randn(batch, generator=g)
        if plant:
            if step == 3:
                keep["dup"] = ids[4].clone(), quality[4].clone()
            if step == 5:
                ids[2] = DIRTY_PAD
            if step == 7:
                ids[1, 3] = 500
            if step == 9:
                ids[3, 2:] = DIRTY_PAD
            if step == 11:  # the whole row (every field) again, under another sample id
                ids[0], quality[0] = keep["dup"]
            if step == 13:
                quality[5] = float("nan")
            if step == 15:
                quality[6] = 1e6
        yield {"ids": ids, "quality": quality}, [f"doc-{step}-{r}" for r in range(batch)]


def build_dirty_lm():
    torch.manual_seed(0)
    model = TinyLM(vocab=DIRTY_VOCAB, ctx=DIRTY_SEQ)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def step_dirty_lm(model, optimizer, batch):
    """Clamps ids into the vocabulary (as a `% vocab` pipeline would): dirty ids do not crash."""
    ids = batch["ids"].clamp(0, DIRTY_VOCAB - 1)
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), ignore_index=DIRTY_PAD)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def nan_batches(n: int):
    """Every input NaN: the loss, the gradients and (after the first update) the weights are NaN."""
    for (x, y), ids in regression_batches(n):
        yield (torch.full_like(x, float("nan")), y), ids


def spiky_regression_batches(n: int, spike_step: int, batch: int = 16, seed: int = 1):
    """Regression batches with one absurd target (y = 1e3) at (spike_step, row 3)."""
    for step, ((x, y), ids) in enumerate(regression_batches(n, batch=batch, seed=seed)):
        if step == spike_step:
            y = y.clone()
            y[3] = 1e3
        yield (x, y), ids


# --- a negative loss (a Gaussian log-likelihood's, say): the MLP's MSE shifted down by 10 -------


def step_negative(model, optimizer, batch):
    x, y = batch
    loss = F.mse_loss(model(x), y) - 10.0
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


# --- a loop that skips the update on a loss spike (no backward: the step has no gradient) ------


def step_skip_spikes(model, optimizer, batch):
    x, y = batch
    loss = F.mse_loss(model(x), y)
    if loss.item() > 100:
        return loss.detach()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


# --- a nested batch: strings, a dict of token ids and an attention mask, a float target ---------


def nested_batches(n: int = 12, batch: int = 6, seed: int = 7):
    """Planted: (4, 1) has an empty text, (6, 2) an all-zero attention mask."""
    g = torch.Generator().manual_seed(seed)
    for step in range(n):
        ids = torch.randint(1, 50, (batch, 10), generator=g)
        mask = torch.ones(batch, 10, dtype=torch.int64)
        text = [f"document {step}-{r} " + "word " * int(r + 3) for r in range(batch)]
        if step == 4:
            text[1] = ""
        if step == 6:
            mask[2] = 0
        y = torch.randn(batch, generator=g)
        yield (
            {"text": text, "inputs": {"ids": ids, "attention_mask": mask}, "y": y},
            [f"n{step}-{r}" for r in range(batch)],
        )


def build_nested():
    torch.manual_seed(0)
    model = nn.EmbeddingBag(50, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def step_nested(model, optimizer, batch):
    loss = F.mse_loss(model(batch["inputs"]["ids"]).squeeze(1), batch["y"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


# --- exploding weights: the loss rewards large outputs (unbounded below), so AdamW moves every ---------
# weight by ~lr per element per step: norms grow 10x+ from the default init within 100 steps.


def build_grow():
    torch.manual_seed(0)
    model = MLP()
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.0)


def build_grow_zero_in():
    """The same, with fc1.weight starting at zero: it explodes from nothing."""
    model, opt = build_grow()
    nn.init.zeros_(model.fc1.weight)
    return model, opt


def step_grow(model, optimizer, batch):
    x, _ = batch
    loss = -model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


# --- a zero-initialised output layer (as LoRA B, adaLN-Zero or a zero-init projection): its norm -------
# after the first update is ~lr * sqrt(numel), so normal learning grows it far more than 10x from there.


def build_zero_out():
    torch.manual_seed(0)
    model = MLP()
    nn.init.zeros_(model.fc2.weight)
    nn.init.zeros_(model.fc2.bias)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


# --- a precursor: a branch switched on at step 37 gets AdamW's first update with an empty -----
# second moment (its gradients were exactly zero before): a sign-like step that moves its tiny
# weights ~100x their norm. The loss at step 37 is normal (the update comes after it); it spikes
# at step 38, on an ordinary batch.


class GatedBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = MLP()
        self.side = nn.Linear(8, 1)
        with torch.no_grad():
            self.side.weight.mul_(1e-4)
            self.side.bias.zero_()

    def forward(self, x, gate):
        return self.main(x) + gate * 100.0 * self.side(x)


def build_gated():
    torch.manual_seed(0)
    model = GatedBranch()
    return model, torch.optim.AdamW(model.parameters(), lr=5e-2)


def step_gated(model, optimizer, batch):
    x, y, gate = batch
    loss = F.mse_loss(model(x, gate), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def gated_batches(n: int, switch_on: int = 37):
    for step, ((x, y), ids) in enumerate(regression_batches(n)):
        yield (x, y, torch.tensor(1.0 if step >= switch_on else 0.0)), ids
