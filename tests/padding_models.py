"""A tiny sequence model over padded rows that clears its padding (`torch.where` on the mask, as
models that zero padded embeddings do), and one sample with a NaN at one of its real
positions. Whatever a padded position holds, NaN included, harms nothing: so a healthy row
padded where the culprit row has values, standing in for it in the minimal culprit's position
search, would switch the culprit's position off rather than give it healthy values.

Row 0 of every batch is mostly padding; row 1 has none. Build and step functions live at
module level: replay imports them by name.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab

B, T, D = 6, 8, 4
BAD_STEP, BAD_ROW, BAD_POSITION = 5, 3, 6


class Pooled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.head = nn.Linear(D, 1)

    def forward(self, x, mask):
        real = mask[..., None] == 1
        h = torch.tanh(self.fc(torch.where(real, x, torch.zeros(())))) * real
        return self.head(h.sum(1) / mask.sum(1, keepdim=True))


def build():
    torch.manual_seed(0)
    model = Pooled()
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def step(model, optimizer, batch):
    loss = F.mse_loss(model(batch["x"], batch["mask"]), batch["y"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def batch(step_no: int) -> dict:
    g = torch.Generator().manual_seed(step_no)
    lengths = torch.randint(4, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = 2, T
    x = torch.randn(B, T, D, generator=g)
    if step_no == BAD_STEP:
        lengths[BAD_ROW] = T
        x[BAD_ROW, BAD_POSITION, 0] = float("nan")
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    return {"x": x, "mask": mask, "y": torch.randn(B, 1, generator=g)}


def record(run_dir) -> None:
    model, opt = build()
    with ckptlab.Recorder(run_dir, model, opt, step_fn=step, build_fn=build, ckpt_every=5) as rec:
        for s in range(BAD_STEP + 1):
            try:
                rec.step(batch(s), sample_ids=[100 * s + r for r in range(B)])
            except ckptlab.NonFiniteLoss:
                return
