"""Optimizer-state blame: Adam's second moment out of tune with the gradient that arrives.

An Adam-style optimizer divides each gradient by the square root of its running mean square
(`exp_avg_sq`). When a parameter's gradients were near zero for a long time, that mean square
decays toward zero (or never grew: a parameter whose inputs were all zero); when a normal
gradient then arrives, the update is as large as Adam ever makes it, for every element at
once: a huge step with clean data and a normal learning rate.

    gaps = second_moment_gaps(optimizer, named, health)   # before the root step's update
    with in_tune(optimizer, param):                        # the counterfactual replay
        ...

    found = first_updates(step, health, names)             # a replayed step's first updates that exploded

`second_moment_gaps` reads the optimizer's state as the root step found it (the blame restores
that state first) and the root step's replayed health (gradient and update per parameter).

The extreme case is a parameter's *first update with an empty second moment*: its
`exp_avg_sq` is all zero (every gradient it ever had was exactly zero: a block switched on
late, a gated branch) or it has no state at all (it never had a gradient) while the others
have stepped. Whatever its gradient's size, Adam then moves every element by about the
learning rate at once (lr x (1-beta1)/(1-beta1^t) / sqrt((1-beta2)/(1-beta2^t)): 1x at t=1,
0.6x at t=38, ~3x late in training): a tiny-initialized weight moves by many times its norm.
The probe flags such parameters before every update it measures (training/first_update.py);
replay measures every step, so the step whose update exploded is the root (its anomaly
`first_update`), not the step after it whose loss did.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ckptlab.analysis.anomalies import UPDATE_EXPLOSION, first_update
from ckptlab.replayer.findings import FIRST_UPDATE, FirstUpdate
from ckptlab.run.records import NO_GRAD
from ckptlab.training.first_update import HOW, empty_flags
from ckptlab.training.health import StepHealth

# The new gradient's RMS over the second moment's (bias-corrected) RMS above which the
# optimizer was not expecting that gradient.
OUT_OF_TUNE = 10.0


@dataclass
class SecondMomentGap:
    index: int  # into the run's parameter arrays
    name: str
    grad_rms: float  # the root step's gradient, root mean square per element
    second_moment_rms: float  # sqrt(mean(exp_avg_sq) / (1 - beta2^t)) before the update
    update_ratio: float  # ||update|| / ||weights|| of the root step
    empty: bool = False  # its first update: exp_avg_sq all zero, or no state yet

    @property
    def ratio(self) -> float:
        return self.grad_rms / self.second_moment_rms if self.second_moment_rms > 0 else math.inf

    def describe(self) -> str:
        if self.empty:
            return (
                f"{FIRST_UPDATE}: `{self.name}`'s exp_avg_sq (Adam's second moment) was all zero (no nonzero "
                f"gradient had reached it before) when a gradient of RMS {self.grad_rms:.3g} arrived, so its "
                f"update moved it by {self.update_ratio:.3g}x its norm"
            )
        return (
            f"`{self.name}`'s exp_avg_sq (Adam's second moment) had an RMS of {self.second_moment_rms:.3g} "
            f"when a gradient of RMS {self.grad_rms:.3g} arrived "
            f"({'infinitely' if math.isinf(self.ratio) else f'{self.ratio:.3g}x'} larger), "
            f"so the update moved it by {self.update_ratio:.3g}x its norm"
        )


def second_moment_gaps(
    optimizer: torch.optim.Optimizer, named: list[tuple[str, torch.nn.Parameter]], h: StepHealth
) -> list[SecondMomentGap]:
    """The parameters whose root-step update exploded while their new gradient was far above
    what their second moment expected; the largest gap first. Empty for optimizers without an
    `exp_avg_sq` state, and when the step's update ratios were not measured."""
    if h.update_ratio is None:
        return []
    empty = set(empty_second_moments(optimizer, [p for _, p in named]))
    betas = {id(p): g.get("betas", (0.9, 0.999)) for g in optimizer.param_groups for p in g["params"]}
    out = []
    for i, (name, p) in enumerate(named):
        state = optimizer.state.get(p, {})
        v = state.get("exp_avg_sq")
        if not (isinstance(v, torch.Tensor) or i in empty) or i >= len(h.update_ratio) or not p.numel():
            continue
        update, g = float(h.update_ratio[i]), float(h.param_grad_norm[i])
        if g == NO_GRAD or not (math.isfinite(g) and g > 0) or not update > UPDATE_EXPLOSION:
            continue
        t = float(state.get("step", 0))
        beta2 = float(betas.get(id(p), (0.9, 0.999))[1])
        correction = 1 - beta2**t if t > 0 else 1.0
        v_rms = 0.0
        if i not in empty and correction > 0:
            v_rms = math.sqrt(max(float(v.detach().float().mean()), 0.0) / correction)
        gap = SecondMomentGap(i, name, g / math.sqrt(p.numel()), v_rms, update, empty=i in empty)
        if gap.ratio > OUT_OF_TUNE:
            out.append(gap)
    return sorted(out, key=lambda x: -x.ratio)


def empty_second_moments(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> dict[int, str]:
    """The parameters (index: how) whose second moment is empty as the next update starts
    (training/first_update.py: `exp_avg_sq` all zero, or no state while other parameters have
    one), read now: what the probe flags on every step that measures its update."""
    flags = empty_flags(optimizer, params)
    return {} if flags is None else {i: HOW[f] for i, f in enumerate(flags.tolist()) if f}


def first_updates(step: int, h: StepHealth, names: list[str]) -> list[FirstUpdate]:
    """The parameters whose first update with an empty second moment exploded in step `step`
    (its health `h`, measured: analysis/anomalies.py `first_update`); the largest move first,
    moves from zero weights (an infinite ratio: a zero-initialized weight) after them."""
    if h.second_moment_empty is None or h.update_ratio is None:
        return []
    found = [
        FirstUpdate(
            step, names[i], HOW[float(h.second_moment_empty[i])], float(h.param_grad_norm[i]), float(h.update_ratio[i])
        )
        for i in first_update(h.second_moment_empty, h.update_ratio, h.param_grad_norm)
    ]
    return sorted(found, key=lambda f: (math.isinf(f.update_ratio), -f.update_ratio))


@contextlib.contextmanager
def in_tune(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter, *, empty_too: bool = True):
    """For the steps inside, `param`'s second moment is brought up to its new gradient's square
    just before the update (exp_avg_sq = max(exp_avg_sq, grad^2)): the update Adam would make if
    its state had kept up with the gradient. With `empty_too`, so is every other parameter's
    whose second moment is still empty (all zero): a block switched on makes its first update
    in all of its parameters at once, and tuning one of them leaves the others' sign-like steps."""

    def raise_floor(opt, args, kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                v = opt.state.get(p, {}).get("exp_avg_sq")
                if not isinstance(v, torch.Tensor) or p.grad is None:
                    continue
                if p is param or (empty_too and not bool(v.any())):
                    torch.maximum(v, p.grad.detach().to(v.dtype).square(), out=v)

    handle = optimizer.register_step_pre_hook(raise_floor)
    try:
        yield
    finally:
        handle.remove()
