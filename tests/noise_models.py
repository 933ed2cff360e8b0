"""Runs whose replays cannot be bit-exact, for tests/test_replay_agreement.py: a step_fn whose
outputs and gradients carry relative noise of 1e-7 from a generator no recording holds (what a
GPU's atomics do), and a value at the edge of float32 overflow. Module level: replay imports them.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab
from tests.fault_models import B, Expected, _xy, build_sgd_mlp, ids
from tests.models import MLP

_UNRECORDED = np.random.default_rng()  # seeded by the OS: in no checkpoint and no RNG state
FLT_MAX = torch.finfo(torch.float32).max


def _noise(shape) -> torch.Tensor:
    """1 + relative noise of 1e-7: a unit or so of float32 round-off, different every call."""
    return 1 + 1e-7 * torch.from_numpy(_UNRECORDED.standard_normal(tuple(shape))).float()


def _noisy_backward(model, loss) -> None:
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:  # ulp-level noise, as nondeterministic kernels add
                p.grad.mul_(_noise(p.shape))


def step_noisy(model, opt, batch):
    x, y = batch
    out = model(x)
    loss = F.mse_loss(out * _noise(out.shape), y)  # (a reduction in another order, every step)
    _noisy_backward(model, loss)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _record(run_dir, build, step, batches) -> None:
    built = build()
    with ckptlab.Recorder(run_dir, built[0], built[1], step_fn=step, build_fn=build, ckpt_every=10) as rec:
        for s, batch in enumerate(batches):
            try:
                rec.step(batch, sample_ids=ids(s))
            except ckptlab.NonFiniteLoss:
                break


def record_noisy_nan_row(run_dir) -> Expected:
    """A NaN in row 4 of step 17's input, trained with noisy gradients."""

    def batches():
        for s in range(20):
            x, y = _xy(s)
            if s == 17:
                x[4, 2] = math.nan
            yield x, y

    _record(run_dir, build_sgd_mlp, step_noisy, batches())
    return Expected(17, 17, None, [4], kind="data")


# --- a value at the edge of overflow: only the last bits decide whether it faults -------------


class EdgeMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MLP()
        self.gain = nn.Parameter(torch.tensor(1.0 + 2.0**-20), requires_grad=False)


def build_edge():
    torch.manual_seed(0)
    m = EdgeMLP()
    return m, torch.optim.SGD(m.mlp.parameters(), lr=1e-2)


def step_edge(model, opt, batch):
    x, y, edge = batch
    # edge * gain is finite (and adds 0) unless it overflows: then 0 * inf = NaN
    out = model.mlp(x) + 0.0 * (edge * model.gain)
    loss = F.mse_loss(out * _noise(out.shape), y)
    _noisy_backward(model, loss)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def edge_value(gain: float) -> float:
    """The smallest float32 v for which float32 v * gain overflows."""
    g = torch.tensor(gain, dtype=torch.float32)
    v = torch.tensor(FLT_MAX / gain, dtype=torch.float32)
    while torch.isfinite(v * g):
        v = torch.nextafter(v, torch.tensor(math.inf))
    return float(v)


def record_edge_of_overflow(run_dir) -> Expected:
    """Row 2 of step 15 carries the value that overflows by one rounding."""
    v = edge_value(float(torch.tensor(1.0 + 2.0**-20, dtype=torch.float32)))

    def batches():
        for s in range(20):
            x, y = _xy(s)
            edge = torch.ones(B, 1)
            if s == 15:
                edge[2] = v
            yield x, y, edge

    _record(run_dir, build_edge, step_edge, batches())
    return Expected(15, 15, None, [2])
