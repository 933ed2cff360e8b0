"""Detectors on the weights and their updates: update explosions and non-finite weights (the
anomaly rules of analysis/anomalies.py, so report names the steps the Recorder alarmed on),
weight norms that grew out of scale, and value distributions that drifted between checkpoints."""

from __future__ import annotations

import math

import numpy as np

from ckptlab.analysis.anomalies import UPDATE_EXPLOSION, nonfinite_weight
from ckptlab.analysis.health.clipping import clip_remedy
from ckptlab.analysis.health.inputs import RunData
from ckptlab.analysis.health.rules import Finding, HealthRules, few
from ckptlab.analysis.health.snapshots import WeightSnapshot


def update_explosion(d: RunData, rules: HealthRules) -> list[Finding]:
    """Steps whose update moved the weights by more than UPDATE_EXPLOSION of their norm
    (anomalies.update_exploded, on the recorded global update ratio). Information: the Recorder
    alarms on each, but alone one is seldom the problem (a run's first updates can move a small
    init that much); what it does to the run -- a loss spike, non-finite weights, update ratios
    above the band -- is found by those detectors, with their severity."""
    m = d.m
    ratios = m.field("update_ratio_global")  # NaN: not measured
    with np.errstate(invalid="ignore"):
        exploded = [(int(i), float(ratios[i])) for i in np.flatnonzero(ratios > UPDATE_EXPLOSION)]
    if not exploded:
        return []
    bad = [i for i, _ in exploded]
    worst, worst_ratio = max(exploded, key=lambda ir: ir[1])
    return [
        Finding(
            kind="update_explosion",
            severity="info",
            title=f"an update moved the weights by more than {UPDATE_EXPLOSION:g} of their norm at {len(bad)} step(s), first {int(m.step[bad[0]])}",
            steps=[int(m.step[i]) for i in bad[:50]],
            evidence={"max": float(worst_ratio), "max_step": int(m.step[worst]), "threshold": UPDATE_EXPLOSION},
            remedies=[
                f"find the cause: ckptlab replay --step {int(m.step[bad[0]])}",
                clip_remedy(d.clipping),
            ],
        )
    ]


def nonfinite_weights(d: RunData, rules: HealthRules) -> list[Finding]:
    """Steps whose measured weight norms were non-finite (anomalies.nonfinite_weight), and
    checkpoint tensors with NaN/Inf."""
    m, measured = d.m, d.weights_measured
    wn = m.per_param("weight_norm", measured).astype(np.float64)
    bad_rows = measured[nonfinite_weight(wn) > 0] if len(wn) else measured
    bad_cols = np.flatnonzero((~np.isfinite(wn)).any(axis=0)) if len(wn) else np.array([], dtype=int)
    ckpt_bad = sorted({(s.step, n) for s in d.snapshots for n, st in s.stats.items() if st.nonfinite})
    if not len(bad_rows) and not ckpt_bad:
        return []
    steps = sorted({int(m.step[i]) for i in bad_rows} | {s for s, _ in ckpt_bad})
    params = sorted({m.param_names[j] for j in bad_cols} | {n for _, n in ckpt_bad})
    return [
        Finding(
            kind="nonfinite_weights",
            severity="error",
            title=f"weights became non-finite ({few(params)}), first seen at step {steps[0]}",
            steps=steps[:50],
            evidence={"checkpoints": [{"step": s, "tensor": n} for s, n in ckpt_bad[:20]]},
            params=params,
            remedies=[
                "roll back to a healthy checkpoint: ckptlab rollback --before-anomaly",
                f"find the cause: ckptlab replay --step {steps[0]}",
            ],
        )
    ]


def exploding_weights(d: RunData, rules: HealthRules) -> list[Finding]:
    """Weight matrices whose norm grew >= `weight_growth`x between the first and last
    measurement (biases and norm gains start near 0 or 1: growth is normal for them), measured
    from at least `_growth_floor`."""
    m, measured, shapes, names = d.m, d.weights_measured, d.shapes, d.m.param_names
    if len(measured) < 2:
        return []
    wn = m.per_param("weight_norm", measured).astype(np.float64)
    mats = [j for j, name in enumerate(names) if len(shapes.get(name, ())) >= 2]
    cols = {j: wn[:, j][np.isfinite(wn[:, j])] for j in mats}
    numel = {j: max(1, math.prod(shapes[names[j]])) for j in mats}
    rms = {j: float(cols[j][0]) / math.sqrt(numel[j]) for j in mats if len(cols[j])}
    grown = {}
    for j in mats:
        col = cols[j]
        if len(col) < 2:
            continue
        base = max(float(col[0]), _growth_floor(j, d, numel, rms, rules))
        if base > 0 and col[-1] / base >= rules.weight_growth:
            grown[names[j]] = float(col[-1] / base)
    if not grown:
        return []
    return [
        Finding(
            kind="exploding_weights",
            severity="warning",
            title=f"weight norms grew up to {max(grown.values()):.3g}x: {few(sorted(grown, key=grown.__getitem__, reverse=True))}",
            steps=[int(m.step[measured[0]]), int(m.step[measured[-1]])],
            evidence={"growth": grown},
            params=sorted(grown),
            remedies=["add or raise weight decay", "lower the learning rate", "check for a missing normalization"],
        )
    ]


def _growth_floor(j: int, d: RunData, numel: dict, rms: dict, rules: HealthRules) -> float:
    """The least norm weight growth is measured from: `weight_growth_floor` x the median per-element
    RMS of the other weight matrices (at their first measurement) x sqrt(numel) -- a matrix that
    starts at zero (LoRA B, adaLN-Zero, a zero-init output layer) has a first norm of about
    lr x sqrt(numel) after one update, and growing to its neighbours' scale is learning, not an
    explosion. With no other matrix: the norm of PyTorch's default init, U(+-1/sqrt(fan_in))."""
    others = [v for k, v in rms.items() if k != j and math.isfinite(v) and v > 0]
    if others:
        ref = float(np.median(others))
    else:
        fan_in = max(1, numel[j] // max(1, d.shapes[d.m.param_names[j]][0]))
        ref = 1 / math.sqrt(3 * fan_in)
    return rules.weight_growth_floor * ref * math.sqrt(numel[j])


def weight_drift(d: RunData, rules: HealthRules) -> list[Finding]:
    """How far each tensor's value distribution moved between the first and last checkpoint:
    total variation distance of the fixed log-scale histograms (0 same .. 1 disjoint) and the
    ratio of standard deviations. Weights are meant to move, so this is information unless a
    distribution changed scale by 10x or more."""
    if len(d.snapshots) < 2:
        return []
    a, b = d.snapshots[0], d.snapshots[-1]
    rows = _distribution_changes(a, b)
    moved = {
        n: r
        for n, r in rows.items()
        if r["tv_distance"] >= 0.5 or (math.isfinite(r["std_ratio"]) and not 1 / 3 <= r["std_ratio"] <= 3)
    }
    if not moved:
        return []
    extreme = [n for n, r in moved.items() if math.isfinite(r["std_ratio"]) and not 0.1 <= r["std_ratio"] <= 10]
    order = sorted(moved, key=lambda n: -moved[n]["tv_distance"])
    return [
        Finding(
            kind="weight_drift",
            severity="warning" if extreme else "info",
            title=f"{len(moved)} tensor(s) changed distribution a lot between checkpoints {a.step} and {b.step}: {few(order)}",
            steps=[a.step, b.step],
            evidence={n: moved[n] for n in order[:20]},
            params=sorted(moved),
            remedies=[
                "expected early in training; late in training it can mean instability or a too-high LR",
                f"compare them: ckptlab diff RUN@{a.step} RUN@{b.step}",
            ],
        )
    ]


def _distribution_changes(a: WeightSnapshot, b: WeightSnapshot) -> dict[str, dict]:
    rows = {}
    for name, sa in a.stats.items():
        sb = b.stats.get(name)
        if sb is None or sa.numel < 64 or sa.hist.sum() == 0 or sb.hist.sum() == 0:  # tiny tensors: no distribution
            continue
        tv = 0.5 * float(np.abs(sa.hist / sa.hist.sum() - sb.hist / sb.hist.sum()).sum())
        scale = sb.std / sa.std if sa.std > 0 and math.isfinite(sb.std) else math.nan
        rows[name] = {"tv_distance": tv, "std_ratio": scale, "mean_from": sa.mean, "mean_to": sb.mean}
    return rows
