"""Mixed-precision runs for the AMP tests: float16 autocast with a GradScaler, bfloat16 autocast.

CPU autocast does both dtypes, and `torch.amp.GradScaler("cpu")` runs the scaler's whole
logic (unscale, inf check, skip, back-off) on the CPU, so these are the real code paths.
Build and step functions live at module level: replay imports them by name.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab

B = 6  # rows per batch; sample id of row r at step s is 100 * s + r


def ids(step: int) -> list[int]:
    return [100 * step + r for r in range(B)]


def xy(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(B, 8, generator=g)
    return x, x[:, :1] * 0.5 + 0.1 * torch.randn(B, 1, generator=g)


class WideNet(nn.Module):
    """fc1's activations reach ~1e3 on typical rows: fine in float16 (max 65504), until a row
    ~150x larger than typical (finite, not absurd) makes them ~1e5."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 1)
        with torch.no_grad():
            self.fc1.weight.mul_(200.0)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)) / 1000.0)


# 2**20 overflows the scaled float16 gradients of the first steps: the scaler skips them and
# backs off until the scale fits, as it does at the start of every float16 run.
INIT_SCALE = 2.0**20


def build_fp16():
    torch.manual_seed(0)
    model = WideNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    return model, opt, None, torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)


def build_fp16_without_scaler():
    model, opt, _, _ = build_fp16()
    return model, opt


def step_fp16(model, optimizer, batch, scaler):
    x, y = batch
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss


def build_bf16():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step_bf16(model, optimizer, batch):
    x, y = batch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.mse_loss(model(x).float(), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def record(run_dir, build, step, *, steps: int, plant: dict[int, tuple[int, float]], **kw) -> list[float]:
    """Record `steps` steps; `plant` = {step: (row, value)} sets that row of x to `value`
    (NaN: bad data; ~400: a float16-only overflow). Stops at the first non-finite loss."""
    built = build()
    scaler = next((b for b in built[2:] if isinstance(b, torch.amp.GradScaler)), None)
    losses = []
    with ckptlab.Recorder(
        run_dir, built[0], built[1], step_fn=step, build_fn=build, scaler=scaler, ckpt_every=10, **kw
    ) as rec:
        for s in range(steps):
            x, y = xy(s)
            if s in plant:
                row, value = plant[s]
                x[row] = value
            try:
                losses.append(rec.step((x, y), sample_ids=ids(s)).item())
            except ckptlab.NonFiniteLoss:
                losses.append(math.nan)
                break
    return losses
