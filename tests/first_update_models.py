"""Two planted faults whose root step's update is the explosion, while the loss explodes a step
or three later (issue #26, "every replayed step measured" and "an optimizer's first update"),
recorded as the zoo records (tests/fault_zoo.py): a checkpoint every 10 steps, update ratios
measured every 10 (`health_every`), so the record holds no update ratio at the root step.

- `adam_first_update`: a block switched on at step 37 (a gate in the batch: its gradients
  were exactly zero before, so Adam's `exp_avg_sq` of each of its parameters is all zero). Its
  output projection is tiny-initialized; the first real gradient meets the empty second
  moment and Adam moves every element by ~lr at once, ~60x that weight's norm. The loss
  explodes at step 38. Ground truth: root 37, kind optimizer, parameter `block.out.weight`.
- `hidden_update_explosion`: plain SGD; the embedding's learning rate is 1e5x at step 35
  only (a schedule bug in its parameter group), on a batch made of one rare token: that row
  of the embedding moves far beyond the weights' norm. Steps 36 and 37 never use the token;
  step 38 does, and its loss explodes. Ground truth: root 35 (not on `health_every`), kind
  optimizer.

Build and step functions live at module level: replay imports them by name.
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.fault_models import MLP, B, Expected, _xy, ids, record_pairs

HEALTH_EVERY = 10  # the root steps below are not multiples of it


def _loss_symptom(losses: list[float], root: int) -> int:
    """The step a user asks about: the first step after the root whose loss is non-finite or
    over 10x the median loss of the 10 steps before the root."""
    typical = statistics.median(losses[root - 10 : root])
    return next(i for i, v in enumerate(losses) if i > root and (not math.isfinite(v) or v > 10 * typical))


# --- Adam's first update with an empty second moment ------------------------------------------------


class LateBlock(nn.Module):
    """A small MLP on 128 count features; its output projection starts tiny (a residual
    branch initialized near zero, as many architectures do)."""

    def __init__(self, d: int = 128, hidden: int = 512):
        super().__init__()
        self.fc = nn.Linear(d, hidden)
        self.out = nn.Linear(hidden, 1)
        with torch.no_grad():
            self.out.weight.normal_(0, 1e-4)
            self.out.bias.zero_()

    def forward(self, feats):
        return self.out(torch.relu(self.fc(feats)))


class GatedModel(nn.Module):
    """An MLP on 8 features, plus the block, gated per row by the batch's `on` (0 before the
    block is switched on: its gradients are then exactly zero)."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP(d_in=8, hidden=16)
        self.block = LateBlock()

    def forward(self, x, feats, on):
        return self.mlp(x) + on[:, None] * self.block(feats)


def build_gated():
    torch.manual_seed(0)
    m = GatedModel()
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def step_gated(model, opt, batch):
    x, feats, on, y = batch
    loss = F.mse_loss(model(x, feats, on), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


SWITCH_ON = 37


def record_adam_first_update(run_dir, health_every: int = HEALTH_EVERY) -> Expected:
    def batches():
        for s in range(SWITCH_ON + 3):
            x, y = _xy(s)
            g = torch.Generator().manual_seed(7000 + s)
            feats = torch.randn(B, 128, generator=g).abs()  # counts, >= 0
            on = torch.full((B,), float(s >= SWITCH_ON))
            yield (x, feats, on, y), ids(s)

    losses, _ = record_pairs(run_dir, build_gated, step_gated, batches(), health_every=health_every)
    return Expected(SWITCH_ON, _loss_symptom(losses, SWITCH_ON), None, [], kind="optimizer")


# --- an update explosion between two measured steps ---------------------------------------------------

VOCAB, RARE, GLITCH = 32, 30, 35


class BagModel(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.head = nn.Linear(d, 1)

    def forward(self, tokens):
        return self.head(self.emb(tokens).mean(dim=1))


def _glitch(step: int) -> float:
    return 1e5 if step == GLITCH else 1.0  # the embedding group's schedule, with a bug at one step


def build_bag():
    torch.manual_seed(0)
    m = BagModel()
    opt = torch.optim.SGD([{"params": m.emb.parameters()}, {"params": m.head.parameters()}], lr=1e-2)
    return m, opt, torch.optim.lr_scheduler.LambdaLR(opt, [_glitch, lambda step: 1.0])


def step_bag(model, opt, batch):
    tokens, y = batch
    loss = F.mse_loss(model(tokens), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def record_hidden_update_explosion(run_dir) -> Expected:
    def batches():
        for s in range(GLITCH + 5):
            g = torch.Generator().manual_seed(8000 + s)
            tokens = torch.randint(1, RARE, (B, 8), generator=g)  # ordinary tokens: never the rare one
            if s == GLITCH:
                tokens[:] = RARE  # a batch of the rare token: only its embedding row moves
            if s == GLITCH + 3:
                tokens[2, :4] = RARE
            yield (tokens, torch.randn(B, 1, generator=g)), ids(s)

    losses, _ = record_pairs(run_dir, build_bag, step_bag, batches(), health_every=HEALTH_EVERY)
    return Expected(GLITCH, _loss_symptom(losses, GLITCH), None, [], kind="optimizer")
