"""What the detectors read: a run's metrics, validation series, parameter shapes, weight
snapshots and whether it clips its gradients, loaded once per report (`RunData`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ckptlab.analysis.health.clipping import Clipping, clipping
from ckptlab.analysis.health.earlystop import EarlyStop, early_stopping, validation_series
from ckptlab.analysis.health.rules import HealthRules
from ckptlab.analysis.health.snapshots import WeightSnapshot, weight_snapshots
from ckptlab.analysis.spikes import Spike, SpikeRule, find_spikes
from ckptlab.run.manifest import OptimizerGroups
from ckptlab.run.reader import Metrics, Run

_BLOCK = 8192  # rows transposed at a time (a few MB: within the cache)


@dataclass
class GradColumns:
    """Per parameter (columns of `m.param_grad_norm`): the steps that had a gradient norm
    (finite), the steps where it was exactly 0, and its median over them (NaN: none)."""

    present: np.ndarray  # int64[P]
    zeros: np.ndarray  # int64[P]
    median: np.ndarray  # float64[P]


@dataclass
class RunData:
    run: Run
    m: Metrics
    metric: str  # the validation metric (the run's `val_metric`) and its direction
    mode: str
    val: list[tuple[int, float]]  # its finite points
    stop: EarlyStop | None  # early stopping over them, with the report's patience
    snapshots: list[WeightSnapshot]

    def loss_spikes(self, rule: SpikeRule) -> list[tuple[int, Spike]]:
        """`find_spikes(m.loss, rule)`, found once (two detectors read it; on 10^6 steps it
        is seconds)."""
        found = self.__dict__.setdefault("_loss_spikes", {})
        if rule not in found:
            found[rule] = find_spikes(self.m.loss, rule)
        return found[rule]

    @cached_property
    def grad_columns(self) -> GradColumns:
        """Each parameter's gradient norms over the steps that had one (finite: -1 is none),
        counted and their median taken in one pass: three detectors read them, and on a long
        run the (S, P) norms are a GB. A column of a C-ordered (S, P) array is strided: each
        block of rows is transposed first, so every median reads contiguous memory."""
        g = self.m.param_grad_norm
        steps, p = g.shape
        cols = np.empty((p, steps), dtype=g.dtype)
        for a in range(0, steps, _BLOCK):
            cols[:, a : a + _BLOCK] = g[a : a + _BLOCK].T
        out = GradColumns(
            present=np.zeros(p, dtype=np.int64), zeros=np.zeros(p, dtype=np.int64), median=np.full(p, np.nan)
        )
        for j in range(p):
            with np.errstate(invalid="ignore"):
                col = cols[j][np.isfinite(cols[j]) & (cols[j] >= 0)]
            out.present[j], out.zeros[j] = len(col), np.count_nonzero(col == 0)
            if len(col):  # np.median of the float64 column: the middle value, or the mean of the two
                lo, hi = (len(col) - 1) // 2, len(col) // 2
                part = np.partition(col, [lo, hi])
                out.median[j] = (float(part[lo]) + float(part[hi])) / 2
        return out

    @property
    def grad_norm_medians(self) -> np.ndarray:
        """float64[P]: each parameter's median gradient norm over the steps that had one."""
        return self.grad_columns.median

    @cached_property
    def clipping(self) -> Clipping:
        """Whether the run clips its gradients, as far as it records (clipping.py)."""
        return clipping(self.run)

    @cached_property
    def shapes(self) -> dict[str, tuple]:
        return {p["name"]: tuple(p.get("shape", ())) for p in self.run.manifest.get("parameters", [])}

    @cached_property
    def optimizers(self) -> OptimizerGroups:
        """Each parameter's group (its column of `m.lr`: `of_parameter`), where the run says."""
        return OptimizerGroups.of(self.run.manifest)

    @cached_property
    def trainable(self) -> dict[str, bool]:
        return {p["name"]: p.get("requires_grad", True) for p in self.run.manifest.get("parameters", [])}

    @cached_property
    def weights_measured(self) -> np.ndarray:
        """Rows where weight norms were measured: their record counts the non-finite ones (a NaN
        in weight_norm alone could also mean "not measured")."""
        return np.flatnonzero(self.m.holds("nonfinite_weights"))

    @cached_property
    def update_ratios(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, ratios[rows, P]) of the stepped steps that measured update ratios. A ratio
        measured on non-finite weights is recorded as 0 (NaN is not > 0): it says nothing about
        whether the parameter moves, so it is NaN here (else an all-NaN run is "frozen")."""
        m = self.m
        if not len(m):
            return np.array([], dtype=int), np.zeros((0, len(m.param_names)))
        have, ratios = m.measured("update_ratio")
        keep = ~np.isnan(ratios).all(axis=1) & m.stepped[have]
        rows, ur = have[keep], ratios[keep].astype(np.float64)
        weighed = m.holds("nonfinite_weights")[rows]  # norms measured
        ur[weighed[:, None] & ~np.isfinite(m.per_param("weight_norm", rows))] = np.nan
        return rows, ur


def load(run: Run, rules: HealthRules, weights: bool) -> RunData:
    """Everything the detectors look at. `weights=False` reads no checkpoint."""
    config = run.manifest.get("config", {})
    metric, mode = config.get("val_metric", "val_loss"), config.get("val_mode", "min")
    val = validation_series(run, metric)
    return RunData(
        run=run,
        m=run.metrics(),
        metric=metric,
        mode=mode,
        val=val,
        stop=early_stopping(val, metric, mode, rules.patience),
        snapshots=weight_snapshots(run, rules.max_checkpoints) if weights else [],
    )
