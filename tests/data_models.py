"""A map-style dataset whose items come as a tuple, a dict or a nested structure, one row of
it planted with NaN, and the build_fn/step_fn that train on any of the three (module level:
replay imports them by name, and DataLoader workers unpickle the dataset).
"""

from __future__ import annotations

from collections import namedtuple

import torch
import torch.nn as nn
import torch.nn.functional as F

N = 48  # items
Target = namedtuple("Target", ["y", "weight"])


class Points(torch.utils.data.Dataset):
    """Item i: x (8,), y (1,) in the given `structure`; item `bad` has a NaN in x."""

    def __init__(self, structure: str, bad: int | None = None):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(N, 8, generator=g)
        self.y = self.x[:, :1] * 0.5
        if bad is not None:
            self.x[bad, 3] = float("nan")
        self.structure = structure

    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        x, y = self.x[i], self.y[i]
        if self.structure == "tuple":
            return x, y
        if self.structure == "dict":
            return {"x": x, "y": y}
        return {"inputs": {"x": x, "name": f"p{i}"}, "target": Target(y, torch.tensor(1.0))}


def unpack(batch):
    """(x, y) out of any of the three collated structures."""
    if isinstance(batch, (tuple, list)):
        return batch[0], batch[1]
    if "x" in batch:
        return batch["x"], batch["y"]
    return batch["inputs"]["x"], batch["target"].y * batch["target"].weight[:, None]


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=1e-2)


def step(model, optimizer, batch):
    x, y = unpack(batch)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss
