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

import time
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch

from ckptlab.analysis.anomalies import nonfinite_loss
from ckptlab.analysis.batches import (
    batch_rows,
    leaves,
    python_leaves,
    replace_rows,
    row_batch,
    select_rows,
    zip_leaves,
)
from ckptlab.analysis.dirty.fields import is_mask
from ckptlab.numbers import ranges
from ckptlab.replayer.findings import Culprit, ReplayReport
from ckptlab.replayer.origin import lr_jumps
from ckptlab.replayer.rewind import earlier_cause
from ckptlab.replayer.rootstep import RootStep
from ckptlab.replayer.rows import IGNORE_INDEX
from ckptlab.replayer.shrink import Budget, ddmin, localize, same_fault, where
from ckptlab.replayer.startstate import new_anomalies
from ckptlab.training.crash import is_step_error

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
    refused: list[Exception] = []  # the user's code raised on these rows (BatchNorm needs two)
    ran = [0]

    def faults(rows: list[int], batch=None) -> bool | None:
        if not budget.take("culprit"):
            return None
        try:
            h = root.step(batch if batch is not None else select_rows(root.rec.batch, rows, n))
        except Exception as e:
            if not is_step_error(e):
                raise
            refused.append(e)
            return False  # counted as not the fault; said in the culprit's detail
        ran[0] += 1
        return again(root.fault(h))

    alone = faults(blamed) if len(blamed) < n else True
    if alone is None:
        return None
    culprit = _shrunk(root, budget, blamed, alone, faults)
    if refused and not ran[0]:  # nothing it tried could run: the experiment failed
        raise refused[0]
    if culprit is not None and refused:
        culprit.detail += f" ({len(refused)} of its replays raised {_error(refused[0])}: counted as not faulting)"
    return culprit


def _error(e: Exception) -> str:
    return f"{type(e).__qualname__}: {' '.join(str(e).split())[:200]}"


def _shrunk(root: RootStep, budget: Budget, blamed: list[int], alone: bool, faults) -> Culprit | None:
    """The culprit once the blamed rows alone were tried (`alone`: they fault alone)."""
    n, start = root.rows, blamed
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
    """Which positions of the culprit rows the fault needs: the others come from each row's
    donor (`_donors`: a healthy row of the batch, padded nowhere the culprit row is not), field
    by field along dimension 1; then, of several such fields, the fewest whose values at those
    positions it needs. Each row is mixed alone, out of its own micro-batch when the step was
    recorded as micro-batches (`row_batch`), and put back in its place (`replace_rows`): the
    rows of different micro-batches stay in theirs, and each keeps its own sequence length."""
    batch = root.rec.batch
    own = {r: row_batch(batch, r, n) for r in culprit.rows}
    lengths = {r: _sequence_length(own[r], 1) for r in culprit.rows}
    donors = _donors(root, own, n)
    if donors is None or any(t is None for t in lengths.values()):
        return
    fields = list(
        dict.fromkeys(path for r in culprit.rows for path, leaf in python_leaves(own[r]) if _along(leaf, lengths[r]))
    )

    def keeping(positions: list[int], only: list[str] = fields):
        mixed = batch
        for r in culprit.rows:
            mixed = replace_rows(mixed, n, [r], _mix(own[r], donors[r], lengths[r], positions, only), 1)
        return select_rows(mixed, culprit.rows, n)

    none_needed = faults(culprit.rows, keeping([]))
    if none_needed is None:
        culprit.minimal = False
        return
    if none_needed:
        culprit.fields, culprit.positions = fields, []
        return
    T = max(t for t in lengths.values() if t is not None)
    positions, complete = ddmin(list(range(T)), lambda p: faults(culprit.rows, keeping(p)))
    if complete and len(fields) > 1:
        fields, complete = ddmin(fields, lambda fs: faults(culprit.rows, keeping(positions, fs)))
    culprit.fields, culprit.positions = fields, sorted(positions)
    culprit.minimal = complete


def _along(leaf, length: int | None) -> bool:
    """A leaf of a one-row batch that runs along its sequence: (1, length, ...), not a boolean
    mask (a mask stays the culprit row's whole)."""
    return (
        isinstance(leaf, torch.Tensor)
        and leaf.dim() >= 2
        and leaf.shape[0] == 1
        and leaf.shape[1] == length
        and leaf.dtype != torch.bool
    )


def _mix(row, donor, length: int | None, positions: list[int], only: list[str]):
    """One culprit row (a one-row batch) with the donor's values but at `positions` of the
    fields `only`."""
    kept = {id(leaf) for path, leaf in python_leaves(row) if path in only}
    at = [p for p in positions if length is not None and p < length]

    def mix(b, d):
        if not _along(b, length):
            return b
        out = d.clone()
        if id(b) in kept:
            out[:, at] = b[:, at]
        return out

    return zip_leaves(mix, row, donor)


def _donors(root: RootStep, own: dict, n: int) -> dict | None:
    """For each culprit row (`own`: row -> its one-row batch), the one-row batch whose values
    stand in at the positions not kept: the first row of the batch that is not blamed, built
    as the culprit row is (the same fields and shapes: with padding to each micro-batch's
    longest row, one of the same length), and padding nowhere the culprit row is not. A donor's
    padding would switch a position off instead of giving it healthy values, and the fault
    could vanish (or appear: an all-padding row's 0/0 loss) for that reason rather than for
    the culprit's values. None when a culprit row has no such donor: positions not searched."""
    batch, blamed = root.rec.batch, set(map(_batch_row, root.report.samples))
    info = root.inv.run.manifest.get("data_info") or {}
    seen: dict[int, tuple] = {}  # healthy row -> (its one-row batch, layout, padding), as looked at

    def healthy(h: int) -> tuple:
        if h not in seen:
            d = row_batch(batch, h, n)
            seen[h] = (d, _layout(d), _padding(d, info))
        return seen[h]

    out = {}
    for r, row in own.items():
        shape, off = _layout(row), _padding(row, info)
        fits = (healthy(h)[0] for h in range(n) if h not in blamed and healthy(h)[1] == shape and healthy(h)[2] <= off)
        found = next(fits, None)
        if found is None:
            return None
        out[r] = found
    return out


def _layout(row) -> list[tuple]:
    """How a one-row batch is built: its leaves' paths, and its tensors' shapes and dtypes."""
    return [
        (p, tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else (p,) for p, leaf in python_leaves(row)
    ]


def _padding(row, info: dict) -> set[int]:
    """The positions of a one-row batch that are padding: where an integer field of it holds
    the ignore_index (-100, the labels' padding, unless data_info names another), data_info's
    pad_id, or, in a mask field (named so, as dirty reads masks), 0."""
    ignore, pad = info.get("ignore_index", IGNORE_INDEX), info.get("pad_id")
    off: set[int] = set()
    for path, a in leaves(row):
        if not isinstance(a, np.ndarray) or a.ndim != 2 or a.shape[0] != 1 or a.dtype.kind not in "iu":
            continue
        hit = (a[0] == ignore) | (a[0] == pad if pad is not None else False) | (a[0] == 0 if is_mask(path) else False)
        off.update(np.flatnonzero(hit).tolist())
    return off


def _transplant(root: RootStep, culprit: Culprit, budget: Budget) -> None:
    """Put the culprit rows into the batch of the nearest healthy earlier step, in place of
    the same rows (in their micro-batches, for a step recorded as micro-batches), and run it
    from the root step's state: does the fault follow the rows?"""
    run, n = root.inv.run, root.rows
    m = root.inv.metrics
    # (a weight non-finite before the window shows in every step's events: no fault of a batch)
    recorded_faults = {int(e["step"]) for e in run.events() if new_anomalies([e["kind"]], root.bad_start)}
    for s in sorted((s for s in run.steps if s < root.root), reverse=True)[:8]:
        i = m.index(s)
        if s in recorded_faults or i is None or nonfinite_loss(m.loss[i], m.loss_known[i]):
            continue
        try:
            other = root.replayer.batch(s)
        except Exception:  # noqa: BLE001 - a damaged or foreign batch: try the one before
            continue
        if batch_rows(other.batch, other.sample_ids) != n:
            continue
        try:
            batch = other.batch
            for r in culprit.rows:
                batch = replace_rows(batch, n, [r], row_batch(root.rec.batch, r, n), 1)
        except ValueError:
            continue
        if not budget.take("transplant"):
            return
        again = root.attempt("transplant", lambda b: faults_again(root)(root.fault(root.step(b))), batch)
        if again is not None:  # (None: the user's code refused the mixed batch: root.failed says so)
            culprit.transplant_fault, culprit.transplant_step = again, s
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
    rep.culprit = root.attempt("minimal culprit", minimal_culprit, root, budget)
    # an optimizer origin already explained: a learning-rate jump, or its own state
    explained = rep.origin.kind == "optimizer" and (
        rep.origin.state is not None or bool(lr_jumps(inv.metrics, root.root, root.base))
    )
    doomed = root.older_fault is False or (not rep.samples and rep.origin.kind != "none" and not explained)
    if doomed and inv.run.world_size == 1:  # (one process replays one rank: no window)
        inv.log(f"looking for an earlier step that doomed step {root.root}")
        rep.rewind = root.attempt("earlier cause", earlier_cause, root, budget)
    rep.budget = budget.to_json()
    inv.timing["search_s"] = time.perf_counter() - t0
