"""Diagnose a run's training curves: pure functions from a recorded run to findings.

    report = diagnose(ckptlab.open_run("runs/exp1"))
    report.curve.kind                 # "fast_drop", "overfitting", "oscillation", ...
    for f in report.findings:         # most severe first
        f.severity, f.kind, f.title   # "warning", "frozen", "fc1.weight never changes ..."
        f.steps, f.evidence           # where, and the numbers that show it
        f.remedies                    # what people usually do about it

What is looked at, and the thresholds (all in `HealthRules`, each with where it comes from):
- the training loss: its shape (fast drop / slow drop / flat / rising), NaN/Inf, spikes and
  how fast they recover (the one spike rule, analysis/spikes.py), oscillation, plateaus;
- validation: overfitting, found early-stopping style (`early_stopping`, also used by rollback);
- gradients: explosion (norm > 1000 or a spike), non-finite, vanishing (< 1e-6), dead (exact
  zeros), per-layer imbalance (a middle layer orders of magnitude below its neighbours);
- parameters: frozen (update ratio exactly 0, or bit-identical across checkpoints), update
  ratio ||dw||/||w|| outside [1e-3, 1e-1], non-finite or exploding weights, and how far each
  tensor's value distribution drifted between the first and last retained checkpoints;
- perplexity = exp(loss) alongside the loss for language models.

Severities: "error" (training is broken), "warning" (likely wrong, worth acting on), "info"
(worth knowing; a healthy run may have some). A healthy run gets no warning and no error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ckptlab.analysis.batches import embedding_tables, is_embedding, leaves
from ckptlab.analysis.spikes import GRAD_RULE, LOSS_RULE, SpikeRule, find_spikes
from ckptlab.jsonable import NOT_IN_JSON
from ckptlab.run.reader import Metrics, Run

SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}
# A GradScaler that starts at 2**16 backs off a handful of times and then skips about one step
# in its growth_interval (2000); skipping more than 5% of all steps loses real updates.
SCALER_SKIP_SHARE = 0.05


@dataclass(frozen=True)
class HealthRules:
    """Thresholds. Defaults follow common practice; the comment says where each comes from."""

    loss_spike: SpikeRule = LOSS_RULE  # OLMo-style robust z over a rolling window
    grad_spike: SpikeRule = GRAD_RULE
    grad_explosion: float = 1000.0  # pre-clip global norm; typical healthy norms are O(0.1..10)
    grad_vanishing: float = 1e-6  # below this a float32 update is lost in rounding
    dead_fraction: float = 0.5  # a parameter whose gradient is exactly 0 in >= half the steps
    imbalance: float = 1e-2  # "two orders of magnitude" below (or above) its neighbours
    update_ratio_band: tuple[float, float] = (1e-3, 1e-1)  # CS231n / Karpathy: ~1e-3 is healthy
    weight_growth: float = 10.0  # a weight norm that grew 10x is exploding, not learning ...
    weight_growth_floor: float = 1.0  # ... from at least this x the other matrices' per-element scale (zero-init ones)
    fast_recovery: int = 20  # a spike recovered within 20 steps recovered "fast"
    patience: int = 3  # validation evaluations without improvement before it "turned up"
    overfit_rise: float = 0.02  # validation must end >= 2% above its best to call it overfitting ...
    overfit_noise: float = 4.0  # ... and by 4x its evaluation-to-evaluation noise (else: noise, ~1% false alarms)
    oscillation_spread: float = 0.3  # robust std of log-loss: typical swings of >= 35%
    oscillation_anticorrelation: float = -0.25  # lag-1 autocorrelation of the detrended log-loss
    plateau_band: float = 0.15  # log-loss stays within +-7.5% ...
    plateau_fraction: float = 0.2  # ... for >= 20% of the run ...
    plateau_escape: float = 0.3  # ... and later falls >= 26% below it (so it was not convergence)
    max_checkpoints: int = 6  # checkpoints read for weight histograms and drift


# --- findings ------------------------------------------------------------------------------------


@dataclass
class Finding:
    kind: str
    severity: str  # "error" | "warning" | "info"
    title: str  # one line a person can act on
    steps: list[int] = field(default_factory=list)  # where to look (first ones)
    evidence: dict = field(default_factory=dict)  # the numbers that show it
    remedies: list[str] = field(default_factory=list)
    params: list[str] = field(default_factory=list)  # parameters involved, if any


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
class WeightSnapshot:
    """Value statistics of every stored tensor at one checkpoint (for histograms and drift)."""

    step: int
    stats: dict  # name -> ckptlab.stats.results.TensorStats
    digests: dict  # name -> content hash, so bit-identical tensors (a frozen layer) are found


@dataclass
class PlotData:
    """The series the HTML page draws; not part of the JSON document."""

    steps: np.ndarray
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


# --- early stopping (shared with rollback) ------------------------------------------------------


@dataclass
class EarlyStop:
    metric: str
    mode: str
    patience: int
    best_step: int
    best_value: float
    stop_step: int | None  # the evaluation at which patience ran out; None: never
    last_step: int
    last_value: float
    global_best_step: int  # the best over all evaluations (may come after stop_step)
    global_best_value: float


def validation_series(run: Run, metric: str) -> list[tuple[int, float]]:
    """(step, value) of every finite validation point of `metric`, in step order."""
    out = []
    for p in run.validation():
        v = p.get("metrics", {}).get(metric)
        if isinstance(v, (int, float)) and math.isfinite(v):
            out.append((int(p["step"]), float(v)))
    return sorted(out)


def early_stopping(
    points: list[tuple[int, float]],
    metric: str = "val_loss",
    mode: str = "min",
    patience: int = 3,
    min_delta: float = 0.0,
) -> EarlyStop | None:
    """Keras-style early stopping over (step, value) points: the best value seen before
    `patience` evaluations in a row failed to improve on it by more than `min_delta`."""
    if not points:
        return None
    sign = 1.0 if mode == "min" else -1.0
    best, since, stop = points[0], 0, None
    for step, value in points[1:]:
        if sign * (best[1] - value) > min_delta:
            best, since = (step, value), 0
            continue
        since += 1
        if since >= patience:
            stop = step
            break
    glob = min(points, key=lambda sv: sign * sv[1])
    return EarlyStop(metric, mode, patience, best[0], best[1], stop, points[-1][0], points[-1][1], glob[0], glob[1])


# --- the report -------------------------------------------------------------------------------------


def diagnose(run: Run, rules: HealthRules = HealthRules(), *, weights: bool = True, plots: bool = True) -> HealthReport:
    """Every finding for `run`. `weights=False` skips reading checkpoints (faster on big models)."""
    m = run.metrics()
    config = run.manifest.get("config", {})
    metric, mode = config.get("val_metric", "val_loss"), config.get("val_mode", "min")
    val = validation_series(run, metric)
    snapshots = weight_snapshots(run, rules.max_checkpoints) if weights else []
    findings: list[Finding] = []
    loss_findings = [*_nonfinite_loss(m), *_loss_spikes(m, rules)]
    shape = curve_shape(m.loss)
    loss_findings += _oscillation(m, rules) or _rising(m, shape) or []
    loss_findings += _plateau(m, rules)
    stop = early_stopping(val, metric, mode, rules.patience)
    loss_findings += _overfitting(m, stop, val, rules)
    findings += loss_findings
    findings += _crashes(run)
    findings += _gradients(run, m, rules)
    findings += _parameters(run, m, rules, snapshots)
    findings.sort(key=lambda f: (SEVERITY_ORDER[f.severity], f.steps[0] if f.steps else -1))
    curve = _curve_summary(m, shape, loss_findings)
    ppl = _perplexity(run, m, val if metric == "val_loss" else validation_series(run, "val_loss"))
    report = HealthReport(
        run=str(run.path),
        steps={
            "recorded": len(m),
            "first": int(m.step[0]) if len(m) else None,
            "last": int(m.step[-1]) if len(m) else None,
        },
        curve=curve,
        perplexity=ppl,
        findings=findings,
        verdict=_verdict(curve, findings),
        rules=rules,
    )
    if plots:
        report.plots = _plot_data(run, m, val, metric, findings, snapshots, stop)
    return report


def _verdict(curve: CurveSummary, findings: list[Finding]) -> str:
    alarms = [f for f in findings if f.severity != "info"]
    if not alarms:
        if curve.shape == "empty":
            return "No finite loss recorded yet: nothing to judge."
        if curve.shape == "too_short":
            return "Too few steps to judge the curves' shape; no problems found."
        says = {"fast_drop": "drops fast", "slow_drop": "drops slowly", "flat": "is flat", "rising": "rises"}
        return f"Healthy: the loss {says.get(curve.shape, 'is ' + curve.shape.replace('_', ' '))}; no problems found."
    more = f" (+{len(alarms) - 1} more: {', '.join(sorted({f.kind for f in alarms[1:]}))})" if len(alarms) > 1 else ""
    return f"{alarms[0].title}{more}."


# --- loss curve -------------------------------------------------------------------------------------


def smooth(values: np.ndarray, span: int | None = None) -> np.ndarray:
    """Bias-corrected exponential moving average (TensorBoard-style), span max(5, n/50).
    Non-finite values are skipped (the average carries over them), so one NaN does not blank
    the rest of the curve. A positive series is averaged in log space (a geometric mean), so
    a 10^6x spike shows as a blip rather than dragging the curve up for dozens of steps."""
    values = np.asarray(values, dtype=np.float64)
    finite = values[np.isfinite(values)]
    if len(finite) and finite.min() > 0:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.exp(smooth(np.log(values), span))
    span = span or max(5, len(values) // 50)
    alpha = 2.0 / (span + 1)
    out = np.full(len(values), np.nan)
    acc, weight = 0.0, 0.0
    for i, v in enumerate(values):
        if math.isfinite(v):
            acc = (1 - alpha) * acc + alpha * v
            weight = (1 - alpha) * weight + alpha
        if weight > 0:
            out[i] = acc / weight
    return out


def _block_medians(values: np.ndarray, block: int) -> np.ndarray:
    n = len(values) // block
    return np.array([np.nanmedian(values[i * block : (i + 1) * block]) for i in range(n)])


def curve_shape(loss: np.ndarray) -> str:
    """The loss curve's shape, ignoring pathologies: fast or slow drop, flat, or rising.

    Levels are medians of the first 5% and last 20% of steps (robust to noise and spikes).
    Rising: the end > 10% above the start, and by more than 3 standard errors of the two
    medians (on a flat noisy loss the start's few steps alone often sit that far below the
    end). A drop of < 10% of the start is flat; 80% of the drop reached within the first
    quarter of the run is a fast drop.
    """
    finite = loss[np.isfinite(loss)]
    if len(finite) == 0:
        return "empty"
    if len(finite) < 20:
        return "too_short"
    n = len(finite)
    k0, k1 = max(5, n // 20), max(5, n // 5)
    start = float(np.median(finite[:k0]))
    end = float(np.median(finite[-k1:]))
    noise = 1.4826 * float(np.median(np.abs(finite - _rolling_median(finite, 9))))  # one step's
    stderr = 1.2533 * noise * math.sqrt(1 / k0 + 1 / k1)  # of the difference of the two medians
    if end - start > max(0.1 * abs(start), 3 * stderr):  # (a negative loss rises towards 0)
        return "rising"
    if start - end < 0.1 * abs(start):
        return "flat"
    block = max(1, n // 40)
    blocks = _block_medians(finite, block)
    target = start - 0.8 * (start - end)
    reached = int(np.argmax(blocks <= target)) if (blocks <= target).any() else len(blocks)
    return "fast_drop" if reached * block <= n / 4 else "slow_drop"


def _curve_summary(m: Metrics, shape: str, loss_findings: list[Finding]) -> CurveSummary:
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


def _nonfinite_loss(m: Metrics) -> list[Finding]:
    bad = np.flatnonzero(~np.isfinite(m.loss))
    if len(bad) == 0:
        return []
    i = int(bad[0])
    before = m.loss[max(0, i - 20) : i]
    before = before[np.isfinite(before)]
    rising = len(before) >= 5 and before[-1] > 2 * np.median(before)
    return [
        Finding(
            kind="explosion",
            severity="error",
            title=f"loss became {m.loss[i]} at step {m.step[i]}" + (" after rising sharply" if rising else ""),
            steps=[int(s) for s in m.step[bad[:20]]],
            evidence={
                "first_step": int(m.step[i]),
                "nonfinite_steps": int(len(bad)),
                "loss_before": [float(x) for x in before[-5:]],
                "grad_norm_before": [float(x) for x in m.grad_norm[max(0, i - 5) : i]],
            },
            remedies=[
                f"find the cause: ckptlab replay --step {int(m.step[i])}",
                "check that batch for bad values: ckptlab dirty",
                "lower the learning rate or lengthen warm-up; clip gradients (clip_grad_norm_ 1.0)",
                "compute softmax/log/loss in float32; add eps to divisions and norms",
            ],
        )
    ]


def _crashes(run: Run) -> list[Finding]:
    """Steps whose own code raised (the Recorder's `exception` events)."""
    out = []
    for e in run.events():
        if e.get("kind") != "exception":
            continue
        step, where = int(e["step"]), ""
        if e.get("module") is not None:
            where += f" in `{e['module'] or '<root>'}`"
        if e.get("source"):
            where += f" at {e['source']}"
        out.append(
            Finding(
                kind="crash",
                severity="error",
                title=f"step {step} raised {e.get('error', 'an exception')}{where}",
                steps=[step],
                evidence={k: e[k] for k in ("error", "source", "call", "module", "phase") if e.get(k) is not None},
                remedies=[
                    f"replay it: ckptlab replay --step {step} (does it raise again, and on which rows?)",
                    "a crash that does not reproduce is transient (out of memory, hardware, I/O): resume with "
                    "Recorder(..., resume=True)",
                    "a row that raises alone: skip it and resume from the checkpoint before it (ckptlab rollback)",
                ],
            )
        )
    return out


def _loss_spikes(m: Metrics, rules: HealthRules) -> list[Finding]:
    """Group spikes into episodes and say how fast each recovered.

    Recovered = the loss (median of 3 steps) back within 10% of the level before the spike.
    """
    spikes = find_spikes(m.loss, rules.loss_spike)
    out, i = [], 0
    while i < len(spikes):
        idx, spike = spikes[i]
        level = spike.median + 0.1 * abs(spike.median)  # 10% above it, also for a negative loss
        rec = _recovery(m.loss, idx, level)
        j = i + 1
        while j < len(spikes) and (rec is None or spikes[j][0] <= rec):  # spikes before recovery: same episode
            rec = _recovery(m.loss, spikes[j][0], level)
            j += 1
        episode = spikes[i:j]
        peak_i, peak = max(episode, key=lambda e: e[1].value)
        remaining = len(m.loss) - 1 - episode[-1][0]
        if rec is not None:
            took = int(m.step[rec] - m.step[idx])
            speed = "fast" if took <= rules.fast_recovery else "slow"
        elif remaining < rules.fast_recovery:
            took, speed = None, "unknown"
        else:
            took, speed = None, "none"
        # Small-batch losses are heavy-tailed: an isolated < 10x spike that recovers fast is
        # normal noise more often than not, so it is information, not an alarm.
        severity = {
            "fast": "warning" if peak.ratio >= 10 else "info",
            "slow": "warning",
            "unknown": "warning",
            "none": "error",
        }[speed]
        text = {
            "fast": f"recovered in {took} steps",
            "slow": f"recovered slowly, in {took} steps",
            "unknown": "too recent to tell whether it recovers",
            "none": "never recovered",
        }[speed]
        steps = [int(m.step[k]) for k, _ in episode]
        out.append(
            Finding(
                kind="loss_spike",
                severity=severity,
                title=f"loss spiked {peak.ratio:.3g}x at step {steps[0]} and {text}",
                steps=steps,
                evidence={
                    "peak_step": int(m.step[peak_i]),
                    "peak": peak.value,
                    "level_before": peak.median,
                    "z": peak.z,
                    "recovery": speed,
                    "recovery_steps": took,
                },
                remedies=[
                    f"look for the bad samples: ckptlab dirty (spike steps {steps[:5]})",
                    f"replay it: ckptlab replay --step {steps[0]}",
                    "if spikes repeat: lower the learning rate, clip gradients, or skip the batches (ckptlab.skip_samples)",
                ]
                + (["roll back to before it: ckptlab rollback --before-anomaly"] if speed == "none" else []),
            )
        )
        i = j
    return out


def _recovery(loss: np.ndarray, idx: int, level: float) -> int | None:
    for k in range(idx + 1, len(loss)):
        window = loss[k : k + 3]
        window = window[np.isfinite(window)]
        if len(window) and np.median(window) <= level:
            return k
    return None


def _tail_log(m: Metrics) -> tuple[np.ndarray, np.ndarray] | None:
    """Log-loss and steps of the run's second half, when there is enough of it."""
    finite = np.isfinite(m.loss) & (m.loss > 0)
    n = len(m.loss)
    if finite.sum() < 40:
        return None
    idx = np.flatnonzero(finite)
    idx = idx[idx >= n // 2]
    if len(idx) < 20:
        return None
    return np.log(m.loss[idx]), m.step[idx]


def _oscillation(m: Metrics, rules: HealthRules) -> list[Finding]:
    """High variance without a trend, from a learning rate that is too high.

    Minibatch noise alone can make a loss bounce as much, so a bouncing loss counts as
    oscillation only with a sign of a too-high learning rate: consecutive steps anticorrelated
    (up, down, up: overshooting a minimum; i.i.d. noise gives ~0) or weight matrices changing
    by more than the update-ratio band's top (10%) per step.
    """
    tail = _tail_log(m)
    if tail is None:
        return []
    logl, steps = tail
    k = max(5, len(logl) // 5)
    trend = float(np.median(logl[-k:]) - np.median(logl[:k]))  # log ratio end / start of the half
    spread = 1.4826 * float(np.median(np.abs(logl - np.median(logl))))
    resid = logl - _rolling_median(logl, 9)
    ac = float(np.corrcoef(resid[:-1], resid[1:])[0, 1]) if np.std(resid) > 0 else 0.0
    ratio = _median_update_ratio(m, first_step=int(steps[0]))
    if trend < math.log(0.9) or spread < rules.oscillation_spread:
        return []
    high_ratio = ratio is not None and ratio > rules.update_ratio_band[1]
    if ac > rules.oscillation_anticorrelation and not high_ratio:
        return []
    return [
        Finding(
            kind="oscillation",
            severity="warning",
            title=f"loss oscillates (typical swing {math.exp(spread) - 1:.0%}) without improving since step {int(steps[0])}",
            steps=[int(steps[0]), int(steps[-1])],
            evidence={
                "log_spread": spread,
                "trend": math.exp(trend),
                "lag1_autocorrelation": ac,
                "median_update_ratio": ratio,
                "level": float(math.exp(np.median(logl))),
            },
            remedies=[
                "lower the learning rate (3-10x) or add warm-up",
                "use a larger batch (less gradient noise) or gradient accumulation",
                "clip gradients; for Adam, check beta2 (0.95-0.999) and eps",
            ],
        )
    ]


def _rolling_median(x: np.ndarray, w: int) -> np.ndarray:
    h = w // 2
    padded = np.pad(x, h, mode="edge")
    windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * h + 1)
    return np.median(windows, axis=1)


def _rising(m: Metrics, shape: str) -> list[Finding]:
    if shape != "rising":
        return []
    finite = m.loss[np.isfinite(m.loss)]
    n = len(finite)
    start, end = float(np.median(finite[: max(5, n // 20)])), float(np.median(finite[-max(5, n // 5) :]))
    return [
        Finding(
            kind="diverging",
            severity="warning",
            title=f"loss rose from {start:.4g} to {end:.4g} over the run",
            steps=[int(m.step[0]), int(m.step[-1])],
            evidence={"start": start, "end": end},
            remedies=[
                "lower the learning rate",
                "check the loss sign and the labels",
                "check the data order (a shift in distribution?)",
            ],
        )
    ]


def _plateau(m: Metrics, rules: HealthRules) -> list[Finding]:
    """A long flat stretch that training later left by falling well below it.

    Works on block medians of the log-loss (so minibatch noise does not break a plateau into
    pieces). A window counts when its blocks stay within a band (+-7.5%, widened to 4 block-
    noise sigmas on noisy curves), it spans >= 20% of the run, and the equally long stretch
    after it sits lower by at least the most of: 26%, twice the band, a quarter of the whole
    run's (log) drop -- and 4x more than the loss fell inside the window. Those keep a
    converged tail, a noisy phase and a steady slow drop from counting.
    """
    finite = np.isfinite(m.loss) & (m.loss > 0)
    if finite.sum() < 40:
        return []
    idx = np.flatnonzero(finite)
    logl = np.log(m.loss[idx])
    block = max(5, len(logl) // 40)
    blocks = _block_medians(logl, block)
    noise = 1.4826 * float(np.median(np.abs(logl - _rolling_median(logl, 9))))
    band = max(rules.plateau_band, 4 * 1.25 * noise / math.sqrt(block))
    need = max(3, math.ceil(rules.plateau_fraction * len(blocks)))
    k = max(1, len(blocks) // 10)
    total = float(np.median(blocks[:k]) - np.median(blocks[-k:]))
    required = max(rules.plateau_escape, 2 * band, 0.25 * total)
    best, lo = None, 0
    for hi in range(len(blocks)):  # for each end, the longest window within the band
        while blocks[lo : hi + 1].max() - blocks[lo : hi + 1].min() > band:
            lo += 1
        n = hi - lo + 1
        if n < need or (best is not None and n <= best[1] - best[0] + 1):
            continue
        window, after = blocks[lo : hi + 1], blocks[hi + 1 : hi + 1 + n]
        if len(after) < max(2, n // 3):
            continue
        third = max(1, n // 3)
        level = float(np.median(window))
        inside = float(np.median(window[:third]) - np.median(window[-third:]))
        fall = level - float(np.median(after))
        if fall >= required and inside <= 0.25 * fall:
            best = (lo, hi, level, fall)
    if best is None:
        return []
    lo, hi, level, fall = best
    first, last = int(m.step[idx[lo * block]]), int(m.step[idx[(hi + 1) * block - 1]])
    return [
        Finding(
            kind="plateau",
            severity="warning",
            title=f"loss sat flat at {math.exp(level):.4g} for {last - first + 1} steps ({first}..{last}) before it fell again",
            steps=[first, last],
            evidence={
                "level": math.exp(level),
                "length": last - first + 1,
                "fell_after_by": 1 - math.exp(-fall),
                "band": band,
            },
            remedies=[
                "check the learning-rate schedule over those steps (warm-up too long? LR near zero?)",
                "check initialization and normalization (dead ReLUs, saturated activations)",
                "a plateau followed by a drop wastes steps: raise the LR there, or start from a better init",
            ],
        )
    ]


def _overfitting(m: Metrics, stop: EarlyStop | None, val: list[tuple[int, float]], rules: HealthRules) -> list[Finding]:
    """Validation turned up (early stopping) and really rose: where it ended (the median of
    the last `patience` evaluations, so one noisy point does not decide) sits >= 2% above its
    best and 4x its noise above it. The best of many noisy evaluations is their low outlier:
    a flat validation loss that bounces +-5% ends 2% above it most of the time. The noise is the
    robust std of one evaluation, from the differences of successive ones after the best
    (their median taken out, so a steady rise is not counted as noise)."""
    if stop is None or stop.stop_step is None:
        return []
    sign = 1.0 if stop.mode == "min" else -1.0
    after = np.array([v for s, v in val if s >= stop.best_step], dtype=np.float64)
    end = float(np.median(after[-stop.patience :])) if len(after) else stop.last_value
    d = np.diff(after)
    noise = 1.4826 * float(np.median(np.abs(d - np.median(d)))) / math.sqrt(2) if len(d) >= 2 else 0.0
    rise = sign * (end - stop.best_value) / max(abs(stop.best_value), 1e-12)
    at_best = m.window(stop.best_step - 10, stop.best_step)
    at_end = m.window(stop.last_step - 20, stop.last_step)
    train_best = _nanmedian(m.loss[at_best])
    train_end = _nanmedian(m.loss[at_end])
    train_fell = math.isfinite(train_best) and math.isfinite(train_end) and train_end < train_best
    if rise < rules.overfit_rise or sign * (end - stop.best_value) < rules.overfit_noise * noise:
        # Validation may have stalled for `patience` evaluations and then beaten that best: then
        # training on did help, and early stopping with this patience would have stopped too soon.
        later = sign * (stop.global_best_value - stop.best_value) < 0 and stop.global_best_step > stop.stop_step
        title = f"{stop.metric} stopped improving after step {stop.best_step} ({stop.best_value:.4g})"
        if later:
            title = (
                f"{stop.metric} stalled for {stop.patience} evaluations after step {stop.best_step} "
                f"({stop.best_value:.4g}), then improved to {stop.global_best_value:.4g} at step {stop.global_best_step}"
            )
        return [
            Finding(
                kind="validation_plateau",
                severity="info",
                title=title,
                steps=[stop.best_step],
                evidence={
                    "best_step": stop.best_step,
                    "best": stop.best_value,
                    "last": stop.last_value,
                    "end": end,
                    "noise": noise,
                    "patience": stop.patience,
                    "global_best_step": stop.global_best_step,
                    "global_best": stop.global_best_value,
                },
                remedies=(
                    [
                        f"early stopping with patience {stop.patience} would have stopped too soon: use a larger "
                        "patience (ckptlab report/rollback --patience N)"
                    ]
                    if later
                    else ["training longer is unlikely to help; stop, or lower the learning rate"]
                ),
            )
        ]
    if not train_fell:
        return []
    return [
        Finding(
            kind="overfitting",
            severity="warning",
            title=(
                f"{stop.metric} was best at step {stop.best_step} ({stop.best_value:.4g}) and "
                f"{'rose' if stop.mode == 'min' else 'fell'} {rise:.0%} to {end:.4g} while the training loss kept falling"
            ),
            steps=[stop.best_step, stop.last_step],
            evidence={
                "best_step": stop.best_step,
                "best": stop.best_value,
                "last_step": stop.last_step,
                "last": stop.last_value,
                "end": end,
                "noise": noise,
                "rise": rise,
                "train_loss_at_best": train_best,
                "train_loss_at_end": train_end,
                "patience": stop.patience,
                "stopped_at": stop.stop_step,
            },
            remedies=[
                f"go back to the best checkpoint: ckptlab rollback --metric {stop.metric} --mode {stop.mode}",
                "stop earlier (early stopping), or add regularization: weight decay, dropout, data augmentation",
                "more (or more varied) training data, or a smaller model",
            ],
        )
    ]


# --- gradients --------------------------------------------------------------------------------------


def _gradients(run: Run, m: Metrics, rules: HealthRules) -> list[Finding]:
    out: list[Finding] = []
    g = m.grad_norm
    names = m.param_names
    big = np.flatnonzero(np.isfinite(g) & (g > rules.grad_explosion))
    spikes = find_spikes(g, rules.grad_spike)
    if len(big) or spikes:
        steps = sorted({int(m.step[i]) for i in big} | {int(m.step[i]) for i, _ in spikes})
        worst = int(np.nanargmax(np.where(np.isfinite(g), g, -np.inf)))
        # Healthy runs show the odd 2-4x gradient spike; a 10x one, or a run of them, is not.
        severe = max(s.ratio for _, s in spikes) >= 10 if spikes else False
        out.append(
            Finding(
                kind="gradient_explosion",
                severity="error" if len(big) else ("warning" if severe or len(spikes) >= 3 else "info"),
                title=(
                    f"gradient norm exceeded {rules.grad_explosion:g} at {len(big)} step(s), first {int(m.step[big[0]])}"
                    if len(big)
                    else f"gradient norm spiked at {len(steps)} step(s), first {steps[0]} ({spikes[0][1].ratio:.3g}x the recent level)"
                ),
                steps=steps[:50],
                evidence={
                    "max": float(g[worst]),
                    "max_step": int(m.step[worst]),
                    "median": float(np.nanmedian(g)),
                    "spike_steps": [int(m.step[i]) for i, _ in spikes][:50],
                    "over_threshold": len(big),
                },
                remedies=[
                    "clip gradients (torch.nn.utils.clip_grad_norm_(params, 1.0))",
                    "lower the learning rate or lengthen warm-up",
                    "look for bad samples at those steps: ckptlab dirty",
                ],
            )
        )
    # A step the GradScaler skipped overflowed its scaled float16 gradients: routine, reported
    # apart (below) and never as a non-finite-gradient error.
    bad = np.flatnonzero((m.nonfinite_grads > 0) & ~m.scaler_skipped)
    if len(bad):
        cols = np.flatnonzero((m.param_nonfinite[bad] != 0).any(axis=0))  # -1: not counted
        out.append(
            Finding(
                kind="nonfinite_gradient",
                severity="error",
                title=f"non-finite gradients at {len(bad)} step(s), first {int(m.step[bad[0]])}",
                steps=[int(s) for s in m.step[bad[:50]]],
                evidence={"first_step": int(m.step[bad[0]]), "elements": int(m.nonfinite_grads[bad[0]])},
                params=[names[c] for c in cols[:20]],
                remedies=[
                    f"find the op that produced it: ckptlab replay --step {int(m.step[bad[0]])}",
                    "with AMP: a GradScaler skips such steps; frequent ones mean a scale or a float16 overflow",
                ],
            )
        )
    skipped = np.flatnonzero(m.scaler_skipped)
    if len(skipped):
        # A few skips while the scale settles are how a GradScaler works; past SCALER_SKIP_SHARE
        # of all steps the update is lost too often (a float16 overflow the scale cannot cure).
        share = len(skipped) / max(len(m), 1)
        out.append(
            Finding(
                kind="scaler_skips",
                severity="warning" if share > SCALER_SKIP_SHARE else "info",
                title=f"the GradScaler skipped {len(skipped)} step(s) ({share:.1%}) on overflowed gradients, first {int(m.step[skipped[0]])}",
                steps=[int(s) for s in m.step[skipped[:50]]],
                evidence={"skipped": len(skipped), "share": share, "first_step": int(m.step[skipped[0]])},
                remedies=[
                    "a few skips while the scale settles are normal",
                    "frequent ones: lower the GradScaler's init_scale, or train in bfloat16",
                ],
            )
        )
    pg = np.where(m.param_grad_norm < 0, np.nan, m.param_grad_norm.astype(np.float64))  # -1: no gradient
    present = np.isfinite(pg)
    shapes = _shapes(run)
    med = _nanmedian_cols(pg)
    zero_frac = np.where(present.sum(0) > 0, (pg == 0).sum(0) / np.maximum(present.sum(0), 1), 0.0)
    dead = [j for j in range(len(names)) if zero_frac[j] >= rules.dead_fraction]
    if dead:
        out.append(
            Finding(
                kind="dead_gradient",
                severity="warning",
                title=f"{len(dead)} parameter(s) get exactly zero gradient in most steps: {_few([names[j] for j in dead])}",
                steps=[],
                evidence={names[j]: {"zero_fraction": float(zero_frac[j])} for j in dead[:20]},
                params=[names[j] for j in dead],
                remedies=[
                    "dead ReLUs: lower the LR, use LeakyReLU/GELU, check the init and the bias",
                    "a branch cut off by a mask or a detach(): check the forward pass",
                ],
            )
        )
    vanishing = [
        j for j in range(len(names)) if j not in dead and math.isfinite(med[j]) and 0 < med[j] < rules.grad_vanishing
    ]
    global_med = _nanmedian(g[len(g) // 2 :])  # NaN when every step's norm was NaN
    if vanishing or (math.isfinite(global_med) and global_med < rules.grad_vanishing):
        out.append(
            Finding(
                kind="vanishing_gradient",
                severity="warning",
                title=(
                    f"gradients vanish (median norm < {rules.grad_vanishing:g}) for {_few([names[j] for j in vanishing])}"
                    if vanishing
                    else f"the global gradient norm vanished (median {global_med:.3g} over the second half)"
                ),
                steps=[],
                evidence={"global_median": global_med, **{names[j]: float(med[j]) for j in vanishing[:20]}},
                params=[names[j] for j in vanishing],
                remedies=[
                    "check normalization (LayerNorm/BatchNorm) and residual connections",
                    "use a better initialization (Kaiming/Xavier) and non-saturating activations",
                    "check for a loss scaled to ~0 or a detached graph",
                ],
            )
        )
    out += _imbalance(names, shapes, med, rules)
    return out


def _imbalance(names: list[str], shapes: dict, med: np.ndarray, rules: HealthRules) -> list[Finding]:
    """A middle weight matrix whose per-element gradient (norm / sqrt(numel), so sizes compare)
    is orders of magnitude off the geometric mean of its two neighbours in parameter order.
    Only weight matrices are compared: biases and norm gains naturally differ."""
    mats = [j for j, n in enumerate(names) if len(shapes.get(n, ())) >= 2 and math.isfinite(med[j]) and med[j] > 0]
    rms = {j: med[j] / math.sqrt(max(1, math.prod(shapes[names[j]]))) for j in mats}
    out = []
    for a, j, b in zip(mats, mats[1:], mats[2:]):
        ref = math.sqrt(rms[a] * rms[b])
        ratio = rms[j] / ref
        if ratio < rules.imbalance or ratio > 1 / rules.imbalance:
            direction = "below" if ratio < 1 else "above"
            out.append(
                Finding(
                    kind="gradient_imbalance",
                    severity="warning",
                    title=f"{names[j]}'s gradient is {_orders(ratio)} orders of magnitude {direction} its neighbours ({names[a]}, {names[b]})",
                    steps=[],
                    evidence={"ratio": ratio, "rms_grad": rms[j], "neighbours_rms_grad": [rms[a], rms[b]]},
                    params=[names[j]],
                    remedies=[
                        "check that layer's scale: a multiplier in the forward, a mis-scaled init or a per-layer LR",
                        "add normalization between layers; check for a residual branch that is cut",
                    ],
                )
            )
    return out


def _orders(ratio: float) -> str:
    return f"{abs(math.log10(ratio)):.1f}"


# --- parameters --------------------------------------------------------------------------------------


def _parameters(run: Run, m: Metrics, rules: HealthRules, snapshots: list[WeightSnapshot]) -> list[Finding]:
    out: list[Finding] = []
    names = m.param_names
    shapes = _shapes(run)
    trainable = {p["name"]: p.get("requires_grad", True) for p in run.manifest.get("parameters", [])}
    measured = np.flatnonzero(~np.isnan(m.update_ratio).all(axis=1) & m.stepped) if len(m) else np.array([], dtype=int)
    ur = m.update_ratio[measured].astype(np.float64)
    # A ratio measured on non-finite weights is recorded as 0 (NaN is not > 0): it says nothing
    # about whether the parameter moves, so such steps are left out (else an all-NaN run is "frozen").
    weighed = np.array(["nonfinite_weights" in m.scalars[i] for i in measured], dtype=bool)  # norms measured
    ur[weighed[:, None] & ~np.isfinite(m.weight_norm[measured])] = np.nan

    unchanged = _unchanged_between(snapshots) if len(snapshots) >= 2 else set()
    frozen: dict[int, dict] = {}
    for j, name in enumerate(names):
        if not trainable.get(name, True):
            continue
        col = ur[:, j][np.isfinite(ur[:, j])] if len(measured) else np.array([])
        zero_ratio = len(col) >= 2 and bool(np.all(col == 0))
        if zero_ratio or name in unchanged:
            grads = m.param_grad_norm[:, j]
            grads = grads[np.isfinite(grads) & (grads >= 0)]  # -1: no gradient that step
            frozen[j] = {
                "update_ratio_always_0": zero_ratio,
                "measured_steps": int(len(col)),
                "bit_identical_across_checkpoints": name in unchanged,
                "median_grad_norm": float(np.median(grads)) if len(grads) else None,
            }
    if frozen:
        gets_grad = any((ev["median_grad_norm"] or 0) > 0 for ev in frozen.values())
        out.append(
            Finding(
                kind="frozen",
                severity="warning",
                title=f"{_few([names[j] for j in frozen])} never change"
                + (" although they get gradients" if gets_grad else ""),
                steps=[],
                evidence={names[j]: ev for j, ev in list(frozen.items())[:20]},
                params=[names[j] for j in frozen],
                remedies=[
                    "are they in the optimizer? (build the optimizer after the model is complete; check param groups)",
                    "a param group with lr=0 or a scheduler that reached 0",
                    "if frozen on purpose, set requires_grad=False (then no gradient is computed either)",
                ],
            )
        )
    off = [n for n, t in trainable.items() if not t]
    if off:
        out.append(
            Finding(
                kind="requires_grad_false",
                severity="info",
                title=f"{len(off)} parameter(s) have requires_grad=False (frozen on purpose?): {_few(off)}",
                params=off,
                remedies=["if they should train, set requires_grad=True and add them to the optimizer"],
            )
        )
    out += _update_ratio_band(m, names, shapes, measured, ur, set(frozen), rules)
    out += _weight_health(m, names, shapes, rules, snapshots)
    return out


def _update_ratio_band(m: Metrics, names, shapes, measured, ur, frozen: set, rules: HealthRules) -> list[Finding]:
    """Median ||dw||/||w|| per weight matrix over the main learning-rate phase (steps where the
    LR is >= half its peak: warm-up and final decay legitimately move it out of the band)."""
    if not len(measured):
        return []
    lr = np.nanmax(m.lr, axis=1) if m.lr.size else np.ones(len(m))
    peak = np.nanmax(lr) if np.isfinite(lr).any() else 1.0
    main = measured[np.nan_to_num(lr[measured], nan=peak) >= 0.5 * peak]
    if len(main) < 2:
        main = measured
    rows = np.isin(measured, main)
    lo, hi = rules.update_ratio_band
    low, high = {}, {}
    for j, name in enumerate(names):
        if j in frozen or len(shapes.get(name, ())) < 2:
            continue
        col = ur[rows, j]
        col = col[np.isfinite(col)]
        if not len(col):
            continue
        med = float(np.median(col))
        if med > hi:
            high[name] = med
        elif 0 < med < lo:
            low[name] = med
    out = []
    if high:
        worst = max(high.values())
        out.append(
            Finding(
                kind="update_ratio_high",
                severity="error" if worst > 1.0 else "warning",
                title=f"updates change {_few(sorted(high, key=high.get, reverse=True))} by {worst:.2g} of their norm per step (above {hi:g})",
                steps=[int(m.step[main[0]]), int(m.step[main[-1]])],
                evidence={"median_update_ratio": high, "band": [lo, hi]},
                params=sorted(high),
                remedies=[
                    "lower the learning rate (for these layers: a separate param group)",
                    "add warm-up; check weight decay is not huge",
                ],
            )
        )
    if low:
        worst = min(low.values())
        severe = any(v < lo / 10 and not is_embedding(n) for n, v in low.items())
        out.append(
            Finding(
                kind="update_ratio_low",
                severity="warning" if severe else "info",
                title=f"{_few(sorted(low, key=low.get))} learn slowly: updates are {worst:.2g} of their norm per step (below {lo:g})",
                steps=[int(m.step[main[0]]), int(m.step[main[-1]])],
                evidence={"median_update_ratio": low, "band": [lo, hi]},
                params=sorted(low),
                remedies=[
                    "raise the learning rate (for these layers: a separate param group)",
                    "check the layer's gradient (vanishing? imbalanced?) and its weight scale",
                    "embeddings update only the rows in the batch, so their ratio is naturally lower",
                ],
            )
        )
    return out


def _weight_health(m: Metrics, names, shapes, rules: HealthRules, snapshots: list[WeightSnapshot]) -> list[Finding]:
    out = []
    # Steps where weight norms were measured: their record counts the non-finite ones (a NaN
    # in weight_norm alone could also mean "not measured").
    measured = np.array([i for i, sc in enumerate(m.scalars) if "nonfinite_weights" in sc], dtype=int)
    wn = m.weight_norm[measured].astype(np.float64) if len(measured) else np.zeros((0, len(names)))
    bad_cols = np.flatnonzero((~np.isfinite(wn)).any(axis=0)) if len(wn) else np.array([], dtype=int)
    ckpt_bad = sorted({(s.step, n) for s in snapshots for n, st in s.stats.items() if st.nonfinite})
    if len(bad_cols) or ckpt_bad:
        first = [int(m.step[measured[np.argmax(~np.isfinite(wn[:, j]))]]) for j in bad_cols]
        steps = sorted(set(first) | {s for s, _ in ckpt_bad})
        params = sorted({names[j] for j in bad_cols} | {n for _, n in ckpt_bad})
        out.append(
            Finding(
                kind="nonfinite_weights",
                severity="error",
                title=f"weights became non-finite ({_few(params)}), first seen at step {steps[0]}",
                steps=steps[:50],
                evidence={"checkpoints": [{"step": s, "tensor": n} for s, n in ckpt_bad[:20]]},
                params=params,
                remedies=[
                    "roll back to a healthy checkpoint: ckptlab rollback --before-anomaly",
                    f"find the cause: ckptlab replay --step {steps[0]}",
                ],
            )
        )
    grown = {}
    if len(wn) >= 2:
        # biases and norm gains start near 0 or 1: growth is normal
        mats = [j for j, name in enumerate(names) if len(shapes.get(name, ())) >= 2]
        cols = {j: wn[:, j][np.isfinite(wn[:, j])] for j in mats}
        numel = {j: max(1, math.prod(shapes[names[j]])) for j in mats}
        rms = {j: float(cols[j][0]) / math.sqrt(numel[j]) for j in mats if len(cols[j])}
        for j in mats:
            col = cols[j]
            if len(col) < 2:
                continue
            base = max(float(col[0]), _growth_floor(j, names[j], shapes, numel, rms, rules))
            if base > 0 and col[-1] / base >= rules.weight_growth:
                grown[names[j]] = float(col[-1] / base)
    if grown:
        out.append(
            Finding(
                kind="exploding_weights",
                severity="warning",
                title=f"weight norms grew up to {max(grown.values()):.3g}x: {_few(sorted(grown, key=grown.get, reverse=True))}",
                steps=[int(m.step[measured[0]]), int(m.step[measured[-1]])],
                evidence={"growth": grown},
                params=sorted(grown),
                remedies=["add or raise weight decay", "lower the learning rate", "check for a missing normalization"],
            )
        )
    if len(snapshots) >= 2:
        out += _drift(snapshots)
    return out


def _growth_floor(j: int, name: str, shapes: dict, numel: dict, rms: dict, rules: HealthRules) -> float:
    """The least norm weight growth is measured from: `weight_growth_floor` x the median per-element
    RMS of the other weight matrices (at their first measurement) x sqrt(numel) -- a matrix that
    starts at zero (LoRA B, adaLN-Zero, a zero-init output layer) has a first norm of about
    lr x sqrt(numel) after one update, and growing to its neighbours' scale is learning, not an
    explosion. With no other matrix: the norm of PyTorch's default init, U(+-1/sqrt(fan_in))."""
    others = [v for k, v in rms.items() if k != j and math.isfinite(v) and v > 0]
    if others:
        ref = float(np.median(others))
    else:
        fan_in = max(1, numel[j] // max(1, shapes[name][0]))
        ref = 1 / math.sqrt(3 * fan_in)
    return rules.weight_growth_floor * ref * math.sqrt(numel[j])


def _drift(snapshots: list[WeightSnapshot]) -> list[Finding]:
    """How far each tensor's value distribution moved between the first and last checkpoint:
    total variation distance of the fixed log-scale histograms (0 same .. 1 disjoint) and the
    ratio of standard deviations. Weights are meant to move, so this is information unless a
    distribution changed scale by 10x or more."""
    a, b = snapshots[0], snapshots[-1]
    rows = {}
    for name, sa in a.stats.items():
        sb = b.stats.get(name)
        if sb is None or sa.numel < 64 or sa.hist.sum() == 0 or sb.hist.sum() == 0:  # tiny tensors: no distribution
            continue
        tv = 0.5 * float(np.abs(sa.hist / sa.hist.sum() - sb.hist / sb.hist.sum()).sum())
        scale = sb.std / sa.std if sa.std > 0 and math.isfinite(sb.std) else math.nan
        rows[name] = {"tv_distance": tv, "std_ratio": scale, "mean_from": sa.mean, "mean_to": sb.mean}
    moved = {
        n: r
        for n, r in rows.items()
        if r["tv_distance"] >= 0.5 or (math.isfinite(r["std_ratio"]) and not 1 / 3 <= r["std_ratio"] <= 3)
    }
    if not moved:
        return []
    extreme = [n for n, r in moved.items() if math.isfinite(r["std_ratio"]) and not 0.1 <= r["std_ratio"] <= 10]
    return [
        Finding(
            kind="weight_drift",
            severity="warning" if extreme else "info",
            title=f"{len(moved)} tensor(s) changed distribution a lot between checkpoints {a.step} and {b.step}: {_few(sorted(moved, key=lambda n: -moved[n]['tv_distance']))}",
            steps=[a.step, b.step],
            evidence={n: moved[n] for n in sorted(moved, key=lambda n: -moved[n]["tv_distance"])[:20]},
            params=sorted(moved),
            remedies=[
                "expected early in training; late in training it can mean instability or a too-high LR",
                f"compare them: ckptlab diff RUN@{a.step} RUN@{b.step}",
            ],
        )
    ]


def _unchanged_between(snapshots: list[WeightSnapshot]) -> set[str]:
    a, b = snapshots[0], snapshots[-1]
    if a.step == b.step:
        return set()
    return {  # NaN stays NaN: a tensor non-finite in both is broken, not frozen
        n for n, d in a.digests.items() if d and b.digests.get(n) == d and not a.stats[n].nonfinite
    }


# --- checkpoints ------------------------------------------------------------------------------------


def weight_snapshots(run: Run, limit: int = 6) -> list[WeightSnapshot]:
    """Tensor statistics of up to `limit` retained checkpoints (first, last, evenly between),
    read one tensor at a time, each with a content digest (no tensor is kept around)."""
    import hashlib

    import torch

    from ckptlab.io import open_checkpoint
    from ckptlab.stats.tensor import tensor_stats

    steps = run.checkpoints
    if not steps:
        return []
    if len(steps) > limit:
        pick = np.unique(np.linspace(0, len(steps) - 1, limit).round().astype(int))
        steps = [steps[i] for i in pick]
    out = []
    for step in steps:
        path = run.checkpoint(step).model_path
        stats, digests = {}, {}
        try:  # any checkpoint layout (model.safetensors, or an FSDP run's DCP shards)
            with open_checkpoint(f"{run.path}@{step}", verify=False) as weights:
                for name in weights.refs:  # each stored tensor once (tied names share one)
                    t = weights[name]
                    stats[name] = tensor_stats(t)
                    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
                    digests[name] = hashlib.blake2b(raw, digest_size=16).hexdigest()
        except Exception as e:  # noqa: BLE001 - a corrupt checkpoint is skipped here, reported by info/rollback
            run.problems.append(f"{path}: unreadable for weight statistics ({type(e).__name__}: {e})")
            continue
        out.append(WeightSnapshot(step, stats, digests))
    return out


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
            and _is_int(value)
            and value.size
            and 0 <= int(value.min())
            and int(value.max()) < max(tables)
        ):
            return True
    return False


def _is_int(a) -> bool:
    return np.issubdtype(np.asarray(a).dtype, np.integer)


def _perplexity(run: Run, m: Metrics, val_loss: list[tuple[int, float]]) -> Perplexity | None:
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


def _plot_data(run: Run, m: Metrics, val, metric, findings, snapshots, stop: EarlyStop | None) -> PlotData:
    measured = np.flatnonzero(~np.isnan(m.update_ratio).all(axis=1)) if len(m) else np.array([], dtype=int)
    markers = []
    for f in findings:
        if f.kind in ("explosion", "loss_spike", "gradient_explosion", "nonfinite_gradient", "nonfinite_weights"):
            markers += [(s, f.kind, f.severity) for s in f.steps[:50]]
    return PlotData(
        steps=m.step,
        loss=m.loss,
        loss_ema=smooth(m.loss),
        grad_norm=m.grad_norm,
        val_metric=metric,
        val_steps=[s for s, _ in val],
        val_values=[v for _, v in val],
        markers=sorted(set(markers)),
        ratio_steps=m.step[measured],
        ratio=m.update_ratio[measured].T.astype(np.float64) if len(measured) else np.zeros((len(m.param_names), 0)),
        param_names=m.param_names,
        weights=snapshots,
        best_val_step=stop.best_step if stop else None,
    )


# --- helpers -------------------------------------------------------------------------------------------


def _shapes(run: Run) -> dict[str, tuple]:
    return {p["name"]: tuple(p.get("shape", ())) for p in run.manifest.get("parameters", [])}


def _nanmedian(a: np.ndarray) -> float:
    """np.nanmedian without its "All-NaN slice" RuntimeWarning: NaN for an empty or all-NaN slice."""
    a = np.asarray(a)
    a = a[~np.isnan(a)]
    return float(np.median(a)) if len(a) else math.nan


def _nanmedian_cols(a: np.ndarray) -> np.ndarray:
    out = np.full(a.shape[1] if a.ndim == 2 else 0, np.nan)
    for j in range(len(out)):
        col = a[:, j]
        col = col[np.isfinite(col)]
        if len(col):
            out[j] = float(np.median(col))
    return out


def _median_update_ratio(m: Metrics, first_step: int) -> float | None:
    rows = (m.step >= first_step) & ~np.isnan(m.update_ratio).all(axis=1)
    if not rows.any():
        return None
    vals = m.update_ratio[rows].astype(np.float64)
    vals = vals[np.isfinite(vals) & (vals > 0)]
    return float(np.median(vals)) if len(vals) else None


def _few(items: list[str], n: int = 3) -> str:
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more
