"""A loop whose time goes where `ckptlab report` must say it goes: a data loader that sleeps
before some items, and a model that takes a slow path on some batches (a planted long
sequence; a batch of another size, which makes torch.compile recompile its head).

    batches = loop_batches()          # ({"ids": int64[B, T], "y": int64[B]}, sample ids), with the sleeps
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH = 64, 16
STEPS = 32
ROWS, SEQ = 4, 16
# Long enough to stand out of a shared 2-core host's slowest usual steps (~0.15 s under a load of 10).
SLEEPY = {6: 0.4, 11: 0.4, 18: 0.4, 27: 0.4}  # step -> seconds the loader sleeps before its batch
LONG_STEP, LONG_SEQ = 14, 256  # a batch 16x longer than usual ...
SLOW_PATH = 0.4  # ... takes the model's slow path (seconds)
RECOMPILE_STEP, RECOMPILE_ROWS = 22, 6  # a batch of 6 rows: the compiled head recompiles (dynamic=False)


def _head(pooled, weight, bias):  # (B, C) -> (B, VOCAB)
    return F.linear(torch.tanh(pooled), weight, bias)


head = torch.compile(_head, backend="eager", dynamic=False)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):  # (B, T) -> (B, VOCAB)
        if ids.shape[1] > 4 * SEQ:  # the slow path of long sequences
            time.sleep(SLOW_PATH)
        return head(self.emb(ids).mean(1), self.out.weight, self.out.bias)


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
    """(batch, sample_ids) for each step, the loader sleeping where SLEEPY says."""
    g = torch.Generator().manual_seed(1)
    for i in range(n):
        rows = RECOMPILE_ROWS if i == RECOMPILE_STEP else ROWS
        seq = LONG_SEQ if i == LONG_STEP else SEQ
        if i in SLEEPY:
            time.sleep(SLEEPY[i])
        ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
        yield {"ids": ids, "y": ids[:, 0]}, [100 * i + r for r in range(rows)]
