"""The deeper searches after the blame, each within a budget of extra replays:

    search(root, report)                        # both, as the root step's findings call for them
    culprit = minimal_culprit(root, budget)     # fewest rows, then positions, that still fault;
                                                # moved into a healthy batch: do they still?
    earlier = earlier_cause(root, budget)       # rewind.py: the step whose removal prevents it

`root` is rootstep.py's RootStep. A culprit test replays the root step from the state it started
in (one replay each) and counts as "still faults" only the root step's own kind of fault
(`same_fault`: a non-finite root needs a non-finite value, so a one-row batch that merely
spikes against the run's history does not count); an earlier-cause test replays the window
from its checkpoint with some steps (or rows) left out (one replay each, of every step from the
checkpoint to the requested one). A search that runs out of budget keeps the best answer so far
and says so. The report holds the earlier cause under `rewind` (and a budget spent on it as
"rewind").
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable

import torch

from ckptlab.analysis.batches import (
    micro_rows,
    python_leaves,
    replace_rows,
    select_rows,
    zip_leaves,
)
from ckptlab.numbers import ranges
from ckptlab.replayer.findings import Culprit, ReplayReport
from ckptlab.replayer.origin import lr_jumps
from ckptlab.replayer.rewind import earlier_cause
from ckptlab.replayer.rootstep import RootStep
from ckptlab.replayer.shrink import Budget, ddmin, localize, same_fault, where

__all__ = ["DEFAULT_BUDGET", "Budget", "ddmin", "faults_again", "minimal_culprit", "same_fault", "search"]

DEFAULT_BUDGET = 32


def faults_again(root: RootStep) -> Callable[[list[str]], bool]:
    """`same_fault` of the root step as replayed (root.base)."""
    return same_fault(root.fault(root.base))


# --- the minimal culprit ------------------------------------------------------------------------


def minimal_culprit(root: RootStep, budget: Budget) -> Culprit | None:
    """Shrink the blamed rows to the fewest that, alone through the root step, still make it
    fault; then, where the batch has a sequence dimension, the fewest positions of those rows
    whose values the fault needs (every other position taken from a healthy row of the batch);
    then put the rows into a healthy nearby step's batch, in place of the same rows."""
    rep, n = root.report, root.rows
    if not rep.samples or not n:
        return None
    blamed = sorted({r for r in map(_batch_row, rep.samples) if 0 <= r < n})
    if not blamed:
        return None
    again = faults_again(root)

    def faults(rows: list[int], batch=None) -> bool | None:
        if not budget.take("culprit"):
            return None
        try:
            h = root.step(batch if batch is not None else select_rows(root.rec.batch, rows, n))
        except Exception:  # noqa: BLE001 - a model that cannot take this many rows (BatchNorm...)
            return False
        return again(root.fault(h))

    start = blamed
    alone = faults(blamed) if len(blamed) < n else True
    if alone is None:
        return None
    if not alone:
        if len(blamed) < n:
            return localize(
                Culprit(
                    blamed,
                    [root.sample_id(r) for r in blamed],
                    True,
                    detail="the blamed rows alone do not make the step fault: they need the rest of their batch",
                    cause="data x batch",
                ),
                root.rec.batch,
                n,
            )
    rows, minimal = ddmin(start, faults) if len(start) > 1 else (start, True)
    culprit = Culprit(rows, [root.sample_id(r) for r in rows], minimal)
    if minimal:
        _positions(root, culprit, faults, n)
    _transplant(root, culprit, budget)
    culprit.cause = _cause(culprit, root.older_fault)
    culprit.detail = _culprit_detail(culprit, root)
    return localize(culprit, root.rec.batch, n)


def _batch_row(s) -> int:
    """A blamed row counted across the step's micro-batches (SampleBlame.row is within its own)."""
    return s.batch_row if s.batch_row is not None else s.row


def _sequence_length(batch, rows: int) -> int | None:
    """The most common dimension 1 (> 1) of the row-shaped tensors: the sequence length."""
    dims = [
        leaf.shape[1]
        for _, leaf in python_leaves(batch)
        if isinstance(leaf, torch.Tensor)
        and leaf.dim() >= 2
        and leaf.shape[0] == rows
        and leaf.shape[1] > 1
        and leaf.dtype != torch.bool
    ]
    return Counter(dims).most_common(1)[0][0] if dims else None


def _positions(root: RootStep, culprit: Culprit, faults, n: int) -> None:
    """Which positions of the culprit rows the fault needs: the others come from a healthy row
    (a row of the same batch that is not blamed), field by field along dimension 1; then,
    of several such fields, the fewest whose values at those positions it needs."""
    healthy = [r for r in range(n) if r not in set(map(_batch_row, root.report.samples))]
    T = _sequence_length(root.rec.batch, n)
    if not healthy or T is None:
        return
    k = len(culprit.rows)
    bad = select_rows(root.rec.batch, culprit.rows, n)
    donor = select_rows(root.rec.batch, [healthy[0]] * k, n)
    fields = [
        path
        for path, leaf in python_leaves(bad)
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2 and leaf.shape[0] == k and leaf.shape[1] == T
    ]

    def keeping(positions: list[int], only: list[str] = fields):
        kept = {id(leaf) for path, leaf in python_leaves(bad) if path in only}

        def mix(b, d):
            if not isinstance(b, torch.Tensor) or b.dim() < 2 or b.shape[0] != k or b.shape[1] != T:
                return b
            if b.dtype == torch.bool:
                return b
            out = d.clone()
            if id(b) in kept:
                out[:, positions] = b[:, positions]
            return out

        return zip_leaves(mix, bad, donor)

    none_needed = faults(culprit.rows, keeping([]))
    if none_needed is None:
        culprit.minimal = False
        return
    if none_needed:
        culprit.fields, culprit.positions = fields, []
        return
    positions, complete = ddmin(list(range(T)), lambda p: faults(culprit.rows, keeping(p)))
    if complete and len(fields) > 1:
        fields, complete = ddmin(fields, lambda fs: faults(culprit.rows, keeping(positions, fs)))
    culprit.fields, culprit.positions = fields, sorted(positions)
    culprit.minimal = complete


def _transplant(root: RootStep, culprit: Culprit, budget: Budget) -> None:
    """Put the culprit rows into the batch of the nearest healthy earlier step, in place of
    the same rows, and run it from the root step's state: does the fault follow the rows?"""
    run, n = root.inv.run, root.rows
    m = root.inv.metrics
    if micro_rows(root.rec.batch, n) is not None:  # recorded micro-batches: not transplanted (yet)
        return
    recorded_faults = {int(e["step"]) for e in run.events()}
    for s in sorted((s for s in run.steps if s < root.root), reverse=True)[:8]:
        i = m.index(s)
        if s in recorded_faults or i is None or not math.isfinite(float(m.loss[i])):
            continue
        try:
            other = root.replayer.batch(s)
        except Exception:  # noqa: BLE001 - a damaged or foreign batch: try the one before
            continue
        if other.sample_ids is not None and len(other.sample_ids) != n:
            continue
        try:
            batch = replace_rows(
                other.batch, n, culprit.rows, select_rows(root.rec.batch, culprit.rows, n), len(culprit.rows)
            )
        except ValueError:
            continue
        if not budget.take("transplant"):
            return
        try:
            culprit.transplant_fault = faults_again(root)(root.fault(root.step(batch)))
        except Exception:  # noqa: BLE001
            return
        culprit.transplant_step = s
        return


def _cause(c: Culprit, older_fault: bool | None) -> str | None:
    if c.transplant_fault is False:
        return "data x batch"
    if c.transplant_fault and older_fault is False:
        return "data x model state"
    if c.transplant_fault and older_fault:
        return "data alone"
    return None


def _culprit_detail(c: Culprit, root: RootStep) -> str:
    rows = ", ".join(f"{where(root.rec.batch, r, root.rows)} (sample {i})" for r, i in zip(c.rows, c.sample_ids))
    out = f"{rows} alone still faults"
    if c.positions:
        out += f"; it needs position(s) {ranges(c.positions)} of {', '.join(f'batch{f}' for f in c.fields)}"
    elif c.positions == []:
        out += "; with every position's values taken from a healthy row it still faults"
    if c.transplant_step is not None:
        out += f"; put into step {c.transplant_step}'s batch it {'faults' if c.transplant_fault else 'does not fault'}"
    return out


# --- the earlier cause ------------------------------------------------------------------------


# --- both, for the root step -------------------------------------------------------------------


def search(root: RootStep, rep: ReplayReport) -> None:
    """Within the investigation's budget of replays: the minimal culprit of a fault with
    blamed rows, and the earlier step that doomed a fault the batch alone does not explain
    (it needs this model state, or no row is to blame)."""
    inv = root.inv
    budget = inv.budget
    if budget.limit <= 0:
        return
    t0 = time.perf_counter()
    inv.log(f"searching for the minimal culprit of step {root.root}")
    rep.culprit = minimal_culprit(root, budget)
    # an optimizer origin already explained: a learning-rate jump, or its own state
    explained = rep.origin.kind == "optimizer" and (
        rep.origin.state is not None or bool(lr_jumps(inv.metrics, root.root, root.base))
    )
    doomed = root.older_fault is False or (not rep.samples and rep.origin.kind != "none" and not explained)
    if doomed and inv.run.world_size == 1:  # (one process replays one rank: no window)
        inv.log(f"looking for an earlier step that doomed step {root.root}")
        rep.rewind = earlier_cause(root, budget)
    rep.budget = budget.to_json()
    inv.timing["search_s"] = time.perf_counter() - t0
