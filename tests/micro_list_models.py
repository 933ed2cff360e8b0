"""Gradient accumulation by hand: a plain `step_fn(model, optimizer, batch)` whose batch is a
Python list of micro-batches `[(tokens0, y0), (tokens1, y1)]` (2 of 4 rows each), the step's
sample ids numbered across them in order. Two planted faults: a NaN target, and a token id
outside the vocabulary (the embedding raises), both in micro-batch 1 row 2 (the step's row 6).

Build and step functions live at module level: replay imports them by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab

VOCAB, T, D = 20, 5, 8
MICRO, ROWS = 2, 4  # micro-batches per step, rows per micro-batch
BAD_STEP, BAD_MICRO, BAD_ROW = 6, 1, 2


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.out = nn.Linear(D, 1)

    def forward(self, tokens):
        return self.out(self.emb(tokens).mean(dim=1))


def build():
    torch.manual_seed(0)
    m = Bag()
    return m, torch.optim.SGD(m.parameters(), lr=0.05)


def step(model, optimizer, batch):
    total = 0.0
    for tokens, y in batch:  # accumulate over the micro-batches, one update
        loss = F.mse_loss(model(tokens), y) / len(batch)
        loss.backward()
        total += loss.detach()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def batch(step_no: int, fault: str | None = None) -> list:
    g = torch.Generator().manual_seed(step_no)
    parts = []
    for m in range(MICRO):
        tokens = torch.randint(0, VOCAB, (ROWS, T), generator=g)
        y = torch.randn(ROWS, 1, generator=g)
        if step_no == BAD_STEP and m == BAD_MICRO:
            if fault == "nan":
                y[BAD_ROW, 0] = float("nan")
            elif fault == "token":
                tokens[BAD_ROW, 3] = VOCAB + 7
        parts.append((tokens, y))
    return parts


def sample_ids(step_no: int) -> list[int]:
    return [100 * step_no + r for r in range(MICRO * ROWS)]


BAD_SAMPLE = 100 * BAD_STEP + BAD_MICRO * ROWS + BAD_ROW


def record(run_dir, fault: str) -> None:
    """Record up to the planted fault (`fault`: "nan" or "token"), ckpt_every=5."""
    model, opt = build()
    with pytest.raises((ckptlab.NonFiniteLoss, IndexError)):
        with ckptlab.Recorder(run_dir, model, opt, step_fn=step, build_fn=build, ckpt_every=5) as rec:
            for s in range(BAD_STEP + 2):
                rec.step(batch(s, fault), sample_ids=sample_ids(s))
