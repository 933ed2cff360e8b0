"""What ckptlab sends to a tracker: one step's health as named points, the alert of an anomaly.

    row = health_points(scalars, arrays, param_names)   # {"train/loss": 2.3, "grad_norm/fc.weight": 0.4, ...}
    text = alert_text("runs/exp1", 9, events)           # "step 9: nonfinite loss; explain it with ckptlab replay ..."
    episodes = AlertEpisodes()                           # episodes.due(9, events): the events step 9 alerts with
    add_events(row, events, episodes, "runs/exp1")       # the step's events into its row: points, the alert

The live trackers (the Recorder's `trackers=`) and every export (`ckptlab export --tensorboard
/ --mlflow / --wandb`) name points here, so a curve has one name wherever it is shown:

    train/loss, train/grad_norm (before clipping), train/lr (train/lr/group{i} with several
    parameter groups: i counts every optimizer's groups, in the manifest's `optimizers`
    order), train/step_time, train/nonfinite_grads, train/update_ratio
    system/data_wait, system/wall_time, system/step_time, system/ckpt_time, system/gc_time,
    system/recompiles, system/mem_peak (bytes), system/swap, system/samples_per_s,
    system/tokens_per_s                                                where the time went
    grad_norm/<param>, update_ratio/<param>, weight_norm/<param>     per parameter
    val/<metric>                                                       validation
    anomaly/<kind>                                                     an anomaly's value
    warning/<kind>                                                     a warning about the record
    weights/<param>, grads/<param>                                     histograms (exports)

`scalars` and `arrays` are what the Recorder stores for a step (`StepHealth.scalars()` /
`.arrays()`, or a row of `Run.metrics()`). A per-parameter NaN is not sent: it marks a value
not measured that step, or one that was not finite (a NaN gradient or update), which the
step's anomaly alert reports. Nor is `train/loss` of a step whose loss is not known (null: it
returned none), which a NaN would call a fault. The Recorder's warnings about its own record
(an optimizer it was not given, or one that did not step: RECORD_WARNINGS) are events too, but
no fault of a step: they are points of their own (`warning/<kind>`) and never alert.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from ckptlab.run.records import NO_GRAD, RECORD_WARNINGS

# Per-parameter curves multiply the point count by the parameter count; past this many
# parameter tensors only the global curves (and the histograms) are sent: trackers list every
# name in their UI, and a 7B model has ~300 parameter tensors.
MAX_PARAM_SCALARS = 512
PER_PARAM = ("grad_norm", "update_ratio", "weight_norm")
# The step record's field of each (`grad_norm/<param>` is its `param_grad_norm`).
PER_PARAM_FIELDS = {name: "param_grad_norm" if name == "grad_norm" else name for name in PER_PARAM}
# Anomalous steps at most this far apart are one episode: a NaN that persists, or a burst of
# spikes, pages once, not once per step (`AlertEpisodes`).
ALERT_GAP = 16
# How bad each anomaly kind is, for alerting: a worse kind inside an episode alerts again
# (`AlertEpisodes`). 1: a finite number far off its trend, which training often survives;
# 2: an update that moved the weights by over half their norm; 3: a number that is no longer
# one (NaN/Inf), or a step that raised. A kind not named here (a newer one) counts as 1.
SEVERITY = {
    "loss_spike": 1,
    "grad_spike": 1,
    "update_explosion": 2,
    "first_update": 2,
    "nonfinite_loss": 3,
    "nonfinite_grad": 3,
    "nonfinite_weight": 3,
    "exception": 3,
}


@dataclass
class Hist:
    """A histogram of a tensor's finite values (`counts[i]` in [edges[i], edges[i+1]))."""

    counts: list[int]
    edges: list[float]
    min: float
    max: float
    num: int
    sum: float
    sum_squares: float


@dataclass
class Alert:
    step: int
    kinds: list[str]
    text: str  # the one-line verdict and the replay command


@dataclass
class Row:
    """Everything sent at one step, in one call (a W&B run takes steps in increasing order only)."""

    step: int
    scalars: dict[str, float] = field(default_factory=dict)
    time: float | None = None  # when the step was recorded (epoch seconds), if known
    histograms: dict[str, Hist] = field(default_factory=dict)
    alerts: list[Alert] = field(default_factory=list)


def health_points(scalars: dict, arrays: dict, param_names: list[str], *, per_param: bool | None = None) -> dict:
    """The named points of one recorded step (see the module docstring)."""
    out = {
        "train/grad_norm": _f(scalars.get("grad_norm")),
        "train/step_time": _f(scalars.get("step_time")),
        "train/nonfinite_grads": _f(scalars.get("nonfinite_grads", 0)),
    }
    if scalars.get("loss") is not None:  # (null: the step returned no loss; not a NaN to plot)
        out = {"train/loss": float(scalars["loss"]), **out}
    lrs = scalars.get("lr", [])
    for g, value in enumerate(lrs):  # (a group's number is its place among all: one unknown renumbers none)
        if value is not None and not math.isnan(value):
            out["train/lr" if len(lrs) == 1 else f"train/lr/group{g}"] = float(value)
    if scalars.get("update_ratio_global") is not None:
        out["train/update_ratio"] = float(scalars["update_ratio_global"])
    out.update(system_points(scalars))
    if per_param is None:
        per_param = len(param_names) <= MAX_PARAM_SCALARS
    if per_param:
        out.update(param_points(arrays, param_names))
    return out


def param_points(arrays: dict, param_names: list[str]) -> dict:
    """The per-parameter points of one step (`grad_norm/<param>`, ...) from its arrays
    (`param_grad_norm`, `update_ratio`, `weight_norm`: those it has)."""
    out = {}
    names = _per_param_names(tuple(param_names))
    for key in PER_PARAM:
        values = arrays.get(PER_PARAM_FIELDS[key])
        if values is None or len(values) != len(param_names):
            continue
        for name, v in zip(names[key], np.asarray(values, dtype=np.float64).tolist()):
            if not math.isnan(v) and not (key == "grad_norm" and v == NO_GRAD):
                out[name] = v
    return out


# The step record's system fields sent as `system/<field>` (record/system.py): those recorded
# only when not zero are sent as 0 on the other steps; `swap`, read once in 256 steps, only when read.
SYSTEM_POINTS = ("data_wait", "wall_time", "step_time", "mem_peak", "swap")
SYSTEM_ZERO = ("ckpt_time", "gc_time", "recompiles")


def system_points(scalars: dict) -> dict:
    """`system/<field>` of a step's system fields, and `system/samples_per_s`,
    `system/tokens_per_s` (over the loop's whole turn, `wall_time`). None of them for a step
    recorded before they were (no `wall_time`)."""
    wall = scalars.get("wall_time")
    if wall is None:
        return {}
    out = {f"system/{key}": float(scalars[key]) for key in SYSTEM_POINTS if scalars.get(key) is not None}
    out.update({f"system/{key}": float(scalars.get(key, 0.0)) for key in SYSTEM_ZERO})
    if wall > 0:
        for key in ("samples", "tokens"):
            if scalars.get(key) is not None:
                out[f"system/{key}_per_s"] = float(scalars[key]) / wall
    return out


@functools.lru_cache(maxsize=4)
def _per_param_names(param_names: tuple[str, ...]) -> dict[str, list[str]]:
    """`grad_norm/<param>`, ... built once per run, not once per step."""
    return {key: [f"{key}/{n}" for n in param_names] for key in PER_PARAM}


def validation_points(metrics: dict) -> dict:
    return {f"val/{name}": float(value) for name, value in metrics.items()}


def anomaly_points(events: list[dict]) -> dict:
    """`anomaly/<kind>` of each fault; `warning/<kind>` of each warning about the record."""
    return {
        f"{'warning' if e['kind'] in RECORD_WARNINGS else 'anomaly'}/{e['kind']}": _f(e.get("value")) for e in events
    }


def faults(events: list[dict]) -> list[dict]:
    """The events that are a fault of their step: all but the Recorder's warnings about its own
    record (RECORD_WARNINGS), which say nothing about the step they were recorded at."""
    return [e for e in events if e["kind"] not in RECORD_WARNINGS]


def add_events(row: Row, events: list[dict], episodes: AlertEpisodes, run_dir: str) -> bool:
    """The events recorded at `row.step`, into its row: a point each (`anomaly_points`), and
    the alert when `episodes` says the step alerts. Returns whether it does. The live trackers
    and every export fill their rows with this, so they alert where the warning does."""
    row.scalars.update(anomaly_points(events))
    alerting = episodes.due(row.step, events)
    if alerting:
        row.alerts.append(alert(run_dir, row.step, alerting))
    return bool(alerting)


def alert_text(run_dir: str, step: int, events: list[dict]) -> str:
    """The one line that names what happened at `step` and the command that explains it."""
    what = ", ".join(  # error: a step that raised; precursor_text: what stood out before a loss anomaly
        (e.get("error") or e["kind"].replace("_", " "))
        + (f" (after {e['precursor_text']})" if e.get("precursor_text") else "")
        for e in events
    )
    return f"step {step}: {what}; explain it with {replay_command(run_dir, step)}"


def replay_command(run_dir: str, step: int) -> str:
    return f"ckptlab replay --run {run_dir} --step {step}"


def alert(run_dir: str, step: int, events: list[dict]) -> Alert:
    return Alert(step, [e["kind"] for e in events], alert_text(run_dir, step, events))


class AlertEpisodes:
    """Which anomalous steps alert, shared by the Recorder's warning, the live trackers and
    every export: a step alerts when it starts an episode (more than `gap` steps after the
    last anomalous step), or when one of its kinds is more severe (SEVERITY) than every kind
    that alerted earlier in its episode. A NaN at every step pages once, a burst of spikes
    once, but a NaN ten steps after a loss spike pages again: it is a new, worse fact. Only
    faults count (`faults`): a warning about the record neither alerts nor starts an episode."""

    def __init__(self, gap: int = ALERT_GAP):
        self.gap = gap
        self._last = -(10**9)  # the last anomalous step
        self._worst = 0  # the most severe kind alerted in its episode

    def due(self, step: int, events: list[dict]) -> list[dict]:
        """The events step `step` alerts with (its faults), or [] when it does not alert (no
        fault, or none worse than its episode already alerted of); steps come in order."""
        alerting = faults(events)
        if not alerting:
            return []
        if step - self._last > self.gap:
            self._worst = 0
        self._last = step
        severity = max(SEVERITY.get(e["kind"], 1) for e in alerting)
        if severity <= self._worst:
            return []
        self._worst = severity
        return alerting


def histogram(values, bins: int = 64) -> tuple[Hist | None, int]:
    """(the histogram of the finite values of a float tensor, the count of non-finite ones);
    None when nothing finite is left (or the tensor is not floating point)."""
    import torch

    t = values
    if t.is_sparse:
        t = t.to_dense()
    if not t.is_floating_point():
        return None, 0
    x = t.detach().reshape(-1).double()
    finite = torch.isfinite(x)
    bad = int((~finite).sum())
    x = x[finite] if bad else x
    if x.numel() == 0:
        return None, bad
    lo, hi = float(x.min()), float(x.max())
    if lo == hi:  # one value: one bin around it
        lo, hi = lo - 0.5, hi + 0.5
    counts = torch.histc(x, bins=bins, min=lo, max=hi)
    edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
    return (
        Hist(
            counts=[int(c) for c in counts.tolist()],
            edges=edges.tolist(),
            min=float(x.min()),
            max=float(x.max()),
            num=int(x.numel()),
            sum=float(x.sum()),
            sum_squares=float((x * x).sum()),
        ),
        bad,
    )


def run_params(manifest: dict) -> dict[str, str]:
    """The run's versions and recording config, flat, as tracker params."""
    out = {f"ckptlab.{k}": str(v) for k, v in sorted(manifest.get("config", {}).items())}
    out.update({f"versions.{k}": str(v) for k, v in sorted(manifest.get("versions", {}).items())})
    for role, fn in sorted(manifest.get("functions", {}).items()):
        if isinstance(fn, dict) and fn.get("qualname"):
            out[f"ckptlab.{role}"] = f"{fn.get('module', '')}:{fn['qualname']}"
    out["ckptlab.world_size"] = str(manifest.get("world_size", 1))
    out["ckptlab.parameters"] = str(len(manifest.get("parameters", [])))
    return out


def _f(x) -> float:
    return float("nan") if x is None else float(x)
