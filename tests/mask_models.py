"""A tiny GPT-like model whose causal attention mask is non-finite on purpose, three ways: the
mask built as `log(tril(ones))` (-inf above the diagonal, made by an op from finite inputs),
an additive `float('-inf')` mask, and `masked_fill(..., -inf)` on the scores. Each is softmaxed
to 0 and harms nothing; the planted fault is one sample (row 5 of 8) whose per-sample scale is
absurd (1e30) at one step: the first LayerNorm turns its row into NaN. The mask is built first
in the model's forward, so the log mask's op runs before the LayerNorm that starts the fault.

Build and step functions live at module level: replay imports them by name.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab

VOCAB, T, D, B = 32, 8, 16, 8
BAD_STEP, BAD_ROW = 6, 5


def causal_mask(kind: str) -> torch.Tensor | None:
    """The additive (T, T) mask of `kind` (None: `masked_fill` on the scores instead)."""
    if kind == "log":
        return torch.log(torch.tril(torch.ones(T, T)))  # log 0 = -inf above the diagonal
    if kind == "additive":
        return torch.full((T, T), float("-inf")).triu(1)
    return None


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = q @ k.transpose(1, 2) / math.sqrt(D)  # (B, T, T)
        if mask is None:
            causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
            att = att.masked_fill(~causal, float("-inf"))
        else:
            att = att + mask
        return self.proj(att.softmax(dim=-1) @ v)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x, mask):
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, mask: str):
        super().__init__()
        self.mask = mask
        self.wte = nn.Embedding(VOCAB, D)
        self.wpe = nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens, scale):
        mask = causal_mask(self.mask)  # built before anything else runs
        x = (self.wte(tokens) + self.wpe(torch.arange(T))) * scale[:, None, None]
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln_f(x))


def _build(mask: str):
    torch.manual_seed(0)
    m = TinyGPT(mask)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def build_log():
    return _build("log")


def build_additive():
    return _build("additive")


def build_fill():
    return _build("fill")


BUILDS = {"log": build_log, "additive": build_additive, "fill": build_fill}


def step(model, optimizer, batch):
    tokens, targets, scale = batch  # (B, T) ints, (B, T) ints, (B,) floats (1.0 normally)
    loss = F.cross_entropy(model(tokens, scale).reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def batch(step_no: int, bad_step: int | None = BAD_STEP):
    g = torch.Generator().manual_seed(step_no)
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    scale = torch.ones(B)
    if step_no == bad_step:
        scale[BAD_ROW] = 1e30  # a corrupt sample weight: finite, absurd
    return tokens[:, :-1], tokens[:, 1:], scale


def sample_ids(step_no: int) -> list[int]:
    return [100 * step_no + r for r in range(B)]


def record(run_dir, mask: str, steps: int = BAD_STEP + 2) -> None:
    """Record `steps` steps of the `mask` model (ckpt_every=5), through the planted fault."""
    model, opt = BUILDS[mask]()
    with ckptlab.Recorder(run_dir, model, opt, step_fn=step, build_fn=BUILDS[mask], ckpt_every=5) as rec:
        for s in range(steps):
            try:
                rec.step(batch(s), sample_ids=sample_ids(s))
            except ckptlab.NonFiniteLoss:
                break
