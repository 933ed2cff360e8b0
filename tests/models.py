"""Tiny models, their build_fn/step_fn, and a helper to record real runs in a temp dir.

build/step functions must live at module level (replay imports them by name), which is why
they are here and not inside tests.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab

# --- a tiny MLP regressor: batch = (x[B, 8], y[B, 1]) -------------------------------------------


class MLP(nn.Module):
    def __init__(self, d_in: int = 8, hidden: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def build_mlp():
    torch.manual_seed(0)
    model = MLP()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step_mlp(model, optimizer, batch):
    x, y = batch
    loss = F.mse_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def mlp_batches(n: int, batch: int = 4, seed: int = 1):
    """(batch, sample_ids) pairs; sample ids are 1000 * step + row."""
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        x = torch.randn(batch, 8, generator=g)
        y = x[:, :1] * 0.5 + 0.1 * torch.randn(batch, 1, generator=g)
        yield (x, y), [1000 * i + r for r in range(batch)]


# --- a tiny causal transformer LM: batch = {"ids": int64[B, T]} -----------------------------------


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2, heads: int = 2, ctx: int = 16):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT

    def forward(self, ids):
        B, T = ids.shape
        x = self.wte(ids) + self.wpe(torch.arange(T))  # (B, T, d)
        mask = torch.triu(torch.full((T, T), float("-inf")), diagonal=1)
        for block in self.blocks:
            x = block(x, mask)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


def build_lm():
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    return model, opt, sched


def step_lm(model, optimizer, batch):
    ids = batch["ids"]
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def lm_batches(n: int, batch: int = 4, seq: int = 17, vocab: int = 64, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        ids = (start + torch.arange(seq)) % vocab  # learnable: counting modulo vocab
        yield {"ids": ids}, [f"doc-{i}-{r}" for r in range(batch)]


# --- recording helper ---------------------------------------------------------------------------


def record_run(run_dir, build, step, batches, *, stop_on_nonfinite: bool = True, validate=None, **recorder_kw):
    """Record `batches` with a fresh model from `build`; returns the list of losses.

    `validate(i, model) -> dict | None` may return validation metrics after step i.
    """
    built = build()
    model, opt = built[0], built[1]
    sched = built[2] if len(built) > 2 else None
    losses = []
    with ckptlab.Recorder(run_dir, model, opt, step_fn=step, build_fn=build, scheduler=sched, **recorder_kw) as rec:
        for i, (batch, ids) in enumerate(batches):
            try:
                losses.append(rec.step(batch, sample_ids=ids).item())
            except ckptlab.NonFiniteLoss:
                losses.append(math.nan)
                if stop_on_nonfinite:
                    break
            if validate is not None:
                metrics = validate(i, model)
                if metrics:
                    rec.log_validation(**metrics)
    return losses


# --- a build_fn that prints and compiles (torch.compile prefixes names with `_orig_mod.`) ------


def build_compiled_noisy():
    print("building the model (a chatty build_fn)")
    model, opt = build_mlp()
    return torch.compile(model, backend="eager"), opt
