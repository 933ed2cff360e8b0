"""`diff`: what changed between two checkpoints, and which parameter explains a fault.

    findings = ckptlab.diff("runs/exp1@5000", "runs/exp1@5400")   # files, folders, RUN@STEP, dicts
    findings.verdict        # Verdict(parameter, module, reason, kind), or None when nothing is wrong
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
  2     jumped              a matrix (2+ dims) that moved >= 10x its own norm, ||B-A||/||A||,
                            without exploding (vectors are left out: a bias that starts at
                            zero moves many times its early norm in healthy training)
  3     drifted / stalled   the update ratio ||B-A||/||A|| is an outlier among parameters of
                            the same role across >= 3 layers (blocks.*.mlp.fc.weight): robust
                            z-score >= 3.5 and >= 3x off their median
  4     dead                a matrix that became all zeros
  5     frozen              B == A bit for bit while most of the model changed
A tensor whose shape changed (in `mismatched`, not compared) is the verdict before any flag.
A checkpoint alone is ranked by: nonfinite, extreme (max |w| >= 100x the model's typical and
>= 10, or near its dtype's overflow), dead (an all-zero or constant matrix).
Within a tier the bigger effect ranks higher; unflagged tensors follow, most changed first.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from ckptlab import dtypes
from ckptlab.analysis.diff.findings import UNFLAGGED, DiffFindings, Mismatch, Verdict, finding_of
from ckptlab.analysis.diff.names import Pair, Plan, align, nothing_to_compare, single_plan
from ckptlab.analysis.diff.ranking import rank_pairs, rank_single
from ckptlab.errors import CkptlabError
from ckptlab.io import LazyStateDict, open_checkpoint
from ckptlab.io.stream import Job, default_workers, stream
from ckptlab.stats.pair import PairAccumulator
from ckptlab.stats.patterns import supported
from ckptlab.stats.tensor import StatsAccumulator


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
    plan = align(sd_a, sd_b, pattern) if sd_b is not None else single_plan(sd_a, pattern)
    skipped = [
        {"name": n, "side": side, "reason": r}
        for side, sd in (("a", sd_a), ("b", sd_b))
        if sd
        for n, r in sd.skipped.items()
    ]
    skipped += _drop_unsupported(plan, sd_a, sd_b)
    if not plan.pairs:
        raise CkptlabError(nothing_to_compare(sd_a, sd_b, plan, pattern))
    jobs = [_job(p, sd_a, sd_b) for p in plan.pairs]
    results = _stream_in_file_order(jobs, workers, progress, processes)  # TensorStats / PairStats
    findings = [finding_of(p.name, p.tied, r, j.a, j.b) for p, j, r in zip(plan.pairs, jobs, results)]
    for i, f in enumerate(findings):
        f.order = i
    (rank_pairs if sd_b is not None else rank_single)(findings)
    findings.sort(key=lambda f: (f.tier, -f.score))
    top = findings[0] if findings[0].tier < UNFLAGGED else None
    nbytes = sum(j.a.nbytes + (j.b.nbytes if j.b is not None else 0) for j in jobs)
    seconds = time.perf_counter() - started
    return DiffFindings(
        a=sd_a.label,
        b=sd_b.label if sd_b else None,
        verdict=shape_verdict(plan.mismatched)
        or (Verdict(top.name, top.module, top.reason or "") if top else None),  # (a flag always writes one)
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


def shape_verdict(mismatched: list[Mismatch]) -> Verdict | None:
    """A tensor whose shape changed is the headline, whatever the compared tensors show: A and
    B are not the same model there (a changed config, the wrong checkpoint), and it was not
    compared, so no flag of the ranking can say it."""
    if not mismatched:
        return None
    m = mismatched[0]
    shape_a, shape_b = ("x".join(map(str, s)) or "scalar" for s in (m.shape_a, m.shape_b))
    dtype = m.dtype_a if m.dtype_a == m.dtype_b else f"{m.dtype_a} -> {m.dtype_b}"
    n = len(mismatched) - 1
    more = f"; {n} more tensor{'s' if n > 1 else ''} changed shape" if n else ""
    return Verdict(
        m.name,
        m.name.rpartition(".")[0],
        f"shape changed from {shape_a} in A to {shape_b} in B ({dtype}): not compared, "
        f"A and B are not the same model here{more}",
        kind="shape_changed",
    )


def _drop_unsupported(plan: Plan, sd_a, sd_b) -> list[dict]:
    """Complex, quantized and packed 4-bit tensors have no statistics here: listed as skipped."""
    keep, skipped = [], []
    for p in plan.pairs:
        sides = [("a", sd_a.info(p.name_a))] + ([("b", sd_b.info(p.name_b))] if sd_b is not None else [])
        bad = [(side, ref.dtype) for side, ref in sides if not supported(ref.dtype)]
        skipped += [
            {"name": p.name, "side": side, "reason": f"dtype {dtypes.name_of(dtype)} is not supported"}
            for side, dtype in bad
        ]
        if not bad:
            keep.append(p)
    plan.pairs = keep
    return skipped


def _job(p: Pair, sd_a: LazyStateDict, sd_b: LazyStateDict | None) -> Job:
    ra = sd_a.info(p.name_a)
    if sd_b is None:
        return Job(ra, None, lambda: StatsAccumulator(ra.dtype), finish=StatsAccumulator.result)
    rb = sd_b.info(p.name_b)
    return Job(ra, rb, lambda: PairAccumulator(ra.dtype, rb.dtype), finish=PairAccumulator.result)


def _stream_in_file_order(jobs: list[Job], workers: int, progress, processes=None) -> list:
    """Stream the jobs in the order A stores them (each file read front to back); results in
    the jobs' order."""
    order = sorted(range(len(jobs)), key=lambda i: _storage_order(jobs[i].a))
    results = stream([jobs[i] for i in order], workers=workers, progress=progress, processes=processes)
    return [r for _, r in sorted(zip(order, results), key=lambda x: x[0])]


def _storage_order(ref) -> tuple:
    file = getattr(ref, "file", None)
    return (0, str(file.path), ref.offset) if file is not None else (1, "", 0)
