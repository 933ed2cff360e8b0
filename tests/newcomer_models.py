"""A newcomer's first training script (issue #31): a tiny regressor over a dataset whose items
are made on the fly, one of them (sample 31337) carrying a NaN; gradient clipping in the
loop, batches through `with_sample_ids` and a DataLoader, recorded by the Recorder.

Build and step functions live at module level: replay imports them by name.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

import ckptlab

N = 50_000  # dataset items
BAD = 31337  # the item with a NaN feature
BS = 8  # rows per batch
STEPS = 40
BAD_STEP, BAD_ROW = 25, 5  # where the sampler puts item BAD
TAIL = 2757  # a healthy item from the tail (mean x^2 = 3.5): alone in a batch its loss spikes


class Points(torch.utils.data.Dataset):
    """Item i: x (8,), y (8,), made from i alone; item BAD has a NaN in x."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(int(i))
        x = torch.randn(8, generator=g)
        y = x.roll(1) * 0.5 + 0.1 * torch.randn(8, generator=g)
        if i == BAD:
            x[3] = float("nan")
        return x, y


def order() -> list[int]:
    """The sampler's order: random items, with BAD at step BAD_STEP, row BAD_ROW, and TAIL in
    row 0 of that batch (the healthy row the culprit search takes values from)."""
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, N, (STEPS * BS,), generator=g).tolist()
    idx = [i if i != BAD else i + 1 for i in idx]
    idx[BAD_STEP * BS + BAD_ROW] = BAD
    idx[BAD_STEP * BS] = TAIL
    return idx


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head(self.body(x))


def build():
    torch.manual_seed(0)
    model = Net()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def step(model, optimizer, batch):
    x, y = batch
    loss = F.mse_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def record(run_dir) -> list[float]:
    """Record the script's run; it stops at the non-finite loss, as the Recorder tells it to."""
    model, opt = build()
    loader = DataLoader(ckptlab.with_sample_ids(Points()), sampler=order(), batch_size=BS)
    losses = []
    with ckptlab.Recorder(run_dir, model, opt, step_fn=step, build_fn=build, ckpt_every=10) as rec:
        for ids, batch in loader:
            try:
                losses.append(rec.step(batch, sample_ids=ids).item())
            except ckptlab.NonFiniteLoss:
                losses.append(float("nan"))
                break
    return losses
