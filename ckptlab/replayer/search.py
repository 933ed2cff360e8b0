"""The deeper searches after the blame, each within a budget of extra replays:

    search(root, report)                        # both, as the root step's findings call for them
    culprit = minimal_culprit(root, budget)     # fewest rows, then positions, that still fault;
                                                # moved into a healthy batch: do they still?
    earlier = earlier_cause(root, budget)       # the earliest step whose removal prevents it

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
from collections.abc import Callable, Container

import torch

from ckptlab.analysis.batches import (
    batch_rows,
    micro_row,
    micro_rows,
    python_leaves,
    replace_rows,
    select_rows,
    zip_leaves,
)
from ckptlab.numbers import ranges
from ckptlab.replayer.findings import Culprit, EarlierCause, ReplayReport
from ckptlab.replayer.origin import lr_jump
from ckptlab.replayer.rootstep import RootStep

DEFAULT_BUDGET = 32


def same_fault(original: list[str]) -> Callable[[list[str]], bool]:
    """Whether a replay's anomalies are the original fault again: for a non-finite original,
    a non-finite loss, gradient or weight (a spike alone is another fault: one row's loss
    against the run's batch-mean history spikes easily); else one of the original's kinds
    (any anomaly where the original showed none)."""
    nonfinite = any(k.startswith("nonfinite") for k in original)
    kinds = set(original)

    def again(found: list[str]) -> bool:
        if nonfinite:
            return any(k.startswith("nonfinite") for k in found)
        return bool(kinds & set(found)) if kinds else bool(found)

    return again


def faults_again(root: RootStep) -> Callable[[list[str]], bool]:
    """`same_fault` of the root step as replayed (root.base)."""
    return same_fault(root.fault(root.base))


class Budget:
    """How many more replays the deeper searches may spend, and which ones it cut short."""

    def __init__(self, replays: int):
        self.limit, self.used = max(0, int(replays)), 0
        self.ran_out: list[str] = []

    def take(self, search: str) -> bool:
        if self.used >= self.limit:
            if search not in self.ran_out:
                self.ran_out.append(search)
            return False
        self.used += 1
        return True

    def to_json(self) -> dict:
        return {"replays": self.limit, "used": self.used, "ran_out": list(self.ran_out)}


def ddmin(items: list, test: Callable[[list], bool | None]) -> tuple[list, bool]:
    """Zeller's delta debugging: a 1-minimal sublist of `items` for which `test` is true
    (`test(items)` is taken to be true). `test` returns None when it may not run any more
    (budget): the smallest list found so far comes back, with complete=False."""
    c, n = list(items), 2
    while len(c) >= 2:
        size = -(-len(c) // n)
        chunks = [c[i : i + size] for i in range(0, len(c), size)]
        for candidate in chunks + ([[x for x in c if x not in ch] for ch in chunks] if len(chunks) > 2 else []):
            found = test(candidate)
            if found is None:
                return c, False
            if found:
                n = 2 if candidate in chunks else max(n - 1, 2)
                c = candidate
                break
        else:
            if n >= len(c):
                break
            n = min(2 * n, len(c))
    return c, True


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
            return _localize(
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
    return _localize(culprit, root.rec.batch, n)


def _localize(found, batch, n):
    """Rows counted across an accumulated step's micro-batches (of `n` rows) -> (micro_batches,
    rows within them), as SampleBlame says them; unchanged for a plain batch."""
    where = [micro_row(batch, r, n) for r in found.rows]
    if where and all(w is not None for w in where):
        found.micro_batches, found.rows = [w[0] for w in where], [w[1] for w in where]
    return found


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


def _where(batch, row: int, n: int | None) -> str:
    w = micro_row(batch, row, n)
    return f"row {row}" if w is None else f"micro-batch {w[0]} row {w[1]}"


def _cause(c: Culprit, older_fault: bool | None) -> str | None:
    if c.transplant_fault is False:
        return "data x batch"
    if c.transplant_fault and older_fault is False:
        return "data x model state"
    if c.transplant_fault and older_fault:
        return "data alone"
    return None


def _culprit_detail(c: Culprit, root: RootStep) -> str:
    rows = ", ".join(f"{_where(root.rec.batch, r, root.rows)} (sample {i})" for r, i in zip(c.rows, c.sample_ids))
    out = f"{rows} alone still faults"
    if c.positions:
        out += f"; it needs position(s) {ranges(c.positions)} of {', '.join(f'batch{f}' for f in c.fields)}"
    elif c.positions == []:
        out += "; with every position's values taken from a healthy row it still faults"
    if c.transplant_step is not None:
        out += f"; put into step {c.transplant_step}'s batch it {'faults' if c.transplant_fault else 'does not fault'}"
    return out


# --- the earlier cause ------------------------------------------------------------------------


def earlier_cause(root: RootStep, budget: Budget) -> EarlierCause | None:
    """Replay the window with earlier steps left out (bisection over the steps since the
    checkpoint, the earlier half first) and name the earliest step whose removal prevents the
    fault, then the fewest of its rows whose removal does."""
    start, fault_step = root.start, root.root
    if fault_step <= start:
        return None
    found = EarlierCause([start, fault_step - 1], None)
    faults = _window_faults(root, budget, found)
    everything = faults(range(start, fault_step))
    if everything is None:
        return found
    if everything:
        found.detail = (
            f"leaving out every step from {start} to {fault_step - 1} does not prevent it: "
            f"step {fault_step}'s batch faults from checkpoint {start}'s state"
        )
        return found
    step = _bisect(faults, start, fault_step, found)
    if step is None:
        return found
    found.step = step
    rec = root.replayer.batch(step)
    n = batch_rows(rec.batch, rec.sample_ids)
    if n and n > 1:
        rows, complete = ddmin(list(range(n)), lambda d: _negate(faults(drop=(step, d)) if len(d) < n else False))
        found.complete = found.complete and complete
        found.rows = rows
        ids = rec.sample_ids
        found.sample_ids = [ids[x] if ids is not None and x < len(ids) else None for x in rows]
    partial = found.rows and len(found.rows) < (n or 0)
    who = ", ".join(f"{_where(rec.batch, x, n)} (sample {i})" for x, i in zip(found.rows, found.sample_ids))
    _localize(found, rec.batch, n)
    found.detail = (
        f"without {who} of step {step}" if partial else f"without step {step}"
    ) + f", step {fault_step} does not fault"
    return found


def _window_faults(root: RootStep, budget: Budget, found: EarlierCause):
    """faults(skip, drop): replay the window from its checkpoint to the requested step, with
    the steps in `skip` left out and, with drop=(step, rows), those rows of that step: does it
    still fault at or after the root step? None: the budget is spent (`found` says so)."""
    inv, r = root.inv, root.replayer
    start, fault_step = root.start, root.root

    def faults(skip: Container[int] = (), drop: tuple[int, list[int]] | None = None) -> bool | None:
        if not budget.take("rewind"):
            found.complete = False
            return None
        t = r.build()
        try:
            r.load_checkpoint(t, start)
            dets = inv.detectors(start)
            for s in range(start, inv.step + 1):
                if s in skip:
                    continue
                rec = r.batch(s)
                batch = None
                if drop is not None and drop[0] == s:
                    rows = batch_rows(rec.batch, rec.sample_ids)
                    assert rows is not None, "earlier_cause drops rows only of a step whose batch has rows"
                    batch = select_rows(rec.batch, [x for x in range(rows) if x not in drop[1]], rows)
                h = r.run_step(t, rec, batch, measure_update=s >= fault_step)
                if inv.anomalies(h, dets) and s >= fault_step:
                    return True
            return False
        finally:
            r.close(t)

    return faults


def _bisect(faults, start: int, fault_step: int, found: EarlierCause) -> int | None:
    """The one step in start..fault_step-1 whose removal prevents the fault (leaving them all
    out does), bisecting the earlier half first; None when no single step does or the budget
    ran out first (`found.detail` says which)."""
    lo, hi = start, fault_step  # leaving out steps lo..hi-1 prevents the fault
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first = faults(range(lo, mid))
        if first is None:
            break
        if not first:
            hi = mid
            continue
        second = faults(range(mid, hi))
        if second is None:
            break
        if not second:
            lo = mid
            continue
        found.detail = f"no single step: leaving out steps {lo}..{hi - 1} together prevents it, neither half does"
        return None
    if hi - lo > 1:
        found.detail = f"leaving out steps {lo}..{hi - 1} prevents it (the budget ran out before one step was found)"
        return None
    return lo


def _negate(x: bool | None) -> bool | None:
    return None if x is None else not x


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
        rep.origin.state is not None or lr_jump(inv.metrics, root.root, root.base) is not None
    )
    doomed = root.older_fault is False or (not rep.samples and rep.origin.kind != "none" and not explained)
    if doomed and inv.run.world_size == 1:  # (one process replays one rank: no window)
        inv.log(f"looking for an earlier step that doomed step {root.root}")
        rep.rewind = earlier_cause(root, budget)
    rep.budget = budget.to_json()
    inv.timing["search_s"] = time.perf_counter() - t0
