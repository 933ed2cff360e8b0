"""An MNIST-like classifier trained as users train MNIST, shrunk for tests: 10 classes of 8x8
"images" (a random prototype per class plus pixel noise, so that a batch now and then holds a
hard example), an MLP with dropout, Adadelta at lr 1.0, batches of 8: a loss curve as noisy as
MNIST's at batch 8. Module level: replay imports them by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 8


def build_digits():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))
    return model, torch.optim.Adadelta(model.parameters(), lr=1.0)


def step_digits(model, opt, batch):
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def digit_batches(steps: int, *, spike_at: int | None = None, nan_at: int | None = None):
    """(batch, sample ids) per step. At `spike_at` every label is moved to the next class (a
    batch whose labels are all wrong: the loss of a trained model jumps); at `nan_at` one
    pixel is NaN."""
    g = torch.Generator().manual_seed(1)
    prototypes = 1.5 * torch.randn(10, 64, generator=g)
    for s in range(steps):
        y = torch.randint(0, 10, (BATCH,), generator=g)
        x = prototypes[y] + torch.randn(BATCH, 64, generator=g)
        if s == spike_at:
            y = (y + 1) % 10
        if s == nan_at:
            x[0, 0] = float("nan")
        yield (x, y), [BATCH * s + r for r in range(BATCH)]
