"""Models with planted faults for the replay tests. Each `record_*` function records a real run
in `run_dir` and returns what replay must find: the step, module and rows/samples to blame.

Build and step functions live at module level: replay imports them by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab
from tests.models import MLP, step_mlp  # noqa: F401 - step_mlp is recorded as these runs' step_fn

B = 6  # rows per batch; sample id of row r at step s is 100 * s + r


def ids(step: int, rows: int = B) -> list[int]:
    return [100 * step + r for r in range(rows)]


@dataclass
class Expected:
    step: int  # root step
    symptom: int  # the step whose loss went non-finite (what a user asks about)
    module: str | None
    rows: list[int] = field(default_factory=list)
    kind: str | None = None
    op: str | None = None

    @property
    def sample_ids(self) -> list[int]:
        return [100 * self.step + r for r in self.rows]


def _record(run_dir, build, step, batches, **kw) -> list[float]:
    """Record `batches` (sample ids from `ids(step)`); the losses, stopping at the first NaN."""
    return record_pairs(run_dir, build, step, ((b, ids(s)) for s, b in enumerate(batches)), **kw)[0]


def record_pairs(run_dir, build, step, batches, **kw) -> tuple[list[float], nn.Module]:
    """Record (batch, sample_ids) pairs with ckpt_every=10; stops at the first non-finite loss.
    Returns the losses and the trained model."""
    built = build()
    model, opt = built[0], built[1]
    sched = built[2] if len(built) > 2 else None
    losses = []
    with ckptlab.Recorder(
        run_dir, model, opt, step_fn=step, build_fn=build, scheduler=sched, ckpt_every=10, **kw
    ) as rec:
        for batch, sample_ids in batches:
            try:
                losses.append(rec.step(batch, sample_ids=sample_ids).item())
            except ckptlab.NonFiniteLoss:
                losses.append(math.nan)
                break
    return losses, model


def _xy(step: int, d: int = 8):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(B, d, generator=g)
    y = x[:, :1] * 0.5 + 0.1 * torch.randn(B, 1, generator=g)
    return x, y


# --- 1/2. tiny MLP (tests.models): NaN in an input feature; an input that overflows fc1 ---------


def build_mlp():
    torch.manual_seed(0)
    m = MLP()
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def record_input_nan(run_dir) -> Expected:
    def batches():
        for s in range(40):
            x, y = _xy(s)
            if s == 27:
                x[4, 2] = float("nan")
            yield x, y

    _record(run_dir, build_mlp, step_mlp, batches())
    return Expected(27, 27, None, [4], kind="data")


def record_input_overflow(run_dir) -> Expected:
    def batches():
        for s in range(40):
            x, y = _xy(s)
            if s == 23:
                x[1] = 3e38  # finite, absurd: fc1's matmul sums to Inf
            yield x, y

    _record(run_dir, build_mlp, step_mlp, batches())
    return Expected(23, 23, "fc1", [1], kind="data", op="aten.addmm.default")


# --- 3. embedding-bag classifier with a custom mean pooling: 0/0 on an empty bag ------------------


class MeanPool(nn.Module):
    def forward(self, summed, lengths):  # (B, d), (B,)
        return summed / lengths.unsqueeze(1).float()  # an empty bag: 0 / 0


class BagClassifier(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 16, classes: int = 3):
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, d, mode="sum")
        self.pool = MeanPool()
        self.head = nn.Linear(d, classes)

    def forward(self, tokens, offsets, lengths):
        return self.head(self.pool(self.emb(tokens, offsets), lengths))


def build_bag():
    torch.manual_seed(0)
    m = BagClassifier()
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def step_bag(model, opt, batch):
    logits = model(batch["tokens"], batch["offsets"], batch["lengths"])
    loss = F.cross_entropy(logits, batch["label"])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def record_empty_bag(run_dir) -> Expected:
    def batches():
        for s in range(30):
            g = torch.Generator().manual_seed(s)
            lengths = torch.randint(1, 6, (B,), generator=g)
            if s == 16:
                lengths[3] = 0  # an empty sample
            tokens = torch.randint(0, 50, (int(lengths.sum()),), generator=g)
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
            yield {
                "tokens": tokens,
                "offsets": offsets,
                "lengths": lengths,
                "label": torch.randint(0, 3, (B,), generator=g),
            }

    _record(run_dir, build_bag, step_bag, batches())
    return Expected(16, 16, "pool", [3], kind="numeric", op="aten.div.Tensor")


# --- 4. log of a negative value in a custom feature module ----------------------------------------


class LogFeature(nn.Module):
    def forward(self, x):
        return torch.cat([x[:, 1:], torch.log(x[:, :1] + 4.0)], dim=1)  # assumes x[:, 0] > -4


class LogMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.logfeat = LogFeature()
        self.mlp = MLP()

    def forward(self, x):
        return self.mlp(self.logfeat(x))


def build_logmlp():
    torch.manual_seed(0)
    m = LogMLP()
    return m, torch.optim.SGD(m.parameters(), lr=1e-2)


def record_log_negative(run_dir) -> Expected:
    def batches():
        for s in range(30):
            x, y = _xy(s)
            if s == 14:
                x[2, 0] = -5.0  # not absurd, just outside the feature's domain
            yield x, y

    _record(run_dir, build_logmlp, step_mlp, batches())
    return Expected(14, 14, "logfeat", [2], kind="numeric", op="aten.log.default")


# --- 5. float16 overflow in a half-precision submodule --------------------------------------------


class HalfBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8).half()
        with torch.no_grad():
            self.proj.weight.mul_(2000.0)  # activations ~1e3: fine in fp16 until a 100x row

    def forward(self, x):
        return self.proj(x.half()).float()


class HalfNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.half_block = HalfBlock()
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.half_block(x) / 1000.0)


def build_half():
    torch.manual_seed(0)
    m = HalfNet()
    return m, torch.optim.SGD([p for p in m.parameters() if p.dtype == torch.float32], lr=1e-3)


def record_fp16_overflow(run_dir) -> Expected:
    def batches():
        for s in range(30):
            x, y = _xy(s)
            if s == 21:
                x[5] = x[5] * 0 + 400.0  # ~200x typical (not absurd): ~1e6 in fp16 > 65504
            yield x, y

    _record(run_dir, build_half, step_mlp, batches())
    # a float16 overflow: in float32 (the whole model: the block hands float16 on) the step
    # stays finite, though the row still makes the loss spike (~700)
    return Expected(21, 21, "half_block.proj", [5], kind="precision")


# --- 6. a tiny transformer whose attention softmax gets a fully masked row -------------------------


class Attention(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, pad):  # x (B, T, d), pad (B, T) True = padding
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = q @ k.transpose(1, 2) / math.sqrt(q.size(-1))  # (B, T, T)
        att = att.masked_fill(pad[:, None, :], float("-inf"))
        att = att.softmax(dim=-1)  # a row with every key padded: NaN
        return self.proj(att @ v)


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = Attention(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, pad):
        x = x + self.attn(self.ln(x), pad)
        return x + self.mlp(x)


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16, layers: int = 2):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, 2)

    def forward(self, ids, pad):
        x = self.wte(ids)
        for b in self.blocks:
            x = b(x, pad)
        return self.head(x.mean(dim=1))


def build_transformer():
    torch.manual_seed(0)
    m = TinyTransformer()
    return m, torch.optim.AdamW(m.parameters(), lr=3e-3)


def step_transformer(model, opt, batch):
    ids, label = batch["ids"], batch["label"]
    logits = model(ids, ids == 0)  # token 0 is padding
    loss = F.cross_entropy(logits, label)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def record_masked_attention(run_dir) -> Expected:
    def batches():
        for s in range(30):
            g = torch.Generator().manual_seed(s)
            ids_ = torch.randint(1, 32, (B, 8), generator=g)
            ids_[:, 6:] = 0  # some padding everywhere
            if s == 12:
                ids_[5] = 0  # an empty sequence: every key of row 5 is padding
            yield {"ids": ids_, "label": torch.randint(0, 2, (B,), generator=g)}

    _record(run_dir, build_transformer, step_transformer, batches())
    return Expected(12, 12, "blocks.0.attn", [5], kind="numeric", op="aten._softmax.default")


# --- 7. a huge regression target: gradients explode, weights go NaN one step later ---------------


def build_sgd_mlp():
    torch.manual_seed(0)
    m = MLP()
    return m, torch.optim.SGD(m.parameters(), lr=0.05)


def step_plain(model, opt, batch):
    x, y = batch
    loss = F.mse_loss(model(x), y)
    loss.backward()  # no clipping: this is the run that blows up
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def record_huge_target(run_dir) -> Expected:
    def batches():
        for s in range(40):
            x, y = _xy(s)
            if s == 25:
                y[3] = 1e17  # a corrupt label, finite
            yield x, y

    losses = _record(run_dir, build_sgd_mlp, step_plain, batches())
    symptom = next(i for i, v in enumerate(losses) if not math.isfinite(v))
    return Expected(25, symptom, None, [3], kind="data")


# --- 8. a learning-rate schedule spike: no sample to blame --------------------------------------


def _spiky(step: int) -> float:
    return 1e5 if step == 18 else 1.0  # a bug in the schedule at step 18


def build_spiky():
    torch.manual_seed(0)
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    return m, opt, torch.optim.lr_scheduler.LambdaLR(opt, _spiky)


def record_lr_spike(run_dir) -> Expected:
    losses = _record(run_dir, build_spiky, step_plain, (_xy(s) for s in range(40)))
    symptom = next(i for i, v in enumerate(losses) if not math.isfinite(v) or v > 1e6)
    return Expected(18, symptom, None, [], kind="optimizer")


# --- 9. a weight corrupted outside the recorded computation ------------------------------------


def record_corrupted_weight(run_dir) -> Expected:
    model, opt = build_mlp()
    with ckptlab.Recorder(run_dir, model, opt, step_fn=step_mlp, build_fn=build_mlp, ckpt_every=10) as rec:
        for s in range(30):
            try:
                rec.step(_xy(s), sample_ids=ids(s))
            except ckptlab.NonFiniteLoss:
                break
            if s == 23:
                with torch.no_grad():
                    model.fc1.weight[3, 3] = float("nan")  # a bit flip in memory, not in step_fn
    return Expected(24, 24, None, [])


# --- 10. a nanoGPT-shaped step that loops over one-row micro-batches: a row whose targets are all
# ignore_index makes that micro-batch's cross-entropy 0/0 = NaN -------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.c_attn(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class MicroGPT(nn.Module):
    """nanoGPT's shape: forward(idx, targets) returns (logits, loss), the loss computed inside."""

    def __init__(self, vocab: int = 32, ctx: int = 8, d: int = 16, heads: int = 2, layers: int = 2):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.h = nn.ModuleList(GPTBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # tied

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:  # a row whose targets are all -100: 0 / 0 = NaN
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)
        return logits, loss


def build_micro_gpt():
    torch.manual_seed(0)
    m = MicroGPT()
    return m, torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)


def _accumulate(model, opt, batch, size: int = 1, copy: bool = False):
    """Gradient accumulation over micro-batches of `size` rows, as nanoGPT's train loop does."""
    x, y = batch["x"], batch["y"]
    starts = range(0, x.size(0), size)
    gas = len(starts)
    total = torch.zeros(())
    for i in starts:
        xb, yb = x[i : i + size], y[i : i + size]
        if copy:  # e.g. `.pin_memory().to(device)`: no longer a view into the batch
            xb, yb = xb.clone(), yb.clone()
        _, loss = model(xb, yb)
        loss = loss / gas
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def step_micro_gpt(model, opt, batch):
    return _accumulate(model, opt, batch)


def step_micro_gpt_copied(model, opt, batch):
    return _accumulate(model, opt, batch, copy=True)


def step_micro_gpt_pairs(model, opt, batch):
    return _accumulate(model, opt, batch, size=2)


def record_micro_batch_ignored_targets(run_dir, step_fn=step_micro_gpt, empty_rows=(2,), **record) -> Expected:
    def batches():
        for s in range(30):
            g = torch.Generator().manual_seed(s)
            start = torch.randint(0, 32, (B, 1), generator=g)
            seq = (start + torch.arange(9)) % 32  # learnable: counting modulo the vocabulary
            y = seq[:, 1:].clone()
            y[:, :2] = -100  # the prompt is not trained on
            if s == 17:
                y[list(empty_rows)] = -100  # nothing to train on: its micro-batch's loss is 0/0
            yield {"x": seq[:, :-1], "y": y}

    _record(run_dir, build_micro_gpt, step_fn, batches(), **record)
    return Expected(17, 17, "", list(empty_rows), kind="numeric", op="aten.nll_loss_forward.default")


def record_micro_batch_copied(run_dir) -> Expected:
    return record_micro_batch_ignored_targets(run_dir, step_micro_gpt_copied, (4,))


def record_micro_batch_pairs(run_dir) -> Expected:
    return record_micro_batch_ignored_targets(run_dir, step_micro_gpt_pairs, (2, 3))


# --- delayed scaling (as in FP8 training): a blank batch at step 21 dooms step 22 ---------------


class DelayedScaleMLP(nn.Module):
    """Scales its input by the absolute maximum of the previous batch's, then casts to float16
    (FP8-style delayed scaling, history of one). A near-blank batch sets that maximum near zero,
    so the next, normal batch overflows float16: the fault shows a step after its cause, and the
    faulting batch is harmless from any other state."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP()
        self.register_buffer("amax", torch.ones(()))

    def forward(self, x):
        scaled = (x / self.amax).half().float()  # > 65504 is Inf
        self.amax = x.detach().abs().max()
        return self.mlp(scaled)


def build_delayed_scale():
    torch.manual_seed(0)
    m = DelayedScaleMLP()
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


def record_delayed_scale(run_dir) -> Expected:
    def batches():
        for s in range(40):
            x, y = _xy(s)
            if s == 21:
                x, y = x * 1e-7, y * 1e-7  # a blank batch (e.g. an all-padding shard)
            yield x, y

    _record(run_dir, build_delayed_scale, step_mlp, batches())
    return Expected(22, 22, "mlp.fc1", [], kind="numeric")


# --- Adam's second moment never grew: a feature that switches on late ------------------------


class LateFeatureModel(nn.Module):
    """A small MLP on the first 8 features, plus a large matrix on 128 non-negative features
    (counts) that are zero until step 25 (a data source that comes online late). Adam's second moment of that matrix
    stays 0 until its first real gradient, which then moves every element by ~lr at once: an
    update far larger than the matrix, from clean data at a normal learning rate."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP(d_in=8, hidden=4)
        self.late = nn.Parameter(torch.full((128, 128), 1e-4))

    def forward(self, x):
        return self.mlp(x[:, :8]) + (x[:, 8:] @ self.late).mean(1, keepdim=True)


def build_late_feature():
    torch.manual_seed(0)
    m = LateFeatureModel()
    return m, torch.optim.Adam(m.parameters(), lr=2e-2)


def record_late_feature(run_dir) -> Expected:
    def batches():
        for s in range(40):
            x, y = _xy(s)
            g = torch.Generator().manual_seed(s)
            late = torch.randn(B, 128, generator=g).abs() if s >= 25 else torch.zeros(B, 128)  # counts, >= 0
            yield torch.cat([x, late], 1), y

    losses = _record(run_dir, build_late_feature, step_mlp, batches())
    symptom = next((i for i, v in enumerate(losses) if i > 25 and (not math.isfinite(v) or v > 10 * losses[24])), 26)
    return Expected(25, symptom, None, [], kind="optimizer")


# --- 12. noise from a generator no recording holds (an unseeded numpy Generator): every replay
# differs from the record and from every other replay; the recorded NaN came from a global that
# the training script changed between steps (code outside step_fn) --------------------------------

_UNRECORDED = np.random.default_rng()  # seeded by the OS: in no checkpoint and no RNG state


class Jitter(nn.Module):
    scale = 1e-3  # the script sets it to NaN before step 15

    def forward(self, x):
        return x + torch.from_numpy(_UNRECORDED.standard_normal(tuple(x.shape))).float() * self.scale


class JitterMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.jitter = Jitter()
        self.mlp = MLP()

    def forward(self, x):
        return self.mlp(self.jitter(x))


def build_jitter():
    torch.manual_seed(0)
    m = JitterMLP()
    return m, torch.optim.SGD(m.parameters(), lr=1e-2)


def record_unrecorded_noise(run_dir) -> Expected:
    model, opt = build_jitter()
    try:
        with ckptlab.Recorder(run_dir, model, opt, step_fn=step_mlp, build_fn=build_jitter, ckpt_every=10) as rec:
            for s in range(20):
                Jitter.scale = float("nan") if s == 15 else 1e-3
                try:
                    rec.step(_xy(s), sample_ids=ids(s))
                except ckptlab.NonFiniteLoss:
                    break
    finally:
        Jitter.scale = 1e-3
    return Expected(15, 15, "jitter", [])
