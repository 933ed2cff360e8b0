"""`diff`: what changed between two checkpoints, and which parameter explains a fault.

    findings = ckptlab.diff("runs/exp1@5000", "runs/exp1@5400")   # files, folders, RUN@STEP, dicts
    findings.verdict        # Verdict(parameter, module, reason), or None when nothing is wrong
    findings.ranked[0]      # the most suspicious tensor: flags, reason, stats of A, B and B - A
    ckptlab.diff("model.safetensors")                            # one checkpoint alone: its health

Tensors are matched by name after removing wrapper prefixes (`module.` from DDP, `_orig_mod.`
from torch.compile, or a prefix one whole side shares, e.g. Lightning's `model.`), compared one
pair at a time as they stream from disk, then ranked:

  tier  flag                when
  0     nonfinite           B holds NaN/Inf (more than A did)
  1     exploded            ||B|| or max|B| grew >= 10x over A, and max|B| is >= 10x the
                            model's typical max|A| (a zero-initialised bias that learns is not
                            an explosion)
  2     drifted / stalled   the update ratio ||B-A||/||A|| is an outlier among parameters of
                            the same role across >= 3 layers (blocks.*.mlp.fc.weight): robust
                            z-score >= 3.5 and >= 3x off their median
  3     dead                a matrix that became all zeros
  4     frozen              B == A bit for bit while most of the model changed
A checkpoint alone is ranked by: nonfinite, extreme (max |w| >= 100x the model's typical and
>= 10, or near its dtype's overflow), dead (an all-zero or constant matrix).
Within a tier the bigger effect ranks higher; unflagged tensors follow, most changed first.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ckptlab import dtypes, stats
from ckptlab.errors import CkptlabError
from ckptlab.io import LazyStateDict, open_checkpoint
from ckptlab.io.stream import Job, default_workers, stream
from ckptlab.jsonable import NOT_IN_JSON
from ckptlab.numbers import short_number

# Thresholds. Healthy training changes a weight's norm by percents per thousand steps; the
# explosions this is for are 100x-10000x. Ratios are compared in log10 ("dex").
EXPLODE_GROWTH = 10.0  # ||B||/||A|| or max|B|/max|A|
EXPLODE_SCALE = 10.0  # max|B| over the median max|A| of the model
EXTREME_SCALE = 100.0  # one checkpoint: max|w| over the model's median max|w| ...
EXTREME_FLOOR = 10.0  # ... and at least this (unit-scale weights like LayerNorm gains are fine)
OVERFLOW_SHARE = 0.5  # max|w| past half a 16-bit dtype's largest value: the next step may overflow
OUTLIER_Z = 3.5  # modified z-score (Iglewicz & Hoaglin's cut-off for outliers)
OUTLIER_RATIO = 3.0  # and at least 3x away from the peers' median update ratio
MAD_FLOOR = 0.05  # dex: peers that agree within ~12% must not make 1.5x look significant
MIN_PEERS = 3  # a role needs this many layers to define "normal" (fewer: no outlier test)
FROZEN_PEERS = 0.5  # "frozen" only while at least half of the other tensors changed

TIERS = {"nonfinite": 0, "exploded": 1, "extreme": 1, "drifted": 2, "stalled": 2, "dead": 3, "frozen": 4}
UNFLAGGED = 9
QUANTILE_KEYS = tuple(f"p{q * 100:g}" for q in stats.QUANTILES)  # p0.1, p1, ..., p99.9


@dataclass
class Verdict:
    parameter: str
    module: str
    reason: str


@dataclass
class Side:
    """One tensor's statistics in one checkpoint (finite elements for moments and extremes)."""

    numel: int
    nan: int
    posinf: int
    neginf: int
    zeros: int
    mean: float
    std: float
    min: float
    max: float
    absmax: float
    l2: float
    quantiles: dict[str, float]

    @classmethod
    def of(cls, s: stats.TensorStats) -> Side:
        return cls(
            s.numel,
            s.nan,
            s.posinf,
            s.neginf,
            s.zeros,
            s.mean,
            s.std,
            s.min,
            s.max,
            s.absmax,
            s.l2,
            dict(zip(QUANTILE_KEYS, s.quantiles)),
        )

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf


@dataclass
class Delta:
    """How B differs from A (element pairs finite on both sides)."""

    l2: float  # ||B - A||
    rel_change: float  # ||B - A|| / ||A||: the update ratio
    norm_ratio: float  # ||B|| / ||A||
    absmax_ratio: float  # max|B| / max|A|
    cosine: float
    unchanged: float  # share of elements with B == A
    max_change: float  # the largest |B - A| ...
    max_index: list[int] | None  # ... where (an index into the tensor) ...
    max_a: float  # ... and what it was and became
    max_b: float
    w1: float  # Wasserstein-1 distance between the value distributions of A and B
    update_z: float | None = None  # robust z-score of log10(rel_change) among peers
    peers: str | None = None  # the role whose tensors were the peers, e.g. "blocks.*.attn.weight"


@dataclass
class TensorFinding:
    name: str
    module: str
    flags: list[str]
    reason: str | None
    shape: list[int]
    dtype_a: str
    dtype_b: str | None
    tied: list[str]  # other names for the same tensor (tied weights)
    a: Side
    b: Side | None
    delta: Delta | None
    # Working values for ranking and the terminal/plot renderers, not part of the JSON:
    hist_a: np.ndarray | None = field(default=None, repr=False, metadata=NOT_IN_JSON)  # HIST_EDGES counts
    hist_b: np.ndarray | None = field(default=None, repr=False, metadata=NOT_IN_JSON)
    tier: int = field(default=UNFLAGGED, metadata=NOT_IN_JSON)
    score: float = field(default=0.0, metadata=NOT_IN_JSON)
    order: int = field(default=0, metadata=NOT_IN_JSON)  # position in checkpoint A (tables list tensors in model order)


@dataclass
class Mismatch:
    name: str
    shape_a: list[int]
    shape_b: list[int]
    dtype_a: str
    dtype_b: str


@dataclass
class DiffFindings:
    a: str
    b: str | None
    verdict: Verdict | None
    ranked: list[TensorFinding]
    missing: list[str]  # in A, not in B
    unexpected: list[str]  # in B, not in A
    mismatched: list[Mismatch]  # in both, shapes differ: not compared
    skipped: list[dict]  # tensors that could not be read (unsupported dtype...)
    notes: list[str]
    summary: dict

    def finding(self, name: str) -> TensorFinding | None:
        for f in self.ranked:
            if f.name == name or name in f.tied:
                return f
        return None


def diff(
    a,
    b=None,
    *,
    select: str | re.Pattern | None = None,
    sequential: bool = False,
    verify: bool = True,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
    processes: bool | None = None,
) -> DiffFindings:
    """Compare checkpoint `a` with `b` (or, with b=None, check the health of `a` alone).

    a, b: paths, folders, "RUN@STEP", run directories, state dicts or LazyStateDicts.
    select: only tensors whose (aligned) name matches this regex (re.search).
    sequential: plain reads instead of mmap (for network filesystems).
    verify: check run checkpoints against their recorded sha256 first.
    workers: threads or processes (default: the cores available, at most 8).
    progress: called with the number of bytes done after each piece.
    processes: None (default) forks worker processes for a large diff of files on Linux
        (ckptlab/io/stream.py says when); False keeps to threads (so does CKPTLAB_PROCESSES=0).
    """
    pattern = re.compile(select) if isinstance(select, str) else select
    sd_a = open_checkpoint(a, sequential=sequential, verify=verify)
    sd_b = open_checkpoint(b, sequential=sequential, verify=verify) if b is not None else None
    try:
        return _diff(sd_a, sd_b, pattern, workers or default_workers(), progress, sequential, processes)
    finally:
        for sd, given in ((sd_a, a), (sd_b, b)):
            if sd is not None and sd is not given:
                sd.close()


def _diff(
    sd_a: LazyStateDict, sd_b: LazyStateDict | None, pattern, workers, progress, sequential, processes=None
) -> DiffFindings:
    started = time.perf_counter()
    plan = align(sd_a, sd_b, pattern) if sd_b is not None else _single_plan(sd_a, pattern)
    skipped = [
        {"name": n, "side": side, "reason": r}
        for side, sd in (("a", sd_a), ("b", sd_b))
        if sd
        for n, r in sd.skipped.items()
    ]
    skipped += _drop_unsupported(plan, sd_a, sd_b)
    if not plan.pairs:
        raise CkptlabError(_nothing_to_compare(sd_a, sd_b, plan, pattern))
    jobs = [_job(p, sd_a, sd_b) for p in plan.pairs]
    results = _stream_in_file_order(jobs, workers, progress, processes)  # TensorStats / PairStats
    findings = [_finding(p, r, sd_a, sd_b) for p, r in zip(plan.pairs, results)]
    for i, f in enumerate(findings):
        f.order = i
    (_rank_pairs if sd_b is not None else _rank_single)(findings)
    findings.sort(key=lambda f: (f.tier, -f.score))
    top = findings[0] if findings[0].tier < UNFLAGGED else None
    nbytes = sum(j.a.nbytes + (j.b.nbytes if j.b is not None else 0) for j in jobs)
    seconds = time.perf_counter() - started
    return DiffFindings(
        a=sd_a.label,
        b=sd_b.label if sd_b else None,
        verdict=Verdict(top.name, top.module, top.reason) if top else None,
        ranked=findings,
        missing=plan.missing,
        unexpected=plan.unexpected,
        mismatched=plan.mismatched,
        skipped=skipped,
        notes=[f"A: {n}" for n in sd_a.notes] + [f"B: {n}" for n in (sd_b.notes if sd_b else [])] + plan.notes,
        summary={
            "compared": len(findings),
            "flagged": sum(1 for f in findings if f.tier < UNFLAGGED),
            "elements": sum(j.a.numel for j in jobs),
            "bytes": nbytes,
            "seconds": round(seconds, 3),
            "gb_per_s": round(nbytes / seconds / 1e9, 3) if seconds > 0 else None,
            "format_a": sd_a.format,
            "format_b": sd_b.format if sd_b else None,
            "workers": workers,
            "read": "sequential" if sequential else "mmap",
        },
    )


def _drop_unsupported(plan: Plan, sd_a, sd_b) -> list[dict]:
    """Complex, quantized and packed 4-bit tensors have no statistics here: listed as skipped."""
    keep, skipped = [], []
    for p in plan.pairs:
        sides = [("a", sd_a.info(p.name_a))] + ([("b", sd_b.info(p.name_b))] if sd_b is not None else [])
        bad = [(side, ref.dtype) for side, ref in sides if not stats.supported(ref.dtype)]
        skipped += [
            {"name": p.name, "side": side, "reason": f"dtype {_dt(dtype)} is not supported"} for side, dtype in bad
        ]
        if not bad:
            keep.append(p)
    plan.pairs = keep
    return skipped


def _job(p: Pair, sd_a: LazyStateDict, sd_b: LazyStateDict | None) -> Job:
    ra = sd_a.info(p.name_a)
    if sd_b is None:
        return Job(ra, None, lambda: stats.StatsAccumulator(ra.dtype), finish=stats.StatsAccumulator.result)
    rb = sd_b.info(p.name_b)
    return Job(ra, rb, lambda: stats.PairAccumulator(ra.dtype, rb.dtype), finish=stats.PairAccumulator.result)


def _stream_in_file_order(jobs: list[Job], workers: int, progress, processes=None) -> list:
    """Stream the jobs in the order A stores them (each file read front to back); results in
    the jobs' order."""
    order = sorted(range(len(jobs)), key=lambda i: _storage_order(jobs[i].a))
    results = stream([jobs[i] for i in order], workers=workers, progress=progress, processes=processes)
    return [r for _, r in sorted(zip(order, results), key=lambda x: x[0])]


def _storage_order(ref) -> tuple:
    file = getattr(ref, "file", None)
    return (0, str(file.path), ref.offset) if file is not None else (1, "", 0)


# --- matching names ------------------------------------------------------------------------------


@dataclass
class Pair:
    name: str  # the aligned name shown to the user
    name_a: str  # as stored in A / in B
    name_b: str
    tied: list[str]


@dataclass
class Plan:
    pairs: list[Pair]
    missing: list[str]
    unexpected: list[str]
    mismatched: list[Mismatch]
    notes: list[str]


def canonical(name: str) -> str:
    """The name without wrapper components: `module.` in front, `_orig_mod.` anywhere."""
    parts = [p for p in name.split(".") if p != "_orig_mod"]
    while len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def _names(sd: LazyStateDict, strip: str = "") -> dict[str, str]:
    """aligned name -> stored (or alias) name; first one wins if two collapse to one name."""
    out: dict[str, str] = {}
    for name in sd:
        c = canonical(name)
        if strip and c.startswith(strip):
            c = c[len(strip) :]
        out.setdefault(c, name)
    return out


def _shared_first(names) -> str:
    """The first dotted component every name shares ("model." for Lightning), else ""."""
    firsts = {n.split(".", 1)[0] for n in names if "." in n}
    if len(firsts) == 1 and all("." in n for n in names):
        return firsts.pop() + "."
    return ""


def align(sd_a: LazyStateDict, sd_b: LazyStateDict, pattern=None) -> Plan:
    """Match A's tensors with B's: names, prefixes, tied weights, shapes."""
    na, nb = _names(sd_a), _names(sd_b)
    notes = []
    wrapped = [side for side, sd in (("A", sd_a), ("B", sd_b)) if any(canonical(n) != n for n in sd)]
    if wrapped:
        notes.append(f"aligned names: removed module./_orig_mod. wrappers from {' and '.join(wrapped)}")
    best = (len(na.keys() & nb.keys()), na, nb, None)
    for side, sd in (("A", sd_a), ("B", sd_b)):
        prefix = _shared_first(_names(sd))
        if prefix:
            ta = _names(sd_a, prefix) if side == "A" else na
            tb = _names(sd_b, prefix) if side == "B" else nb
            if len(ta.keys() & tb.keys()) > best[0]:
                best = (
                    len(ta.keys() & tb.keys()),
                    ta,
                    tb,
                    f"aligned names: removed the prefix {prefix!r} that all of {side}'s names share",
                )
    _, na, nb, note = best
    if note:
        notes.append(note)
    if pattern is not None:
        na = {k: v for k, v in na.items() if pattern.search(k)}
        nb = {k: v for k, v in nb.items() if pattern.search(k)}

    pairs: dict[tuple, Pair] = {}
    mismatched: list[Mismatch] = []
    for name, stored_a in na.items():
        if name not in nb:
            continue
        ra, rb = sd_a.info(stored_a), sd_b.info(nb[name])
        if ra.shape != rb.shape:
            mismatched.append(Mismatch(name, list(ra.shape), list(rb.shape), _dt(ra.dtype), _dt(rb.dtype)))
            continue
        key = (ra.identity, rb.identity)  # tied on both sides: one comparison, several names
        if key in pairs:
            pairs[key].tied.append(name)
        else:
            pairs[key] = Pair(name, stored_a, nb[name], [])
    for p in pairs.values():  # show the stored name, the tied ones as aliases
        names = [p.name, *p.tied]
        stored = [n for n in names if na[n] in sd_a.refs]
        if stored and stored[0] != p.name:
            p.name = stored[0]
            p.tied = [n for n in names if n != p.name]

    for p in pairs.values():  # names tied on one side only (the other side dropped them)
        for sd, names, stored in ((sd_a, na, p.name_a), (sd_b, nb, p.name_b)):
            p.tied += [n for n, s in names.items() if sd.aliases.get(s) == stored and n != p.name and n not in p.tied]
    covered = {n for p in pairs.values() for n in (p.name, *p.tied)}
    missing = [n for n, s in na.items() if n not in nb and not _tied_elsewhere(sd_a, s, covered, na)]
    unexpected = [n for n, s in nb.items() if n not in na and not _tied_elsewhere(sd_b, s, covered, nb)]
    return Plan(list(pairs.values()), missing, unexpected, mismatched, notes)


def _tied_elsewhere(sd: LazyStateDict, stored: str, covered: set[str], names: dict[str, str]) -> bool:
    """A tied name (an alias) whose data is compared under its other name is not missing:
    Hugging Face files drop `lm_head.weight` when it is `embed_tokens.weight`."""
    target = sd.aliases.get(stored)
    return target is not None and any(names.get(c) == target for c in covered)


def _single_plan(sd: LazyStateDict, pattern) -> Plan:
    names = _names(sd)
    pairs: dict[object, Pair] = {}
    for name, stored in names.items():
        if pattern is not None and not pattern.search(name):
            continue
        key = sd.info(stored).identity
        if key in pairs:
            pairs[key].tied.append(name)
        else:
            pairs[key] = Pair(name, stored, stored, [])
    return Plan(list(pairs.values()), [], [], [], [])


def _nothing_to_compare(sd_a, sd_b, plan: Plan, pattern) -> str:
    if pattern is not None:
        return f"--select {pattern.pattern!r} matches no tensor" + (" present in both checkpoints" if sd_b else "")
    if sd_b is None:
        return f"{sd_a.label}: holds no tensors to check"
    if plan.mismatched:
        m = plan.mismatched[0]
        return (
            f"{sd_a.label} and {sd_b.label} share names but no tensor of the same shape "
            f"(e.g. {m.name}: {m.shape_a} vs {m.shape_b}): different architectures?"
        )
    ea, eb = next(iter(sd_a), "nothing"), next(iter(sd_b), "nothing")
    return (
        f"{sd_a.label} and {sd_b.label} share no tensor names (A has {len(sd_a)} like {ea!r}, "
        f"B has {len(sd_b)} like {eb!r}): unrelated checkpoints?"
    )


# --- one finding per tensor -----------------------------------------------------------------------


def _finding(p: Pair, r, sd_a: LazyStateDict, sd_b: LazyStateDict | None) -> TensorFinding:
    ra = sd_a.info(p.name_a)
    common = dict(
        name=p.name,
        module=p.name.rpartition(".")[0],
        flags=[],
        reason=None,
        shape=list(ra.shape),
        dtype_a=_dt(ra.dtype),
        tied=p.tied,
    )
    if sd_b is None:
        return TensorFinding(**common, dtype_b=None, a=Side.of(r), b=None, delta=None, hist_a=r.hist)
    rb = sd_b.info(p.name_b)
    d = r.delta
    delta = Delta(
        l2=d.l2,
        rel_change=r.rel_change,
        norm_ratio=r.norm_ratio,
        absmax_ratio=r.absmax_ratio,
        cosine=r.cosine,
        unchanged=d.unchanged / r.a.numel if r.a.numel else math.nan,
        max_change=d.max_abs,
        max_index=[int(i) for i in np.unravel_index(d.max_index, ra.shape)] if d.max_index >= 0 and ra.shape else None,
        max_a=d.max_a,
        max_b=d.max_b,
        w1=r.w1,
    )
    flags = ["dtype_changed"] if ra.dtype != rb.dtype else []
    return TensorFinding(
        **{**common, "flags": flags},
        dtype_b=_dt(rb.dtype),
        a=Side.of(r.a),
        b=Side.of(r.b),
        delta=delta,
        hist_a=r.a.hist,
        hist_b=r.b.hist,
    )


def _trainable(dtype: str) -> bool:
    """A floating-point (or complex) dtype, by its name as findings carry it."""
    return dtypes.is_float(dtype)


def _dt(dtype) -> str:
    return dtypes.name_of(dtype)


# --- ranking ----------------------------------------------------------------------------------------


def _flag(f: TensorFinding, flag: str, score: float, reason: str) -> None:
    f.flags.insert(len([x for x in f.flags if TIERS.get(x, UNFLAGGED) <= TIERS[flag]]), flag)
    if not (flag in ("drifted", "stalled") and "exploded" in f.flags):  # the explosion already says it
        f.reason = f"{f.reason}; {reason}" if f.reason else reason
    if TIERS[flag] < f.tier:
        f.tier, f.score = TIERS[flag], score


def _rank_pairs(findings: list[TensorFinding]) -> None:
    # Integer and bool tensors (position ids, masks, step counters) do not train: they are
    # compared for equality only, and count neither as frozen nor as peers that changed.
    trained = [f for f in findings if _trainable(f.dtype_a)]
    typical = _median([f.a.absmax for f in trained if f.a.numel and math.isfinite(f.a.absmax)])
    changed = sum(1 for f in trained if f.delta.unchanged < 1)
    for f in trained:
        a, b, d = f.a, f.b, f.delta
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
    usable = [
        f for f in findings if f.b.nonfinite == 0 and math.isfinite(f.delta.rel_change) and f.delta.rel_change > 0
    ]
    groups: dict[str, list[TensorFinding]] = {}
    for f in usable:  # peers are the same parameter in other layers, never other kinds of tensor:
        groups.setdefault(role(f.name), []).append(f)  # embeddings move ~10x less than matrices
    for label, members in groups.items():
        if len(members) < MIN_PEERS:
            continue
        logs = [math.log10(f.delta.rel_change) for f in members]
        med = statistics.median(logs)
        mad = max(statistics.median(abs(x - med) for x in logs), MAD_FLOOR)
        for f, x in zip(members, logs):
            z = (x - med) / (1.4826 * mad)
            f.delta.update_z, f.delta.peers = round(z, 2), label
            off = abs(x - med)
            if abs(z) >= OUTLIER_Z and off >= math.log10(OUTLIER_RATIO):
                times = 10**off
                more = "more" if z > 0 else "less"
                _flag(
                    f,
                    "drifted" if z > 0 else "stalled",
                    off,
                    f"changed {short_number(times, 2)}x {more} than its {len(members) - 1} peers {label} "
                    f"(||B-A||/||A|| = {short_number(f.delta.rel_change)} vs median {short_number(10**med)})",
                )


def _rank_single(findings: list[TensorFinding]) -> None:
    typical = _median([f.a.absmax for f in findings if f.a.numel and math.isfinite(f.a.absmax)])
    for f in findings:
        a = f.a
        ratio = a.absmax / typical if typical > 0 and math.isfinite(a.absmax) else 0.0
        f.score = ratio
        if a.nonfinite:
            _flag(f, "nonfinite", a.nonfinite, _counts(a))
        limit = _overflow_limit(f.dtype_a)
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


def _overflow_limit(dtype: str) -> float | None:
    return dtypes.largest(dtype)


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


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _finite_or(x: float, default: float) -> float:
    return x if math.isfinite(x) else default
