"""How `ckptlab diff` ranks tensors: the flags (nonfinite, exploded, jumped, drifted/stalled,
dead, frozen for two checkpoints; nonfinite, extreme, dead for one), their tiers and
thresholds, and the reason each flag writes."""

from __future__ import annotations

import math
import re
import statistics

from ckptlab import dtypes
from ckptlab.analysis.diff.findings import UNFLAGGED, Delta, Side, TensorFinding
from ckptlab.numbers import short_number

# Thresholds. Healthy training changes a weight's norm by percents per thousand steps; the
# explosions this is for are 100x-10000x. Ratios are compared in log10 ("dex").
EXPLODE_GROWTH = 10.0  # ||B||/||A|| or max|B|/max|A|
EXPLODE_SCALE = 10.0  # max|B| over the median max|A| of the model
# "jumped": a matrix that moved by this multiple of its own norm, ||B-A||/||A|| (an explosion
# says more, and wins). Measured on healthy runs, checkpoints 10-1000 steps apart, the largest
# ratio of any matrix: the bundled sample run (AdamW 3e-3) 0.36 from step 4500 to 5000 (1.9 from
# 1000 to 5000), its recipe 1.8 over its first 2000 steps; a 3-layer MLP 2.6 (SGD 0.05 with
# momentum; 2.1 with AdamW 1e-3); a nanoGPT-style GPT (std-0.02 init) 4.1 with AdamW 1e-3 (2.2
# at width 128), 6.5 at 3e-3, 8.2 with SGD 0.3, and at 6e-3 8.6 from step 10 on but 13.5 from
# its step-0 initialisation (no warmup): a diff against the initial weights at a high lr can
# pass this. Matrices only (2+ dims): in the same healthy runs a vector that starts at zero (a
# bias, a LayerNorm shift) moves 13-266x its norm at step 10. A tensor at zero in A (a zero
# bias, LoRA's B) has no finite ratio and is never "jumped".
JUMP_RATIO = 10.0
EXTREME_SCALE = 100.0  # one checkpoint: max|w| over the model's median max|w| ...
EXTREME_FLOOR = 10.0  # ... and at least this (unit-scale weights like LayerNorm gains are fine)
OVERFLOW_SHARE = 0.5  # max|w| past half a 16-bit dtype's largest value: the next step may overflow
OUTLIER_Z = 3.5  # modified z-score (Iglewicz & Hoaglin's cut-off for outliers)
OUTLIER_RATIO = 3.0  # and at least 3x away from the peers' median update ratio
MAD_FLOOR = 0.05  # dex: peers that agree within ~12% must not make 1.5x look significant
MIN_PEERS = 3  # a role needs this many layers to define "normal" (fewer: no outlier test)
FROZEN_PEERS = 0.5  # "frozen" only while at least half of the other tensors changed

TIERS = {"nonfinite": 0, "exploded": 1, "extreme": 1, "jumped": 2, "drifted": 3, "stalled": 3, "dead": 4, "frozen": 5}


def _flag(f: TensorFinding, flag: str, score: float, reason: str) -> None:
    f.flags.insert(len([x for x in f.flags if TIERS.get(x, UNFLAGGED) <= TIERS[flag]]), flag)
    if not (flag in ("drifted", "stalled") and "exploded" in f.flags):  # the explosion already says it
        f.reason = f"{f.reason}; {reason}" if f.reason else reason
    if TIERS[flag] < f.tier:
        f.tier, f.score = TIERS[flag], score


def rank_pairs(findings: list[TensorFinding]) -> None:
    """Flag and score the findings of two checkpoints (each finding's tier, score and reason)."""
    # Integer and bool tensors (position ids, masks, step counters) do not train: they are
    # compared for equality only, and count neither as frozen nor as peers that changed.
    trained = [f for f in findings if dtypes.is_float(f.dtype_a)]
    typical = _typical_absmax(trained)
    changed = sum(1 for f in trained if _after(f)[1].unchanged < 1)
    for f in trained:
        a, (b, d) = f.a, _after(f)
        f.score = d.rel_change if math.isfinite(d.rel_change) else 0.0
        if b.nonfinite > a.nonfinite or (b.nonfinite and a.nonfinite):
            was = "A had none" if not a.nonfinite else f"A had {a.nonfinite}"
            _flag(f, "nonfinite", b.nonfinite - a.nonfinite + b.nonfinite / (b.numel + 1), f"{_counts(b)} ({was})")
        growth = max(
            _finite_or(d.norm_ratio, 0),
            _finite_or(d.absmax_ratio, 0),
            math.inf if a.absmax == 0 and b.absmax > 0 else 0,
        )
        if growth >= EXPLODE_GROWTH and b.absmax >= EXPLODE_SCALE * typical:
            _flag(f, "exploded", math.log10(b.absmax / max(a.absmax, 1e-30)), _growth_reason(a, b, d))
        elif len(f.shape) >= 2 and math.isfinite(d.rel_change) and d.rel_change >= JUMP_RATIO:
            norms = f"||B-A|| = {short_number(d.l2)}, ||A|| = {short_number(a.l2)}"
            _flag(f, "jumped", d.rel_change, f"moved {short_number(d.rel_change, 2)}x its own norm ({norms})")
        if b.numel > 1 and len(f.shape) >= 2 and b.zeros == b.numel and a.zeros < a.numel:
            _flag(f, "dead", b.numel, f"all {b.numel} elements became zero")
        if d.unchanged == 1 and b.numel and changed >= FROZEN_PEERS * max(len(trained) - 1, 1):
            _flag(
                f,
                "frozen",
                b.numel,
                f"unchanged: all {b.numel} elements identical while {changed} of {len(trained)} tensors changed",
            )
    _flag_update_outliers(trained)


def _flag_update_outliers(findings: list[TensorFinding]) -> None:
    """Robust z-score of log10(update ratio) within each role (same name across layers)."""
    groups: dict[str, list[tuple[TensorFinding, Delta]]] = {}
    for f in findings:  # peers are the same parameter in other layers, never other kinds of tensor:
        b, d = _after(f)  # embeddings move ~10x less than matrices
        if b.nonfinite == 0 and math.isfinite(d.rel_change) and d.rel_change > 0:
            groups.setdefault(role(f.name), []).append((f, d))
    for label, members in groups.items():
        if len(members) < MIN_PEERS:
            continue
        logs = [math.log10(d.rel_change) for _, d in members]
        med = statistics.median(logs)
        mad = max(statistics.median(abs(x - med) for x in logs), MAD_FLOOR)
        for (f, d), x in zip(members, logs):
            z = (x - med) / (1.4826 * mad)
            d.update_z, d.peers = round(z, 2), label
            off = abs(x - med)
            if abs(z) >= OUTLIER_Z and off >= math.log10(OUTLIER_RATIO):
                times = 10**off
                more = "more" if z > 0 else "less"
                _flag(
                    f,
                    "drifted" if z > 0 else "stalled",
                    off,
                    f"changed {short_number(times, 2)}x {more} than its {len(members) - 1} peers {label} "
                    f"(||B-A||/||A|| = {short_number(d.rel_change)} vs median {short_number(10**med)})",
                )


def rank_single(findings: list[TensorFinding]) -> None:
    """Flag and score the findings of one checkpoint alone."""
    typical = _typical_absmax(findings)
    for f in findings:
        a = f.a
        ratio = a.absmax / typical if typical > 0 and math.isfinite(a.absmax) else 0.0
        f.score = ratio
        if a.nonfinite:
            _flag(f, "nonfinite", a.nonfinite, _counts(a))
        limit = dtypes.largest(f.dtype_a)
        if math.isfinite(a.absmax) and (
            (ratio >= EXTREME_SCALE and a.absmax >= EXTREME_FLOOR) or (limit and a.absmax >= OVERFLOW_SHARE * limit)
        ):
            why = f"max |w| = {short_number(a.absmax)}, {short_number(ratio, 2)}x the model's median max |w| ({short_number(typical)})"
            if limit and a.absmax >= OVERFLOW_SHARE * limit:
                why += f"; {a.absmax / limit:.0%} of {f.dtype_a}'s largest value"
            _flag(f, "extreme", math.log10(max(ratio, 1e-30)), why)
        if a.numel > 1 and len(f.shape) >= 2 and (a.zeros == a.numel or a.std == 0):
            _flag(
                f,
                "dead",
                a.numel,
                f"all {a.numel} elements are zero"
                if a.zeros == a.numel
                else f"all {a.numel} elements equal {short_number(a.mean)}",
            )


def role(name: str) -> str:
    """The name with its layer index replaced by *: blocks.3.mlp.0.weight -> blocks.*.mlp.0.weight."""
    return re.sub(r"(^|\.)\d+(\.|$)", r"\1*\2", name, count=1)


def _counts(s: Side) -> str:
    parts = [f"{n} {label}" for n, label in ((s.nan, "NaN"), (s.posinf, "+Inf"), (s.neginf, "-Inf")) if n]
    return f"{', '.join(parts)} of {s.numel} elements"


def _growth_reason(a: Side, b: Side, d: Delta) -> str:
    if _finite_or(d.absmax_ratio, math.inf) >= 0.5 * _finite_or(
        d.norm_ratio, 0
    ):  # say max |w| unless the norm says much more
        return f"max |w| grew {short_number(d.absmax_ratio, 2)}x ({short_number(a.absmax)} -> {short_number(b.absmax)})"
    return f"norm grew {short_number(d.norm_ratio, 2)}x ({short_number(a.l2)} -> {short_number(b.l2)})"


def _typical_absmax(findings: list[TensorFinding]) -> float:
    """The model's typical max |A|: the median over the tensors that hold finite values (0.0
    when none does), the yardstick of "exploded" and "extreme"."""
    absmax = [f.a.absmax for f in findings if f.a.numel and math.isfinite(f.a.absmax)]
    return statistics.median(absmax) if absmax else 0.0


def _after(f: TensorFinding) -> tuple[Side, Delta]:
    """B's side and the change B - A, which every finding of two checkpoints has."""
    if f.b is None or f.delta is None:
        raise ValueError(f"{f.name}: not a finding of two checkpoints")
    return f.b, f.delta


def _finite_or(x: float, default: float) -> float:
    return x if math.isfinite(x) else default
