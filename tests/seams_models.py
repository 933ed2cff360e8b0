"""Loops of shapes found in public training code, for the tests of what happens at the seams
between the user's code and replay (tests/test_seams.py). Each `record_*` records a real run and
returns what replay must find.

- The word-level LSTM language model of the classic examples: a chunk is `data` (bptt, B) and
  `targets` flattened to (bptt*B,) (`source[i+1:i+1+bptt].view(-1)`), the hidden state carried
  from chunk to chunk in the batch, (layers, B, H) each.
- A (conditional) VAE whose `reparameterize` draws `randn_like` every step and whose loss is
  binary cross-entropy, which refuses inputs outside [0, 1]: a value that went non-finite makes
  the step raise.
- A loop that clips with `error_if_nonfinite=True` (Lightning Fabric's default).

Build and step functions live at module level: replay imports them by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab

# --- the word-level language model --------------------------------------------------------------

VOCAB, EMB, HID, LAYERS, BPTT, B = 40, 16, 16, 2, 5, 4


class RNNModel(nn.Module):
    """Encoder, LSTM, decoder, as in the word-level language model examples (sequence-first)."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, EMB)
        self.rnn = nn.LSTM(EMB, HID, LAYERS)
        self.decoder = nn.Linear(HID, VOCAB)

    def forward(self, data, hidden):
        output, hidden = self.rnn(self.encoder(data), hidden)  # (T, B, H)
        return self.decoder(output).view(-1, VOCAB), hidden


def build_lm():
    torch.manual_seed(0)
    model = RNNModel()
    return model, torch.optim.SGD(model.parameters(), lr=1.0)


def step_lm(model, optimizer, batch):
    data, targets, h, c = batch  # (T, B) ints, (T*B,) ints, (layers, B, H) floats twice
    output, _ = model(data, (h, c))
    loss = F.cross_entropy(output, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def step_lm_whole_batches_only(model, optimizer, batch):
    """The same step, from code that checks it got the batch it was built for (a checksum the
    data loader put beside it): every experiment that changes the batch makes it raise."""
    data, targets, h, c, checksum = batch
    if int(data.sum() + targets.sum()) != int(checksum):
        raise ValueError("the batch does not match its checksum")
    return step_lm(model, optimizer, (data, targets, h, c))


def lm_chunks(steps: int, bad_step: int, bad_col: int, *, checksum: bool = False):
    """(batch, sample_ids) per step: a chunk of a fixed token stream, the hidden state carried
    (as the loop carries it: the previous chunk's, detached; here a fixed one per step, which is
    what the recording holds either way); at `bad_step` column `bad_col`'s carried state is NaN."""
    g = torch.Generator().manual_seed(7)
    stream = torch.randint(0, VOCAB, (steps * BPTT + 1, B), generator=g)
    for s in range(steps):
        i = s * BPTT
        data, targets = stream[i : i + BPTT], stream[i + 1 : i + 1 + BPTT].reshape(-1)
        h, c = 0.1 * torch.randn(LAYERS, B, HID, generator=g), 0.1 * torch.randn(LAYERS, B, HID, generator=g)
        if s == bad_step:
            h[0, bad_col, 3] = float("nan")
        batch = (data, targets, h, c)
        if checksum:
            batch = (*batch, data.sum() + targets.sum())
        yield batch, [f"chunk{s}/col{b}" for b in range(B)]


# --- the VAE -------------------------------------------------------------------------------------

PIXELS, LATENT, COND = 16, 4, 2


class VAE(nn.Module):
    """The classic MLP VAE, its encoder also given a few condition features per image."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(PIXELS + COND, 32)
        self.fc21 = nn.Linear(32, LATENT)
        self.fc22 = nn.Linear(32, LATENT)
        self.fc3 = nn.Linear(LATENT, 32)
        self.fc4 = nn.Linear(32, PIXELS)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z):
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z))))

    def forward(self, x, cond):
        mu, logvar = self.encode(torch.cat([x, cond], dim=1))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


def build_vae():
    torch.manual_seed(0)
    model = VAE()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def step_vae(model, optimizer, batch):
    x, cond = batch  # (B, PIXELS) in [0, 1] (binary_cross_entropy raises outside it), (B, COND)
    recon, mu, logvar = model(x, cond)
    bce = F.binary_cross_entropy(recon, x, reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    loss = (bce + kld) / x.shape[0]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def step_vae_checked(model, optimizer, batch):
    """`step_vae` in code that refuses a non-finite loss before its backward."""
    x, cond = batch
    recon, mu, logvar = model(x, cond)
    loss = F.binary_cross_entropy(recon, x, reduction="sum") - 0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    if not torch.isfinite(loss):
        raise FloatingPointError(f"loss is {loss.item()}")
    (loss / x.shape[0]).backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss / x.shape[0]


def vae_images(step: int, rows: int = 6):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.rand(rows, PIXELS, generator=g), torch.randn(rows, COND, generator=g)


# --- BatchNorm: a NaN sample leaves the running statistics non-finite ----------------------------


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


def build_bn():
    torch.manual_seed(0)
    model = BNNet()
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def step_bn(model, optimizer, batch):
    x, y = batch
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def record_batchnorm_nan(run_dir) -> Expected:
    def batches():
        g = torch.Generator().manual_seed(3)
        for s in range(16):
            x = torch.randn(6, 8, generator=g)
            if s == 12:
                x[1, 5] = float("nan")
            yield (x, x[:, :1] * 0.5), [1000 * s + r for r in range(6)]

    last = record(run_dir, build_bn, step_bn, batches())
    return Expected(12, last, [12001])


# --- clipping that refuses a non-finite norm (Lightning Fabric's clip_gradients default) --------


class SmallMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def build_clipped():
    torch.manual_seed(0)
    model = SmallMLP()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step_clipped(model, optimizer, batch):
    x, y = batch
    loss = F.mse_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def record_clip_error_if_nonfinite(run_dir) -> Expected:
    """An Inf feature in row 2 of step 9: the gradients go non-finite and clipping raises on
    their norm before the optimizer steps."""

    def batches():
        g = torch.Generator().manual_seed(5)
        for s in range(12):
            x = torch.randn(4, 8, generator=g)
            if s == 9:
                x[2, 3] = float("inf")
            yield (x, x[:, :1]), [100 * s + r for r in range(4)]

    return Expected(9, record(run_dir, build_clipped, step_clipped, batches()), [902])


# --- a spike that recovers, then an unrelated step that raises ------------------------------------


class TokenRegressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.fc = nn.Linear(16, 1)

    def forward(self, ids, x):
        return self.fc(torch.cat([self.emb(ids).mean(1), x], dim=1))


def build_tokens():
    torch.manual_seed(0)
    model = TokenRegressor()
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def step_tokens(model, optimizer, batch):
    ids, x, y = batch
    loss = F.mse_loss(model(ids, x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the spike's update stays bounded
    optimizer.step()
    optimizer.zero_grad()
    return loss


def record_spike_then_crash(run_dir) -> Expected:
    """Step 18: an absurd target (a loss and gradient spike, clipped: nothing lasting); step 20:
    row 2 holds a token id outside the 20-entry vocabulary, and the embedding raises (row 0's
    NaN feature is never read: the step raises first). The crash is its own root: the spike two
    steps before it is over."""

    def batches():
        g = torch.Generator().manual_seed(9)
        for s in range(24):
            ids, x = torch.randint(0, 20, (4, 5), generator=g), torch.randn(4, 8, generator=g)
            y = x[:, :1] * 0.5
            if s == 18:
                y[1] = 1e4
            if s == 20:
                ids[2, 3] = 25
                x[0, 0] = float("nan")  # never reached: the embedding raises before x is read
            yield (ids, x, y), [100 * s + r for r in range(4)]

    return Expected(20, record(run_dir, build_tokens, step_tokens, batches()), [2002])


# --- what the tests expect ----------------------------------------------------------------------


@dataclass
class Expected:
    step: int  # root step
    symptom: int  # the step a user asks about
    sample_ids: list = field(default_factory=list)


def record(run_dir, build, step_fn, batches, *, lr_at: dict[int, float] | None = None, **kw) -> int:
    """Record (batch, sample_ids) pairs until a step raises or goes non-finite; returns the last
    step recorded. `lr_at`: {step: lr} set on every parameter group before that step, by the
    loop (outside step_fn), as a hand-written schedule does."""
    model, opt = build()
    n = -1
    with ckptlab.Recorder(run_dir, model, opt, step_fn=step_fn, build_fn=build, ckpt_every=10, **kw) as rec:
        for batch, ids in batches:
            n += 1
            for g in opt.param_groups:
                g["lr"] = (lr_at or {}).get(n, g["lr"])
            try:
                rec.step(batch, sample_ids=ids)
            except ckptlab.NonFiniteLoss:
                break
            except Exception:  # noqa: BLE001 - the user's step raised: recorded, the run stops
                break
    return n


def record_word_lm(run_dir, *, checksum: bool = False) -> Expected:
    step = step_lm_whole_batches_only if checksum else step_lm
    last = record(run_dir, build_lm, step, lm_chunks(30, bad_step=23, bad_col=2, checksum=checksum))
    return Expected(23, last, ["chunk23/col2"])


def record_vae_overflow(run_dir) -> Expected:
    """Row 4 of step 17 has a corrupt condition feature (1e5): the encoder's log-variance is
    huge, `exp(0.5 * logvar)` overflows to Inf in `reparameterize`, the decoder makes NaN of it,
    and binary cross-entropy raises on its input."""

    def batches():
        for s in range(25):
            x, cond = vae_images(s)
            if s == 17:
                cond[4, 1] = 1e5
            yield (x, cond), [f"img{s}-{r}" for r in range(x.shape[0])]

    last = record(run_dir, build_vae, step_vae, batches())
    return Expected(17, last, ["img17-4"])


def record_vae_lr_explosion(run_dir) -> Expected:
    """Adam's learning rate x1e13 at step 14 (set by the loop): the update explodes at step 14,
    and step 15, whose loss is then Inf, raises (the step refuses a non-finite loss)."""
    last = record(
        run_dir,
        build_vae,
        step_vae_checked,
        ((vae_images(s), [f"img{s}-{r}" for r in range(6)]) for s in range(25)),
        lr_at={14: 1e10, 15: 1e-3},
    )
    return Expected(14, last)
