"""A step's health: the record the probe returns (StepHealth), and the host arithmetic that
turns the numbers the probe copied off the device into it (`read_health`), combined with the
other ranks' when distributed. Host arithmetic only: the same bits whether the Recorder reads a
step late or replay reads it at once (training/probe.py says where each number is measured)."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ckptlab.run.records import NO_GRAD
from ckptlab.training.norms import count_nonfinite
from ckptlab.training.world import World, local


@dataclass
class StepHealth:
    loss: float | None  # None: not known (the step returned no loss; recorded as null)
    grad_norm: float  # global L2 norm over all parameters, before clipping, unscaled
    param_grad_norm: np.ndarray  # float32[P]; NO_GRAD where a parameter got no gradient
    nonfinite_grads: int  # non-finite gradient elements, all parameters
    param_nonfinite: np.ndarray | None  # int64[P], only when nonfinite_grads > 0
    lr: list[float]
    stepped: bool  # the optimizer's step ran (a GradScaler skips it on overflow)
    update_ratio: np.ndarray | None = None  # float32[P]: ||w_after - w_before|| / ||w_before||
    update_ratio_global: float | None = None  # the same over all parameters together
    weight_norm: np.ndarray | None = None  # float32[P], after the update
    # float32[P]: the norms before the update, kept only when some were not finite (the weights
    # went bad before this step's update: outside the step, or in a step that did not step)
    weight_norm_before: np.ndarray | None = None
    grad_scale: float | None = None
    step_time: float = 0.0
    rank_loss: list[float] | None = None  # distributed: each rank's own loss (`loss` is their mean); not a pipeline's
    rank_grad_norm: list[float] | None = None  # distributed: each rank's local gradient norm (a pipeline: its stage's)
    scaler_skipped: bool = False  # a GradScaler found non-finite gradients and skipped the update
    # float32[P], where update ratios were measured: each parameter's second moment empty before
    # the update (training/first_update.py: 1 exp_avg_sq all zero, 2 no state, 0 not empty)
    second_moment_empty: np.ndarray | None = None

    @property
    def loss_nonfinite(self) -> bool:
        """The step returned a loss, and it is NaN/Inf (a loss not known is no such fault)."""
        return self.loss is not None and not math.isfinite(self.loss)

    def scalars(self) -> dict:
        out = {
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "nonfinite_grads": self.nonfinite_grads,
            "lr": self.lr,
            "stepped": self.stepped,
            "step_time": self.step_time,
        }
        if self.grad_scale is not None:
            out["grad_scale"] = self.grad_scale
        if self.scaler_skipped:
            out["scaler_skipped"] = True
        if self.weight_norm is not None:
            out["nonfinite_weights"] = int((~np.isfinite(self.weight_norm)).sum())
        if self.update_ratio_global is not None:
            out["update_ratio_global"] = self.update_ratio_global
        if self.rank_loss is not None:
            out["rank_loss"] = self.rank_loss
        if self.rank_grad_norm is not None:
            out["rank_grad_norm"] = self.rank_grad_norm
        return out

    def arrays(self) -> dict[str, np.ndarray]:
        out = {"param_grad_norm": self.param_grad_norm}
        for key in ("param_nonfinite", "update_ratio", "weight_norm", "weight_norm_before"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


def read_health(
    values: np.ndarray,
    parts: dict,
    meta: dict,
    *,
    params: Sequence[torch.Tensor],
    world: World,
    optimizer,
    grads_live: bool,
) -> StepHealth:
    """This rank's numbers (`values`, laid out by `parts`, with the step's `meta`), combined
    with the other ranks' (one small all_gather when distributed), as the step's health.
    `grads_live`: the step's gradients are still on `params`, so a non-finite norm's elements
    can be counted now."""
    value = float(values[parts["loss"]][0])
    scale = float(values[parts["scale"]][0]) if "scale" in parts else None
    grad_sq, nonfinite = _local_grads(values[parts["grad"]], meta, scale, params, grads_live)
    updates = None
    if "w" in parts:
        d_sq = values[parts["d"]].astype(np.float64) ** 2 * meta["d_scale"] if "d" in parts else np.zeros(len(params))
        updates = [values[parts["w"]].astype(np.float64) ** 2, d_sq, values[parts["b"]].astype(np.float64) ** 2]
    stepped = meta["stepped"]
    if stepped is None:  # a hand-written update, measured (training/probe.py): did the weights move?
        stepped = bool((values[parts["d"]] != 0).any())
    lr, empty = meta["lr"], values[parts["e"]].copy() if "e" in parts else None
    tail = np.zeros(0)
    if world.stages is not None:  # a pipeline stage: its numbers in its slots of the whole model's
        grad_sq, nonfinite, updates, tail = _spread(world.stages, grad_sq, nonfinite, updates, lr, empty)
    norms, grad_norm, nonfinite_all, counted, update_sq, ranks = _gradients(
        value, grad_sq, nonfinite, updates, len(meta["idx"]), world, not meta.get("no_loss"), tail
    )
    if world.stages is not None:
        lr, empty = _stages_tail(world.stages, ranks[3])
    health = StepHealth(
        loss=value if ranks is None else ranks[0],
        grad_norm=grad_norm,
        param_grad_norm=norms,
        nonfinite_grads=counted,
        param_nonfinite=nonfinite_all,
        lr=lr,
        stepped=stepped,
        grad_scale=scale,
        step_time=meta["step_time"],
        scaler_skipped=_scaler_skipped(optimizer, stepped, scale, values, parts),
    )
    if ranks is None and meta.get("no_loss"):
        health.loss = None
    if ranks is not None:
        health.rank_loss, health.rank_grad_norm = ranks[1] if world.stages is None else None, ranks[2]
    if update_sq is not None:
        _set_updates(health, update_sq)
        health.second_moment_empty = empty
    before = np.sqrt(update_sq[2]) if update_sq is not None else values[parts["b0"]] if "b0" in parts else None
    if before is not None and not np.isfinite(before).all():
        health.weight_norm_before = np.asarray(before, dtype=np.float32)
    return health


def _spread(stages, grad_sq: np.ndarray, nonfinite: np.ndarray, updates, lr: list[float], empty):
    """A pipeline stage's per-parameter numbers in its slots of the whole model's vectors
    (training/pipeline.py), and what else the ranks add up: [has second-moment flags, the
    learning rates of every stage's groups, the flags]."""
    flags = stages.spread(empty if empty is not None else np.zeros(len(grad_sq)), 0.0)
    grad_sq, nonfinite = stages.spread(grad_sq, NO_GRAD), stages.spread(nonfinite, 0.0)
    updates = [stages.spread(u, 0.0) for u in updates] if updates is not None else None
    tail = np.concatenate([[float(empty is not None)], stages.spread(np.asarray(lr), 0.0, groups=True), flags])
    return grad_sq, nonfinite, updates, tail


def _stages_tail(stages, tail: np.ndarray) -> tuple[list[float], np.ndarray | None]:
    """The whole model's learning rates and second-moment flags, from the ranks' summed tails."""
    groups = sum(n for _, n in stages.group_slots)
    flags = tail[1 + groups :].astype(np.float32) if tail[0] > 0 else None
    return tail[1 : 1 + groups].tolist(), flags


def _gradients(
    value: float,
    grad_sq: np.ndarray,
    nonfinite: np.ndarray,
    updates,
    measured: int,
    world: World,
    has_loss: bool = True,
    tail: np.ndarray | None = None,
):
    """(the float32 norm per parameter, the global norm, the non-finite counts or None, their
    total, the squared weight / update / pre-update weight norms or None, the ranks' numbers or
    None) over every rank; `measured`: how many parameters this rank measured; `has_loss`:
    this rank's step returned a loss; `tail`: more numbers that the ranks add up (a pipeline's)."""
    P = len(grad_sq)
    ranks = None  # distributed: (the mean loss, each rank's loss, each rank's local gradient norm)
    total = grad_sq.sum() if not world.distributed and measured == P > 0 else math.nan
    if math.isfinite(total):
        # One rank, every parameter with a gradient, every norm finite (the usual step): what
        # the general case computes, in fewer calls (its masks select all, its counts are 0).
        norms = np.sqrt(grad_sq).astype(np.float32)
        nonfinite_all = np.zeros(P, dtype=np.int64) if not np.isfinite(norms).all() else None
        return norms, math.sqrt(total), nonfinite_all, 0, updates, ranks
    if world.distributed:
        any_grad, combined, nonfinite_all, update_sq, ranks = _combine_ranks(
            world, value, grad_sq, nonfinite, updates, has_loss, tail if tail is not None else np.zeros(0)
        )
    else:  # one rank: the same numbers without the rows (the mean of one row is that row)
        any_grad = ~(grad_sq < 0)  # NO_GRAD is negative; a NaN norm was measured (and is kept)
        combined = np.where(any_grad, grad_sq, 0.0)
        # -1: non-finite, but the gradient was gone before it could be counted (a deferred
        # read on a GPU); it counts as at least one element in the total.
        nonfinite_all = np.where(nonfinite < 0, -1, np.where(nonfinite > 0, nonfinite, 0)).astype(np.int64)
        update_sq = updates
    norms = np.where(any_grad, np.sqrt(combined), NO_GRAD).astype(np.float32)
    present = combined[any_grad]
    grad_norm = float(np.sqrt(present.sum())) if present.size else float("nan")
    counted = int(np.abs(nonfinite_all).sum())
    if not (nonfinite_all.any() or not np.isfinite(norms).all()):
        nonfinite_all = None  # recorded only for a step with something non-finite
    return norms, grad_norm, nonfinite_all, counted, update_sq, ranks


def _set_updates(health: StepHealth, update_sq: list[np.ndarray]) -> None:
    """The weight norms and update ratios, from the squared weight / update / pre-update norms."""
    w_sq, d_sq, b_sq = update_sq
    health.weight_norm = np.sqrt(w_sq).astype(np.float32)
    d, b = np.sqrt(d_sq), np.sqrt(b_sq)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(b > 0, d / b, np.where(d > 0, np.inf, 0.0))
        # NaN where the weights (or the update) were not finite: not "no update"
        health.update_ratio = np.where(np.isnan(b) | np.isnan(d), np.nan, ratio).astype(np.float32)
    health.update_ratio_global = float(np.sqrt(d_sq.sum()) / max(np.sqrt(b_sq.sum()), 1e-300))


def _combine_ranks(
    world: World, value: float, grad_sq: np.ndarray, nonfinite: np.ndarray, updates, has_loss: bool, tail: np.ndarray
):
    """Every rank's numbers (one small all_gather) combined: (which parameters have a
    gradient on any rank, the squared gradient norms, the non-finite counts, the squared
    weight / update / pre-update weight norms or None, (the loss: the mean of the ranks' that
    returned one, None when none did; each rank's loss, each rank's local gradient norm; the
    ranks' `tail`s added up))."""
    P = len(grad_sq)
    # One row per rank: [loss, has_update, has_loss, grad_sq(P), nonfinite(P), w_sq(P), d_sq(P), b_sq(P), tail]
    head = [value, updates is not None, has_loss]
    row = np.concatenate([head, grad_sq, nonfinite, *(updates or [np.zeros(P)] * 3), tail])
    rows = world.gather(row)
    with_loss = rows[:, 2] > 0
    rows = rows[:, [0, 1, *range(3, rows.shape[1])]]  # (the columns below, as they were before has_loss)
    got = ~(rows[:, 2 : 2 + P] < 0)  # NO_GRAD rows are negative; NaN ones were measured
    grad_sq_all = np.where(got, rows[:, 2 : 2 + P], 0.0)
    combined = world.combine(grad_sq_all)
    counts = rows[:, 2 + P : 2 + 2 * P]
    # -1: non-finite, but the gradient was gone before it could be counted (a deferred read
    # on a GPU); it counts as at least one element in the total.
    unknown = (counts < 0).any(axis=0)
    nonfinite_all = np.where(unknown, -1, world.count(np.where(counts > 0, counts, 0))).astype(np.int64)
    update_sq = None
    if rows[0, 1]:
        update_sq = [world.combine(rows[:, 2 + k * P : 2 + (k + 1) * P]) for k in (2, 3, 4)]
    loss = float(rows[with_loss, 0].mean()) if with_loss.any() else None
    added = rows[:, rows.shape[1] - len(tail) :].sum(axis=0)
    ranks = loss, rows[:, 0].tolist(), np.sqrt(grad_sq_all.sum(axis=1)).tolist(), added
    return got.any(axis=0), combined, nonfinite_all, update_sq, ranks


def _scaler_skipped(optimizer, stepped: bool, scale: float | None, values: np.ndarray, parts: dict) -> bool:
    """The GradScaler skipped this step: `scaler.update()` backed the scale off (what it does,
    and only does, after finding inf/NaN gradients), and the optimizer did not step -- or
    it did, but is one (fused AdamW: the HF Trainer's default) that `scaler.step` calls with
    the inf flag, to skip the update itself."""
    if scale is None or "scale_after" not in parts or not values[parts["scale_after"]][0] < scale:
        return False
    return not stepped or bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def _local_grads(norms: np.ndarray, meta: dict, scale: float | None, params: Sequence[torch.Tensor], grads_live: bool):
    """This rank's squared gradient norm per parameter (NO_GRAD: none) and non-finite counts."""
    P = len(params)
    idx = meta["idx"]
    values = norms.astype(np.float64)
    if scale:
        values = values / scale
    if len(idx) == P:  # every parameter has a gradient (idx is ascending, without repeats)
        sq = values * values
    else:
        sq = np.full(P, NO_GRAD, dtype=np.float64)
        sq[idx] = values * values
    nonfinite = np.zeros(P, dtype=np.float64)
    if math.isfinite(sq.sum()):  # the common case, in one call (an overflow only means: look)
        return sq, nonfinite
    for i in np.flatnonzero(~np.isfinite(sq)).tolist():  # (NO_GRAD is finite: only measured ones)
        known = meta["nonfinite"].get(i)
        nonfinite[i] = known if known is not None else (_count_now(params[i]) if grads_live else -1)
    return sq, nonfinite


def _count_now(p: torch.Tensor) -> int:
    g = p.grad
    return count_nonfinite(local(g)) if g is not None else -1


# --- the usual step, in plain Python -------------------------------------------------------
#
# Right after a step's compute, the host's caches hold the step's code, not ckptlab's: a numpy
# call on a small array then costs 30-60 us (1-4 us warm), a JSON encode ~40 us. The usual
# step (one rank, every parameter with a finite gradient, no GradScaler, no update measured)
# is read with Python's own floats instead: the same numbers, bit for bit (tested against
# `read_health`).


@dataclass
class CommonHealth:
    """The usual step's health as plain Python numbers (`read_common`); `health()` is the
    StepHealth that `read_health` makes of the same numbers."""

    loss: float
    grad_norm: float
    norms: list[float]  # float32 values, one per parameter (all have a gradient)
    lr: list[float]
    stepped: bool
    step_time: float
    # A step that measured its update: the weight norms, the update ratios (float32 values),
    # the update ratio over all parameters, and the second-moment flags (all 0) when taken.
    update: tuple[list[float], list[float], float, list[float] | None] | None = None
    loss_nonfinite = False  # (read_common reads finite steps only)

    def scalars(self) -> dict:
        """`StepHealth.scalars()` of this step (the same keys, in the same order)."""
        out = {
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "nonfinite_grads": 0,
            "lr": self.lr,
            "stepped": self.stepped,
            "step_time": self.step_time,
        }
        if self.update is not None:
            out["nonfinite_weights"] = 0
            out["update_ratio_global"] = self.update[2]
        return out

    def arrays(self) -> dict[str, list[float]]:
        """`StepHealth.arrays()` of this step, as lists of float32 values."""
        if self.update is None:
            return {"param_grad_norm": self.norms}
        return {"param_grad_norm": self.norms, "update_ratio": self.update[1], "weight_norm": self.update[0]}

    def health(self) -> StepHealth:
        health = StepHealth(
            loss=self.loss,
            grad_norm=self.grad_norm,
            param_grad_norm=np.array(self.norms, dtype=np.float32),
            nonfinite_grads=0,
            param_nonfinite=None,
            lr=self.lr,
            stepped=self.stepped,
            step_time=self.step_time,
        )
        if self.update is not None:
            weights, ratios, health.update_ratio_global, empty = self.update
            health.weight_norm = np.array(weights, dtype=np.float32)
            health.update_ratio = np.array(ratios, dtype=np.float32)
            health.second_moment_empty = np.array(empty, dtype=np.float32) if empty is not None else None
        return health


# The probe's parts on the usual step: the loss and the gradient norms; with the update
# measured, the weight norms after and before it and the (sampled) update norms; with an
# Adam-like optimizer also its second-moment flags.
_USUAL, _UPDATE, _UPDATE_FLAGS = {"loss", "grad"}, {"loss", "grad", "w", "b", "d"}, {"loss", "grad", "w", "b", "d", "e"}


def read_common(numbers: list[float], parts: dict, meta: dict, n_params: int) -> CommonHealth | None:
    """The step's health when it is the usual one (`numbers`: the probe's, as Python floats:
    the loss and the P gradient norms, and the update when measured; one rank, every
    parameter has a gradient, all finite, no first update of an empty second moment), else
    None (read_health reads it)."""
    if len(meta["idx"]) != n_params or meta["nonfinite"] or meta["stepped"] is None:
        return None
    measured = parts.keys() != _USUAL
    if measured and not (parts.keys() == _UPDATE or parts.keys() == _UPDATE_FLAGS):
        return None
    norms = numbers[parts["grad"]]
    total = _sum_as_numpy([g * g for g in norms])
    loss = numbers[0]
    if _SUM_AGREES[0] is None:
        _SUM_AGREES[0] = _sum_agrees()
    if not (math.isfinite(total) and math.isfinite(loss)) or not _SUM_AGREES[0]:
        return None  # (a non-finite step, or a numpy whose sum is not the one below)
    update = _read_update(numbers, parts, meta["d_scale"]) if measured else None
    if measured and update is None:
        return None
    return CommonHealth(loss, math.sqrt(total), norms, meta["lr"], meta["stepped"], meta["step_time"], update)


def _read_update(numbers: list[float], parts: dict, d_scale: np.ndarray):
    """`_set_updates` of a step whose weights, before and after, are finite and whose
    second moments were not empty: (weight norms, update ratios as float32 values, the
    global ratio, the flags), the same bits; None for any other (read_health reads it)."""
    weights, before, updates = numbers[parts["w"]], numbers[parts["b"]], numbers[parts["d"]]
    flags = numbers[parts["e"]] if "e" in parts else None
    if flags is not None and any(flags):  # (a first update: the general rules look at it)
        return None
    d_sq = [x * x * s for x, s in zip(updates, d_scale.tolist())]
    b_sq = [x * x for x in before]
    d_total, b_total = _sum_as_numpy(d_sq), _sum_as_numpy(b_sq)
    if not (math.isfinite(sum(weights)) and math.isfinite(d_total) and math.isfinite(b_total)):
        return None
    ratios = []
    for dq, bq in zip(d_sq, b_sq):
        d, b = math.sqrt(dq), math.sqrt(bq)
        ratios.append(d / b if b > 0 else math.inf if d > 0 else 0.0)
    try:  # float32, as numpy's cast rounds (a finite ratio beyond float32's range: read_health)
        ratios = list(struct.unpack(f"<{len(ratios)}f", struct.pack(f"<{len(ratios)}f", *ratios)))
    except OverflowError:
        return None
    return weights, ratios, math.sqrt(d_total) / max(math.sqrt(b_total), 1e-300), flags


def _sum_as_numpy(x: list[float]) -> float:
    """`np.array(x, dtype=np.float64).sum()` in Python: numpy's pairwise summation (blocks of
    128, eight partial sums each), the same float. Checked against numpy once
    (`_SUM_AGREES`)."""
    n = len(x)
    if n < 8:
        total = 0.0
        for v in x:
            total += v
        return total
    if n <= 128:
        r = x[:8]
        i, stop = 8, n - n % 8
        while i < stop:
            for j in range(8):
                r[j] += x[i + j]
            i += 8
        total = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
        for v in x[stop:]:
            total += v
        return total
    half = n // 2
    half -= half % 8
    return _sum_as_numpy(x[:half]) + _sum_as_numpy(x[half:])


def _sum_agrees() -> bool:
    """Whether `_sum_as_numpy` is numpy's sum here, on vectors of every kind of length."""
    rng = np.random.default_rng(0)
    for n in (*range(0, 40), 127, 128, 129, 255, 256, 300, 1000, 1031):
        x = rng.random(n) * 10.0 ** rng.integers(-6, 6, n)
        if _sum_as_numpy(x.tolist()) != x.sum():
            return False
    return True


_SUM_AGREES: list[bool | None] = [None]  # checked at the first read
