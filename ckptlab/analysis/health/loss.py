"""Detectors on the training loss: its shape, non-finite values, spikes and how fast they
recover, oscillation or divergence, and plateaus. Non-finite losses and spikes are the anomaly
rules of analysis/anomalies.py, so report names the steps the Recorder alarmed on."""

from __future__ import annotations

import math
import warnings

import numpy as np

from ckptlab.analysis.anomalies import nonfinite_loss
from ckptlab.analysis.health.clipping import clip_remedy
from ckptlab.analysis.health.inputs import RunData
from ckptlab.analysis.health.rules import Finding, HealthRules
from ckptlab.analysis.health.samples import nonfinite_data, nonfinite_rows
from ckptlab.analysis.health.series import block_medians, rolling_median
from ckptlab.analysis.spikes import Spike
from ckptlab.run.reader import Metrics


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
    noise = 1.4826 * float(np.median(np.abs(finite - rolling_median(finite, 9))))  # one step's
    stderr = 1.2533 * noise * math.sqrt(1 / k0 + 1 / k1)  # of the difference of the two medians
    if end - start > max(0.1 * abs(start), 3 * stderr):  # (a negative loss rises towards 0)
        return "rising"
    if start - end < 0.1 * abs(start):
        return "flat"
    block = max(1, n // 40)
    blocks = block_medians(finite, block)
    target = start - 0.8 * (start - end)
    reached = int(np.argmax(blocks <= target)) if (blocks <= target).any() else len(blocks)
    return "fast_drop" if reached * block <= n / 4 else "slow_drop"


# --- non-finite loss --------------------------------------------------------------------------------


def loss_explosion(d: RunData, rules: HealthRules) -> list[Finding]:
    """The loss became NaN/Inf (anomalies.nonfinite_loss): an error. When the recorded batch
    that carried it in holds non-finite values (samples.py), the finding is "nonfinite_data"
    and names the rows and sample ids; else "explosion", whose remedy about clipping follows
    what the run records about it (clipping.py)."""
    m = d.m
    bad = np.flatnonzero(nonfinite_loss(m.loss, m.loss_known))
    if len(bad) == 0:
        return []
    i = int(bad[0])
    before = m.loss[max(0, i - 20) : i]
    before = before[np.isfinite(before)]
    rising = len(before) >= 5 and before[-1] > 2 * np.median(before)
    evidence = {
        "first_step": int(m.step[i]),
        "nonfinite_steps": int(len(bad)),
        "loss_before": [float(x) for x in before[-5:]],
        "grad_norm_before": [float(x) for x in m.grad_norm[max(0, i - 5) : i]],
    }
    carried = nonfinite_rows(d, i)
    if carried is not None:
        return [nonfinite_data(d, i, [int(s) for s in m.step[bad]], evidence, *carried)]
    return [
        Finding(
            kind="explosion",
            severity="error",
            title=f"loss became {m.loss[i]} at step {m.step[i]}" + (" after rising sharply" if rising else ""),
            steps=[int(s) for s in m.step[bad[:20]]],
            evidence=evidence,
            remedies=[
                f"find the cause: ckptlab replay --step {int(m.step[i])}",
                "check that batch for bad values: ckptlab dirty",
                clip_remedy(d.clipping),
                "compute softmax/log/loss in float32; add eps to divisions and norms",
            ],
        )
    ]


# --- spikes -----------------------------------------------------------------------------------------


def loss_spikes(d: RunData, rules: HealthRules) -> list[Finding]:
    """The loss spikes (the one spike rule), grouped into episodes: spikes before the loss
    recovered from the first belong to it. Recovered = the loss (median of 3 steps) back within
    10% of the level before the spike."""
    m = d.m
    spikes = d.loss_spikes(rules.loss_spike)
    smooth = _median3(m.loss) if spikes else m.loss
    out, i = [], 0
    while i < len(spikes):
        level = spikes[i][1].median + 0.1 * abs(spikes[i][1].median)  # 10% above, also for a negative loss
        rec = _recovery(smooth, spikes[i][0], level)
        j = i + 1
        while j < len(spikes) and (rec is None or spikes[j][0] <= rec):  # spikes before recovery: same episode
            rec = _recovery(smooth, spikes[j][0], level)
            j += 1
        out.append(_spike_episode(m, spikes[i:j], rec, rules))
        i = j
    return out


def _spike_episode(m: Metrics, episode: list[tuple[int, Spike]], rec: int | None, rules: HealthRules) -> Finding:
    """One episode's finding: its severity from how fast (and whether) the loss recovered."""
    peak_i, peak = max(episode, key=lambda e: e[1].value)
    remaining = len(m.loss) - 1 - episode[-1][0]
    took: int | None = None
    if rec is not None:
        took = int(m.step[rec] - m.step[episode[0][0]])
        speed = "fast" if took <= rules.fast_recovery else "slow"
    else:
        speed = "unknown" if remaining < rules.fast_recovery else "none"
    # Small-batch losses are heavy-tailed: an isolated < 10x spike that recovers fast is
    # normal noise more often than not, so it is information, not an alarm.
    severity = {"fast": "warning" if peak.ratio >= 10 else "info", "slow": "warning", "unknown": "warning"}
    text = {
        "fast": f"recovered in {took} steps",
        "slow": f"recovered slowly, in {took} steps",
        "unknown": "too recent to tell whether it recovers",
        "none": "never recovered",
    }[speed]
    steps = [int(m.step[k]) for k, _ in episode]
    return Finding(
        kind="loss_spike",
        severity=severity.get(speed, "error"),
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


def _median3(loss: np.ndarray) -> np.ndarray:
    """At each step, the median of the finite losses of it and the next two (NaN: none)."""
    finite = np.where(np.isfinite(loss), loss, np.nan)
    windows = np.lib.stride_tricks.sliding_window_view(np.concatenate([finite, [np.nan, np.nan]]), 3)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN windows: NaN, as meant
        return np.nanmedian(windows, axis=1)


def _recovery(smooth: np.ndarray, idx: int, level: float) -> int | None:
    """The first step after `idx` whose `_median3` is back at or under `level`. Searched in
    doubling chunks: a spike usually recovers within a few steps, and a run has 10^6 of them."""
    start, size = idx + 1, 64
    while start < len(smooth):
        hits = np.flatnonzero(smooth[start : start + size] <= level)
        if len(hits):
            return start + int(hits[0])
        start, size = start + size, size * 2
    return None


# --- oscillation, divergence ------------------------------------------------------------------------


def oscillation_or_divergence(d: RunData, rules: HealthRules) -> list[Finding]:
    """A loss that bounces without improving oscillates; one that rises (curve shape "rising")
    and does not oscillate diverges. One finding at most: a rising curve that oscillates is
    the learning rate's overshoot, not a divergence."""
    return _oscillation(d.m, rules) or _rising(d.m)


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
    resid = logl - rolling_median(logl, 9)
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


def _median_update_ratio(m: Metrics, first_step: int) -> float | None:
    have, ratios = m.measured("update_ratio")
    rows = (m.step[have] >= first_step) & ~np.isnan(ratios).all(axis=1)
    if not rows.any():
        return None
    vals = ratios[rows].astype(np.float64)
    vals = vals[np.isfinite(vals) & (vals > 0)]
    return float(np.median(vals)) if len(vals) else None


def _rising(m: Metrics) -> list[Finding]:
    if curve_shape(m.loss) != "rising":
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


# --- plateaus ---------------------------------------------------------------------------------------


def plateau(d: RunData, rules: HealthRules) -> list[Finding]:
    """A long flat stretch that training later left by falling well below it (`_plateau_window`)."""
    m = d.m
    finite = np.isfinite(m.loss) & (m.loss > 0)
    if finite.sum() < 40:
        return []
    idx = np.flatnonzero(finite)
    logl = np.log(m.loss[idx])
    block = max(5, len(logl) // 40)
    found = _plateau_window(logl, block, rules)
    if found is None:
        return []
    lo, hi, level, fall, band = found
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


def _plateau_window(logl: np.ndarray, block: int, rules: HealthRules) -> tuple | None:
    """(first block, last block, level, fall, band) of the longest plateau, on block medians of
    the log-loss (so minibatch noise does not break a plateau into pieces). A window counts
    when its blocks stay within a band (+-7.5%, widened to 4 block-noise sigmas on noisy
    curves), it spans >= 20% of the run, and the equally long stretch after it sits lower by at
    least the most of: 26%, twice the band, a quarter of the whole run's (log) drop -- and 4x
    more than the loss fell inside the window. Those keep a converged tail, a noisy phase and a
    steady slow drop from counting."""
    blocks = block_medians(logl, block)
    noise = 1.4826 * float(np.median(np.abs(logl - rolling_median(logl, 9))))
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
            best = (lo, hi, level, fall, band)
    return best
