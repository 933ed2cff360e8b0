"""A loop with two slow steps for `ckptlab replay --profile`: one slow in the model (a long
batch sends module `mixer` down a path of many matmuls), one slowed from outside (the loop
sleeps before it, outside step_fn).

    batches = loop_batches()   # ({"ids": int64[B, T], "y": int64[B]}, sample ids), the loop's sleep included
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH = 64, 16
STEPS, CKPT_EVERY = 12, 4
ROWS, SEQ = 4, 16
SLOW_STEP, LONG_SEQ = 6, 128  # this step's batch is long: the mixer's slow path
SLEEPY_STEP, SLEEP = 9, 0.4  # the loop sleeps this long before this step (seconds)
SLOW_SIZE, SLOW_MATMULS = 384, 80  # the slow path: 80 (384, 384) matmuls, ~0.25 s on one idle core


class Mixer(nn.Module):
    """Mixes the sequence; a long one first goes through a slow path of matmuls."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("slow", torch.randn(SLOW_SIZE, SLOW_SIZE, generator=torch.Generator().manual_seed(3)) / 20)

    def forward(self, h):  # (B, T, C) -> (B, C)
        if h.shape[1] > 4 * SEQ:  # the slow path of long sequences
            with torch.no_grad():
                x = self.slow
                for _ in range(SLOW_MATMULS):
                    x = torch.tanh(x @ self.slow)  # (S, S)
            h = h + 0 * x.mean()
        return self.proj(h.mean(1))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.mixer = Mixer()
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):  # (B, T) -> (B, VOCAB)
        return self.out(torch.tanh(self.mixer(self.emb(ids))))


def build():
    torch.manual_seed(0)
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def step(model, optimizer, batch):
    loss = F.cross_entropy(model(batch["ids"]), batch["y"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def loop_batches(n: int = STEPS):
    """(batch, sample_ids) for each step; the loop sleeps before SLEEPY_STEP's."""
    g = torch.Generator().manual_seed(1)
    for i in range(n):
        if i == SLEEPY_STEP:
            time.sleep(SLEEP)
        ids = torch.randint(0, VOCAB, (ROWS, LONG_SEQ if i == SLOW_STEP else SEQ), generator=g)
        yield {"ids": ids, "y": ids[:, 0]}, [100 * i + r for r in range(ROWS)]
