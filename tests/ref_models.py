"""A vision-shaped run whose batches are stored by reference: `batch_fn(sample_ids, step)`
rebuilds each batch from its sample ids (a deterministic dataset) and the step (the
augmentation seed). Module level: replay imports these by name."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab

BAD_SAMPLE = 1703  # its image carries a NaN pixel
AUGMENT = {"flip": True}  # changed by the test that proves a mismatch is caught


def image(sample_id: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sample_id)
    x = torch.rand(3, 16, 16, generator=g)
    if sample_id == BAD_SAMPLE:
        x[1, 4, 7] = float("nan")  # a corrupt decode
    return x


def batch_fn(sample_ids, step):
    g = torch.Generator().manual_seed(10_000 + step)  # the augmentation seed is the step
    xs = torch.stack([image(i) for i in sample_ids])
    flip = torch.rand(len(sample_ids), generator=g) < 0.5
    if AUGMENT["flip"]:
        xs[flip] = xs[flip].flip(-1)
    return {"image": xs, "label": torch.tensor([i % 4 for i in sample_ids])}


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.conv(x).relu().mean((2, 3)))


def build_convnet():
    torch.manual_seed(0)
    m = ConvNet()
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def step_convnet(model, opt, batch):
    loss = F.cross_entropy(model(batch["image"]), batch["label"])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def ids(step: int) -> list[int]:
    return [100 * step + r for r in range(6)]


def record(run_dir, *, by_reference: bool = True, steps: int = 24) -> None:
    model, opt = build_convnet()
    extra = {"batch_fn": batch_fn, "batch_ref_bytes": 1024} if by_reference else {}
    with ckptlab.Recorder(
        run_dir, model, opt, step_fn=step_convnet, build_fn=build_convnet, ckpt_every=10, on_anomaly=None, **extra
    ) as rec:
        for s in range(steps):
            try:
                rec.step(batch_fn(ids(s), s), sample_ids=ids(s))
            except ckptlab.NonFiniteLoss:
                break
