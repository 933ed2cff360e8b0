"""The report: every detector run in order over one run's data, the findings sorted by
severity, and what the terminal, `--json` and `--html` render around them (the curve's summary,
perplexity for language models, the verdict, the plotted series)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ckptlab.analysis.batches import embedding_tables, leaves
from ckptlab.analysis.health.crashes import crashes
from ckptlab.analysis.health.earlystop import validation_series
from ckptlab.analysis.health.gradients import gradient_explosion, nonfinite_gradient, scaler_skips
from ckptlab.analysis.health.inputs import RunData, load
from ckptlab.analysis.health.layers import (
    dead_gradient,
    frozen,
    gradient_imbalance,
    requires_grad_false,
    update_ratio_band,
    vanishing_gradient,
)
from ckptlab.analysis.health.loss import (
    curve_shape,
    loss_explosion,
    loss_spikes,
    oscillation_or_divergence,
    plateau,
)
from ckptlab.analysis.health.precursors import precursors
from ckptlab.analysis.health.rules import SEVERITY_ORDER, Finding, HealthRules
from ckptlab.analysis.health.series import smooth
from ckptlab.analysis.health.snapshots import WeightSnapshot
from ckptlab.analysis.health.system import input_bound, memory_pressure, mfu, slow_steps, throughput_drop
from ckptlab.analysis.health.validation import overfitting
from ckptlab.analysis.health.weights import exploding_weights, nonfinite_weights, update_explosion, weight_drift
from ckptlab.jsonable import NOT_IN_JSON
from ckptlab.run.reader import Metrics, Run

Detector = Callable[[RunData, HealthRules], list[Finding]]
DEFAULT_RULES = HealthRules()

# The detectors whose findings describe the loss curve (the most severe names `curve.kind`) ...
LOSS_DETECTORS: list[Detector] = [
    loss_explosion,
    loss_spikes,
    oscillation_or_divergence,
    plateau,
    overfitting,
]
# ... and the rest of the run's: gradients, parameters, weights.
RUN_DETECTORS: list[Detector] = [
    crashes,
    gradient_explosion,
    nonfinite_gradient,
    scaler_skips,
    dead_gradient,
    vanishing_gradient,
    gradient_imbalance,
    frozen,
    requires_grad_false,
    update_ratio_band,
    update_explosion,
    nonfinite_weights,
    exploding_weights,
    weight_drift,
    precursors,
    input_bound,
    slow_steps,
    throughput_drop,
    memory_pressure,
    mfu,
]
# All of them, in the order the report runs them (findings of equal severity and first step keep
# this order).
DETECTORS: list[Detector] = [*LOSS_DETECTORS, *RUN_DETECTORS]
# Findings marked on the HTML page's loss and gradient charts, at their steps.
MARKED = (
    "explosion",
    "nonfinite_data",
    "loss_spike",
    "gradient_explosion",
    "nonfinite_gradient",
    "nonfinite_weights",
    "update_explosion",
    "precursor",
)


@dataclass
class CurveSummary:
    kind: str  # headline: the worst loss finding's kind, else the shape
    shape: str  # "fast_drop" | "slow_drop" | "flat" | "rising" | "too_short" | "empty"
    first: float | None  # smoothed loss at the start and at the end
    last: float | None
    best: float | None  # lowest finite raw loss, and its step
    best_step: int | None


@dataclass
class Perplexity:
    first: float
    last: float
    best: float
    best_step: int
    val_best: float | None  # exp(best validation loss), when a validation loss exists


@dataclass
class PlotData:
    """The series the HTML page draws; not part of the JSON document."""

    steps: np.ndarray
    loss_steps: np.ndarray  # the steps whose loss is known (`loss`, `loss_ema` are theirs)
    loss: np.ndarray
    loss_ema: np.ndarray
    grad_norm: np.ndarray
    val_metric: str
    val_steps: list[int]
    val_values: list[float]
    markers: list[tuple[int, str, str]]  # (step, kind, severity)
    ratio_steps: np.ndarray  # steps where update ratios were measured
    ratio: np.ndarray  # float[params, measured steps]
    param_names: list[str]
    weights: list[WeightSnapshot]
    best_val_step: int | None
    # Where each step's time went (seconds per step; parts of `wall_time`, "other" what is left:
    # ckptlab's own bookkeeping, and a session's first step's start), and the slow steps' causes.
    time_steps: np.ndarray = field(default_factory=lambda: np.zeros(0))
    time_parts: dict[str, np.ndarray] = field(default_factory=dict)
    slow: list[tuple[int, str]] = field(default_factory=list)  # (step, cause)


@dataclass
class HealthReport:
    run: str
    steps: dict  # recorded, first, last
    curve: CurveSummary
    perplexity: Perplexity | None
    findings: list[Finding]
    verdict: str
    rules: HealthRules
    plots: PlotData | None = field(default=None, metadata=NOT_IN_JSON)  # for the HTML page

    @property
    def worst(self) -> str | None:
        return self.findings[0].severity if self.findings else None

    def alarms(self) -> list[Finding]:
        return [f for f in self.findings if f.severity != "info"]


def diagnose(run: Run, rules: HealthRules = DEFAULT_RULES, *, weights: bool = True, plots: bool = True) -> HealthReport:
    """Every finding for `run`. `weights=False` skips reading checkpoints (faster on big models)."""
    d = load(run, rules, weights)
    m = d.m
    loss_findings = [f for detect in LOSS_DETECTORS for f in detect(d, rules)]
    findings = loss_findings + [f for detect in RUN_DETECTORS for f in detect(d, rules)]
    findings.sort(key=lambda f: (SEVERITY_ORDER[f.severity], f.steps[0] if f.steps else -1))
    curve = curve_summary(m, curve_shape(m.loss), loss_findings)
    val_loss = d.val if d.metric == "val_loss" else validation_series(run, "val_loss")
    report = HealthReport(
        run=str(run.path),
        steps={
            "recorded": len(m),
            "first": int(m.step[0]) if len(m) else None,
            "last": int(m.step[-1]) if len(m) else None,
        },
        curve=curve,
        perplexity=perplexity(run, m, val_loss),
        findings=findings,
        verdict=verdict(curve, findings, loss_known=bool(m.loss_known.any()) or not len(m)),
        rules=rules,
    )
    if plots:
        report.plots = plot_data(d, findings)
    return report


def verdict(curve: CurveSummary, findings: list[Finding], *, loss_known: bool = True) -> str:
    """One line: the worst alarm (and the kinds of the others), or what the healthy curve does.
    `loss_known`: some step's loss is known (False: every step returned none)."""
    alarms = [f for f in findings if f.severity != "info"]
    if not alarms:
        if not loss_known:
            return "The steps returned no loss (not known): no curve to judge; no problems found in the rest."
        if curve.shape == "empty":
            return "No finite loss recorded yet: nothing to judge."
        if curve.shape == "too_short":
            return "Too few steps to judge the curves' shape; no problems found."
        says = {"fast_drop": "drops fast", "slow_drop": "drops slowly", "flat": "is flat", "rising": "rises"}
        return f"Healthy: the loss {says.get(curve.shape, 'is ' + curve.shape.replace('_', ' '))}; no problems found."
    more = f" (+{len(alarms) - 1} more: {', '.join(sorted({f.kind for f in alarms[1:]}))})" if len(alarms) > 1 else ""
    return f"{alarms[0].title}{more}."


def curve_summary(m: Metrics, shape: str, loss_findings: list[Finding]) -> CurveSummary:
    finite = np.isfinite(m.loss)
    first = last = best = None
    best_step = None
    if finite.any():
        ema = smooth(m.loss)
        idx = np.flatnonzero(finite)
        first, last = float(m.loss[idx[0]]), float(ema[idx[-1]])
        i = int(idx[np.argmin(m.loss[idx])])
        best, best_step = float(m.loss[i]), int(m.step[i])
    worst = min(loss_findings, key=lambda f: SEVERITY_ORDER[f.severity], default=None)
    kind = worst.kind if worst is not None and worst.severity != "info" else shape
    return CurveSummary(kind, shape, first, last, best, best_step)


# --- perplexity --------------------------------------------------------------------------------------


def is_language_model(run: Run) -> bool:
    """data_info says so (task "lm" or a vocab_size), else: batches hold 2-D integer token ids
    and the model has an embedding table with more rows than the largest id."""
    info = run.manifest.get("data_info") or {}
    if info.get("task") == "lm" or "vocab_size" in info:
        return True
    if info.get("task"):
        return False
    tables = embedding_tables(run.manifest)
    if not tables or not run.steps:
        return False
    try:
        batch, _ = run.batch(run.steps[0])
    except Exception:  # noqa: BLE001 - an unreadable batch just means "cannot tell"
        return False
    for _, value in leaves(batch):
        if (
            getattr(value, "ndim", 0) == 2
            and np.issubdtype(np.asarray(value).dtype, np.integer)
            and value.size
            and 0 <= int(value.min())
            and int(value.max()) < max(tables)
        ):
            return True
    return False


def perplexity(run: Run, m: Metrics, val_loss: list[tuple[int, float]]) -> Perplexity | None:
    """exp(loss) alongside the loss, for a language model."""
    finite = np.flatnonzero(np.isfinite(m.loss))
    if not len(finite) or not is_language_model(run):
        return None
    ema = smooth(m.loss)
    best = int(finite[np.argmin(m.loss[finite])])
    return Perplexity(
        first=_exp(m.loss[finite[0]]),
        last=_exp(ema[finite[-1]]),
        best=_exp(m.loss[best]),
        best_step=int(m.step[best]),
        val_best=_exp(min(v for _, v in val_loss)) if val_loss else None,
    )


def _exp(x: float) -> float:
    return math.exp(x) if x < 700 else math.inf


# --- plots ----------------------------------------------------------------------------------------------


def plot_data(d: RunData, findings: list[Finding]) -> PlotData:
    m = d.m
    have, ratios = m.measured("update_ratio")
    keep = ~np.isnan(ratios).all(axis=1)
    measured, ratios = have[keep], ratios[keep]
    markers = {(s, f.kind, f.severity) for f in findings if f.kind in MARKED for s in f.steps[:50]}
    known = m.loss_known  # (a step that returned no loss has no point: not a NaN's red triangle)
    return PlotData(
        steps=m.step,
        loss_steps=m.step[known],
        loss=m.loss[known],
        loss_ema=smooth(m.loss[known]),
        grad_norm=m.grad_norm,
        val_metric=d.metric,
        val_steps=[s for s, _ in d.val],
        val_values=[v for _, v in d.val],
        markers=sorted(markers),
        ratio_steps=m.step[measured],
        ratio=ratios.T.astype(np.float64),
        param_names=m.param_names,
        weights=d.snapshots,
        best_val_step=d.stop.best_step if d.stop else None,
        **time_breakdown(m, findings),
    )


def time_breakdown(m: Metrics, findings: list[Finding]) -> dict:
    """PlotData's `time_steps`, `time_parts` and `slow`: the steps with a recorded loop turn,
    its parts (data wait, the step's own compute, checkpoints, the rest), the slow steps."""
    rows = np.flatnonzero(np.isfinite(m.wall_time))
    wait = np.nan_to_num(m.data_wait[rows])
    parts = {"data wait": wait, "step_fn": m.step_time[rows], "checkpoint": m.ckpt_time[rows]}
    parts["other"] = np.maximum(m.wall_time[rows] - wait - m.step_time[rows] - m.ckpt_time[rows], 0.0)
    slow = [(s["step"], s["cause"]) for f in findings if f.kind == "slow_steps" for s in f.evidence["steps"]]
    return {"time_steps": m.step[rows], "time_parts": parts, "slow": slow}
