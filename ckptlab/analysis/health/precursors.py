"""Precursors: a parameter whose gradient norm or update spiked some steps *before* the loss
did. A poisoned update (one corrupt sample's gradient, an optimizer's first update with an
empty second moment) can leave a weight primed while the loss still looks normal; the loss
spikes, or goes non-finite, a few steps later on an ordinary batch. The symptom's step is then
not the cause's, and the report says where to look:

    "emb.weight's gradient spiked 4.1e+03x at step 37, 5 steps before the loss spiked at step 42"
    "side.weight got its first non-zero gradient at step 37 (exactly 0 before), 1 step before ..."

For each loss event (the first step of a loss-spike episode, and the first non-finite loss),
every parameter's per-step gradient norm (before clipping) and its update ratio (where the
run measured it, every `health_every` steps) are compared, over the `precursor_window` steps
before the event, with their own median over those steps and the ones before them (a median:
one spike does not move it). A value clears the bar when it is at least `precursor_ratio` x
its median and a robust z of at least the loss rule's z above it. The largest such value names
the finding (a parameter whose gradient was exactly zero and is not -- a branch switched on, a
token first seen -- comes first: Adam's first update of it is a sign-like step of `lr` per
element, whatever its size); a spike at the event's own step is the event, not a precursor.
"""

from __future__ import annotations

import numpy as np

from ckptlab.analysis.anomalies import nonfinite_loss
from ckptlab.analysis.health.inputs import RunData
from ckptlab.analysis.health.rules import Finding, HealthRules
from ckptlab.run.reader import Metrics

BASELINE = 100  # rows before the window that also make each parameter's median
MIN_BASELINE = 8  # finite values a median needs to say anything
MAX_EVENTS = 5  # loss events looked behind (the first ones: later ones are often aftermath)


def precursors(d: RunData, rules: HealthRules) -> list[Finding]:
    m = d.m
    out = []
    for i, what in loss_events(d, rules)[:MAX_EVENTS]:
        found = _spikes_before(m, i, rules)
        if found:
            out.append(_finding(m, i, what, found, d.run.checkpoints))
    return out


def loss_events(d: RunData, rules: HealthRules) -> list[tuple[int, str]]:
    """(row, "spiked" | "went non-finite"): the first spike of each episode (spikes closer than
    the window to the one before belong to it) and the first non-finite loss, in step order."""
    m = d.m
    events: list[tuple[int, str]] = []
    last = -(10**9)
    for k, _ in d.loss_spikes(rules.loss_spike):
        if k - last > rules.precursor_window:
            events.append((k, "spiked"))
        last = k
    bad = np.flatnonzero(nonfinite_loss(m.loss, m.loss_known))
    if len(bad):
        events.append((int(bad[0]), "went non-finite"))
    events.sort()
    # An event inside the window after another looks behind into the first one's aftermath.
    kept: list[tuple[int, str]] = []
    for k, what in events:
        if not kept or k - kept[-1][0] > rules.precursor_window:
            kept.append((k, what))
    return kept


def series(m: Metrics, rows: slice = slice(None)) -> list[tuple[str, np.ndarray]]:
    """(what, values[rows, params]) with NaN where not measured: gradient norms (-1 = none)
    and the update ratios of steps that stepped."""
    g = m.param_grad_norm[rows]
    grads = np.where(g < 0, np.nan, g.astype(np.float64))
    updates = np.where(m.stepped[rows, None], m.per_param("update_ratio", rows).astype(np.float64), np.nan)
    return [("gradient", grads), ("update", updates)]


def _spikes_before(m: Metrics, i: int, rules: HealthRules) -> list[dict]:
    """The spikes of any parameter's gradient norm or update in the window before row `i`,
    largest ratio first. (On the rows `spikes_before` reads only: the window and the baseline
    before it.)"""
    base = max(0, i - rules.precursor_window - BASELINE)
    return spikes_before(m.step[base:], m.param_names, series(m, slice(base, i)), i - base, rules)


def spikes_before(
    steps, names: list[str], series: list[tuple[str, np.ndarray]], i: int, rules: HealthRules
) -> list[dict]:
    """`_spikes_before` on plain arrays: `steps[rows]`, `series` as `series` makes them
    (the Recorder's live alert keeps the recent rows: record/health.py)."""
    lo = max(0, i - rules.precursor_window)
    base = max(0, lo - BASELINE)
    found = []
    for what, values in series:
        window = values[base:i]
        finite = np.where(np.isfinite(window), window, np.nan)
        enough = np.isfinite(finite).sum(0) >= MIN_BASELINE
        if not enough.any():
            continue
        cols = np.flatnonzero(enough)
        med = np.nanmedian(finite[:, cols], axis=0)
        mad = np.nanmedian(np.abs(finite[:, cols] - med), axis=0)
        scale = 1.4826 * np.maximum(mad, np.maximum(1e-3 * np.abs(med), 1e-12))
        recent = finite[lo - base :, cols]
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = recent / np.where(med > 0, med, np.nan)
            z = (recent - med) / scale
        # Against the past only: the first updates of a run (Adam's are all sign-like) are the
        # start of training, not a precursor.
        seen = np.cumsum(np.isfinite(finite[:, cols]), axis=0)[lo - base :] - np.isfinite(recent)
        hit = (ratio >= rules.precursor_ratio) & (z >= rules.loss_spike.z) & (seen >= MIN_BASELINE)
        # A gradient that was exactly zero (a branch switched off, a token never seen) and is
        # not: the first real gradient, whatever its size (Adam's first update follows).
        first = _first_nonzero(finite)[lo - base :, cols] if what == "gradient" else np.zeros_like(hit)
        for r, c in zip(*np.nonzero(hit | first)):
            found.append(
                {
                    "param": names[cols[c]],
                    "what": "first non-zero gradient" if first[r, c] else what,
                    "step": int(steps[lo + r]),
                    "ratio": float("inf") if first[r, c] else float(ratio[r, c]),
                    "value": float(recent[r, c]),
                    "median": float(med[c]),
                }
            )
    found.sort(key=lambda f: (-f["ratio"], f["step"]))
    return found


def _first_nonzero(values: np.ndarray) -> np.ndarray:
    """True where a column's value is the first non-zero one, after at least MIN_BASELINE
    values that were exactly zero (not measured = NaN is skipped)."""
    nonzero = np.nan_to_num(values, nan=0.0) != 0
    before = np.cumsum(nonzero, axis=0) - nonzero  # non-zero values before each row
    zeros_before = np.cumsum(values == 0, axis=0) - (values == 0)
    return nonzero & (before == 0) & (zeros_before >= MIN_BASELINE)


def _plain(spike: dict) -> dict:
    """A spike for the evidence: a first non-zero gradient has no ratio (null), as in the
    Recorder's live event."""
    return {**spike, "ratio": spike["ratio"] if np.isfinite(spike["ratio"]) else None}


def describe(top: dict) -> str:
    """'side.weight got its first non-zero gradient at step 37 (exactly 0 before)', or
    "emb.weight's gradient spiked 4.1e+03x at step 37"."""
    if top["what"] == "first non-zero gradient":
        return f"{top['param']} got its first non-zero gradient at step {top['step']} (exactly 0 before)"
    return f"{top['param']}'s {top['what']} spiked {top['ratio']:.3g}x at step {top['step']}"


def _finding(m: Metrics, i: int, what: str, found: list[dict], checkpoints: list[int]) -> Finding:
    top, step = found[0], int(m.step[i])
    # A replay that runs the precursor's step starts at a checkpoint at or before it.
    start = max((c for c in checkpoints if c <= top["step"]), default=None)
    replay = f"ckptlab replay --step {step}" + (f" --from-step {start}" if start is not None else "")
    lead = step - top["step"]
    params = list(dict.fromkeys(f["param"] for f in found))
    when = f"{lead} step{'s' if lead != 1 else ''} before the loss {what} at step {step}"
    title = f"{describe(top)}, {when}"
    return Finding(
        kind="precursor",
        severity="warning",
        title=title,
        steps=sorted({f["step"] for f in found})[:20] + [step],
        evidence={"loss_step": step, "loss": what, "spikes": [_plain(f) for f in found[:10]]},
        params=params,
        remedies=[
            f"the cause may lie at step {top['step']}, not {step}: replay both from before it: {replay}"
            + ("" if start is not None else f" (no checkpoint at or before step {top['step']} is retained)"),
            f"look at step {top['step']}'s batch for a corrupt sample: ckptlab dirty",
            "an update spike on a parameter's first real gradient (Adam's empty second moment): warm up the "
            "learning rate, or raise eps",
        ],
    )
