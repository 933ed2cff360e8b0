"""Find dirty data in a recorded run, for a skip list on resume.

    report = scan(ckptlab.open_run("runs/exp1"), attribute=attribute_rows)  # static + dynamic + attribution
    for r in report.flagged:                           # most suspicious first
        r.step, r.row, r.sample_id, r.reason, r.evidence
    write_skip_list(report, "skip.json")
    sampler = ckptlab.skip_samples(sampler, "skip.json")   # on resume: those ids never come back

Three stages, each usable alone:
1. static: every retained batch, row by row, field by field (a "field" is one tensor/array in
   the batch's nesting, e.g. `ids` or `0`): non-finite values; all-padding or empty rows;
   token ids out of range; values extreme against the run's own robust statistics (per
   feature for narrow fields, per row summary for wide ones); length outliers; the same
   content seen under another sample id (a duplicate).
2. dynamic: the step health (loss and gradient-norm spikes by the one spike rule in
   analysis/spikes.py, non-finite losses), mapped to their steps and batches.
3. attribution (optional): for flagged steps, per-row loss and gradient norm from the
   function passed as `attribute` (`ckptlab.replayer.attribute_rows(run, step[, rank=])`, which
   replays the step row by row), naming the rows that caused a spike even when their content
   looks normal. This package only reads stored data; replay is the caller's to pass in.

Ranking: each reason has a base score (non-finite 100 ... length outlier 20); a row flagged by
content in a step that also spiked gains 15, since two independent signals agree.

Here: `scan`, `batch_flags` (one batch's own content flags, for `report`), the skip list and
the verdict (`verdict(report, written=path)` says it anew once the skip list is written or
changed). Modules: `findings` (DirtyRules, scores, DirtyRow, DirtyReport), `static` (the pass
over the batches), `fields` (what the pass keeps per field), `checks` (the run-wide checks after
it), `dynamic` (step health), `attribution` (per-row replay).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable

from ckptlab.analysis.dirty.attribution import attribution_rows
from ckptlab.analysis.dirty.dynamic import corroborate, dynamic_flags, step_rows
from ckptlab.analysis.dirty.findings import DEFAULT_RULES, SKIP_REASONS, Attribute, DirtyReport, DirtyRow, DirtyRules
from ckptlab.analysis.dirty.static import StaticScan
from ckptlab.errors import CkptlabError
from ckptlab.run import skiplist
from ckptlab.run.reader import Run


def scan(
    run: Run,
    rules: DirtyRules = DEFAULT_RULES,
    *,
    attribute: Attribute | None = None,
    data_info: dict | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> DirtyReport:
    """Static and dynamic scans, and attribution of the flagged steps when `attribute` (a
    per-row replay such as `ckptlab.replayer.attribute_rows`) is given."""
    if isinstance(attribute, bool):  # the flag of older versions: say what to pass instead
        raise CkptlabError("scan(attribute=...) takes a function such as ckptlab.replayer.attribute_rows, or None")
    t0 = time.perf_counter()
    info = {**(run.manifest.get("data_info") or {}), **(data_info or {})}
    static = StaticScan(run, rules, info)
    steps = run.steps
    ranks = run.ranks if run.world_size > 1 else [None]  # a distributed run: every rank's batches
    work = [(step, rank) for rank in ranks for step in (steps if rank is None else run.steps_of(rank))]
    for i, (step, rank) in enumerate(work):
        static.add(step, rank)
        if progress is not None:
            progress(i + 1, len(work))
    flagged = static.finish()
    seconds = time.perf_counter() - t0
    step_flags = dynamic_flags(run, rules, ids_by_step=static.ids_by_step())
    flagged += step_rows(step_flags)
    attribution = {"status": "off"}
    if attribute is not None:
        attribution, rows = attribution_rows(run, attribute, step_flags, rules, ranks)
        flagged += rows
    corroborate(flagged)
    flagged.sort(key=lambda r: (-r.score, r.step, -1 if r.row is None else r.row, r.reason))
    report = DirtyReport(
        run=str(run.path),
        scanned={
            "steps": len(steps),
            "first": steps[0] if steps else None,
            "last": steps[-1] if steps else None,
            "rows": static.n_rows,
            "fields": sorted(static.field_names),
            "seconds": seconds,
            "batches_per_s": len(steps) / seconds if seconds > 0 else None,
        },
        data_info=static.info_used,
        rules=rules,
        flagged=flagged,
        steps=step_flags,
        attribution=attribution,
        skip_ids=[],
        notes=static.notes,
    )
    report.skip_ids = skip_ids(report)
    report.verdict = verdict(report)
    return report


# The reasons the static stage finds in one batch alone, without the run's statistics.
BATCH_REASONS = ("nonfinite", "out_of_range", "empty")


def batch_flags(
    run: Run, step: int, rank: int | None = None, rules: DirtyRules = DEFAULT_RULES, data_info: dict | None = None
) -> list[DirtyRow]:
    """The rows of one step's batch that `scan`'s static stage flags from that batch alone
    (BATCH_REASONS: non-finite values, token ids out of range, empty rows), most suspicious
    first; none when the batch is not retained or not readable. `ckptlab report` names with it
    the rows behind a non-finite step without scanning the whole run."""
    if step not in (run.steps if rank is None else run.steps_of(rank)):
        return []
    static = StaticScan(run, rules, {**(run.manifest.get("data_info") or {}), **(data_info or {})})
    static.add(step, rank)
    rows = [r for r in static.pass_flags() if r.reason in BATCH_REASONS]
    return sorted(rows, key=lambda r: (-r.score, -1 if r.row is None else r.row, r.reason))


def skip_ids(report: DirtyReport, *, whole_batches: bool = True) -> list:
    """Sample ids to skip: rows flagged for a SKIP_REASONS reason, and (whole_batches) every
    row of a spiking step for which no row was found to blame -- the way large-model teams
    skip the batches around a spike."""
    ids, seen = [], set()
    blamed_steps = {r.step for r in report.flagged if r.row is not None and r.reason in SKIP_REASONS}

    def add(sid):
        key = (type(sid).__name__, sid)
        if sid is not None and key not in seen:
            seen.add(key)
            ids.append(sid)

    for r in report.flagged:
        if r.row is not None and r.reason in SKIP_REASONS:
            add(r.sample_id)
    if whole_batches:
        downstream = {f["step"] for f in report.steps if "downstream_of" in f}
        spiking = sorted({f["step"] for f in report.steps if f["batch"] == "retained"} - blamed_steps - downstream)
        for f in report.steps:
            if f["step"] in spiking:
                for sid in f.get("sample_ids") or []:
                    add(sid)
    return ids


def write_skip_list(report: DirtyReport, path: str | os.PathLike) -> dict:
    """Write the skip list as JSON (atomically); returns what was written."""
    entries: dict = {}
    for r in report.flagged:
        if r.sample_id is None or r.row is None or r.reason not in SKIP_REASONS:
            continue
        e = entries.setdefault(
            repr(r.sample_id), {"sample_id": r.sample_id, "step": r.step, "row": r.row, "reasons": []}
        )
        if r.reason not in e["reasons"]:
            e["reasons"].append(r.reason)
    return skiplist.write(path, report.skip_ids, list(entries.values()), run=report.run)


def verdict(report: DirtyReport, written: str | os.PathLike | None = None) -> str:
    """One sentence: how many rows (each counted once, whatever its reasons) and steps look
    wrong, the worst, and the skip list: written to `written`, or not written yet."""
    rows = [r for r in report.flagged if r.row is not None]
    steps = [r for r in report.flagged if r.row is None]
    if not rows and not steps:
        return f"No dirty data found in {report.scanned['steps']} retained batches ({report.scanned['rows']} rows)."
    parts = []
    if rows:
        distinct = {(r.step, r.rank, r.row) for r in rows}
        kinds = Counter(r.reason for r in rows)  # one entry per (row, reason): rows per reason
        parts.append(
            f"{len(distinct)} suspicious row{'' if len(distinct) == 1 else 's'} ("
            + ", ".join(f"{k}: {n}" for k, n in kinds.most_common())
            + ")"
        )
    if steps:
        parts.append(f"{len({r.step for r in steps})} step(s) with loss/gradient trouble")
    top = report.flagged[0]
    where = f"step {top.step}" + (f" row {top.row} (sample {top.sample_id!r})" if top.row is not None else "")
    n = len(report.skip_ids)
    if written is not None:
        skip = f"Skip list: {n} sample id(s), written to {written}."
    elif n:
        skip = f"Skip list: {n} sample id(s), not written (ckptlab dirty --out skip.json writes it)."
    else:
        skip = "Skip list: empty."
    return f"{'; '.join(parts)}; worst: {where}, {top.reason}. {skip}"
