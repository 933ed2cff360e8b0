"""The earlier cause: the step whose removal prevents the fault, searched back from the root
step across as many checkpoints as the budget and the retained batches allow.

    found = earlier_cause(root, budget)     # EarlierCause: the report's `rewind`

A fault that its own batch does not explain alone (no row to blame, or the same rows do not
fault from an older model state) was doomed by an earlier step. Each window runs from a
checkpoint to the requested step; the first is the replay's own (from the checkpoint before
the fault's episode), then each older checkpoint in turn:

1. Replay the window with every step before the root left out. If the root step still faults,
   the state at that checkpoint was already primed: the cause lies before it, so the search goes
   one checkpoint further back (if every step from there is retained, and budget is left).
2. Else one of those steps did it. Candidates come from the journal first: the steps whose
   per-parameter gradient norm (before clipping) or update stands out most, by the report's
   precursor rule (>= 10x that parameter's median and a robust z, or the first non-zero
   gradient of a parameter that had only zeros), each confirmed by a replay without it; then
   bisection (the earlier half first).
3. The step found: the fewest of its rows whose removal prevents the fault (their sample ids),
   and what the step did to the state (one more replay up to it): the parameter it moved most
   against its norm, and for an embedding-like table the row it pushed (the token id).

Every test is one replay of a window (`budget`); a search that cannot go on says why:
`windows` lists each window tried and what it showed, `untested` the steps no window could
test (batches not retained, a checkpoint missing, the budget spent).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container

import numpy as np
import torch

from ckptlab.analysis.batches import batch_rows, is_embedding, select_rows
from ckptlab.analysis.health.precursors import series, spikes_before
from ckptlab.analysis.health.rules import HealthRules
from ckptlab.errors import CkptlabError
from ckptlab.replayer.findings import EarlierCause
from ckptlab.replayer.rootstep import RootStep
from ckptlab.replayer.shrink import ddmin, localize, negate, same_fault, where
from ckptlab.training.probe import named_parameters

RULES = HealthRules()  # what stands out in the journal: the report's precursor rule
CANDIDATES = 3  # journal candidates confirmed by replay before bisecting


def windows(root: RootStep) -> list[int]:
    """The checkpoints a window can start from, newest first: the replay's own, then every
    older one."""
    older = [c for c in root.inv.run.checkpoints if c < root.start]
    return [root.start, *reversed(older)]


def earlier_cause(root: RootStep, budget) -> EarlierCause | None:
    """The step (and rows) whose removal prevents the root step's fault, or None when the root
    is the window's first step and no older checkpoint exists."""
    fault_step = root.root
    starts = [c for c in windows(root) if c < fault_step]
    if not starts:
        return None
    found = EarlierCause([starts[0], fault_step - 1], None)
    found.start = starts[0]
    retained = set(root.inv.run.steps)
    for start in starts:
        missing = [s for s in range(start, root.inv.step + 1) if s not in retained]
        if missing:
            _window(found, start, "batches not retained", f"step {missing[0]}'s batch is not retained")
            break
        faults = window_faults(root, budget, found, start)
        everything = faults(range(start, fault_step))
        if everything is None:
            _window(found, start, "budget spent", "")
            break
        found.searched, found.start = [start, fault_step - 1], start
        if everything:  # the state at `start` was already primed: look further back
            _window(found, start, "primed", f"step {fault_step}'s batch faults from checkpoint {start}'s state")
            continue
        _window(found, start, "prevented", "leaving out every earlier step prevents it")
        step = _find_step(root, faults, start, found)
        if step is not None:
            _name_step(root, budget, found, faults, step)
        break
    _say_untested(found, starts, fault_step)
    return found


def _window(found: EarlierCause, start: int, result: str, detail: str) -> None:
    found.windows.append({"checkpoint": start, "result": result, "detail": detail})


def window_faults(root: RootStep, budget, found: EarlierCause, start: int):
    """faults(skip, drop): replay from checkpoint `start` to the requested step, with the steps
    in `skip` left out and, with drop=(step, rows), those rows of that step: does it still
    fault at or after the root step? None: the budget is spent or the checkpoint cannot be read
    (`found` says so)."""
    inv, r = root.inv, root.replayer
    fault_step = root.root
    again = _the_fault_again(root)

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
                seen = inv.anomalies(h, dets)
                if s >= fault_step and seen and again(seen):
                    return True
            return False
        finally:
            r.close(t)

    return faults


def _the_fault_again(root: RootStep):
    """Whether a window's anomalies at or after the root are the root's fault again: its loss
    anomaly when it had one (the symptom a user asked about; a zero-initialized parameter's
    first update is an "update explosion" whenever it comes, which a window without the cause
    merely moves), else `same_fault` of all its anomalies."""
    original = root.fault(root.base)
    loss = [k for k in original if k in ("nonfinite_loss", "loss_spike")]
    return same_fault(loss or original)


def _find_step(root: RootStep, faults, start: int, found: EarlierCause) -> int | None:
    """The one step in start..root-1 whose removal prevents the fault: the journal's candidates
    first, then bisection."""
    for s in journal_candidates(root, start):
        alone = faults([s])
        if alone is None:
            found.detail = (
                f"leaving out steps {start}..{root.root - 1} prevents it (the budget ran out before one step was found)"
            )
            return None
        found.tested.append(s)
        if not alone:
            found.how = "journal"
            return s
    step = bisect(faults, start, root.root, found)
    if step is not None:
        found.how = "bisection"
    return step


def journal_candidates(root: RootStep, start: int) -> list[int]:
    """Steps start..root-1 where a parameter's gradient norm or update stood out in the
    record, by the report's precursor rule (analysis/health/precursors.py: >= 10x that
    parameter's median and a robust z, or a first non-zero gradient), most first; at most
    CANDIDATES."""
    m = root.inv.metrics
    i = int(np.searchsorted(m.step, root.root))  # the root's row (or where it would be)
    rules = dataclasses.replace(RULES, precursor_window=max(1, root.root - start))
    found = spikes_before(m.step, m.param_names, series(m), i, rules)
    steps = dict.fromkeys(f["step"] for f in found if start <= f["step"] < root.root)
    return list(steps)[:CANDIDATES]


def bisect(faults, start: int, fault_step: int, found: EarlierCause) -> int | None:
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


def _name_step(root: RootStep, budget, found: EarlierCause, faults, step: int) -> None:
    """The step found: its rows (the fewest whose removal prevents the fault), what it did to
    the state, and the line that says so."""
    found.step = step
    rec = root.replayer.batch(step)
    n = batch_rows(rec.batch, rec.sample_ids)
    if n and n > 1:  # (the user's code may refuse a batch with rows dropped: the step stands alone then)
        shrunk = root.attempt(
            "earlier cause's rows",
            ddmin,
            list(range(n)),
            lambda d: negate(faults(drop=(step, d)) if len(d) < n else False),
        )
        if shrunk is not None:
            rows, complete = shrunk
            found.complete = found.complete and complete
            found.rows = rows
            ids = rec.sample_ids
            found.sample_ids = [ids[x] if ids is not None and x < len(ids) else None for x in rows]
    partial = found.rows and len(found.rows) < (n or 0)
    who = ", ".join(f"{where(rec.batch, x, n)} (sample {i})" for x, i in zip(found.rows, found.sample_ids))
    localize(found, rec.batch, n)
    if budget.take("rewind"):
        found.effect = step_effect(root, found.start if found.start is not None else root.start, step)
    found.detail = (
        (f"without {who} of step {step}" if partial else f"without step {step}")
        + f", step {root.root} does not fault"
        + (
            f" (replayed from checkpoint {found.start}: the window's own state was already primed)"
            if found.start != root.start
            else ""
        )
        + (f"; step {step} {describe_effect(found.effect)}" if found.effect else "")
    )


def describe_effect(e: dict) -> str:
    """'moved emb.weight by 2.1x its norm, most its row 15 (norm 0 -> 125)'."""
    out = f"moved {e['param']} by {e['ratio']:.3g}x its norm"
    if "row" in e:
        out += f", most its row {e['row']} (norm {e['row_norm_before']:.3g} -> {e['row_norm_after']:.3g})"
    return out


def step_effect(root: RootStep, start: int, step: int) -> dict | None:
    """What `step` did to the state, replayed from checkpoint `start`: the parameter it moved
    most against its norm (||dw|| / ||w||), and for an embedding-like 2-D table the row it moved
    most (its norm before and after)."""
    r = root.replayer
    t = r.build()
    try:
        r.load_checkpoint(t, start)
        for s in range(start, step):
            r.run_step(t, r.batch(s), measure_update=False)
        params = named_parameters(t.model)
        before = [p.detach().clone() for _, p in params]
        r.run_step(t, r.batch(step), measure_update=False)
        return _largest_change(params, before)
    except CkptlabError:
        return None
    finally:
        r.close(t)


def _largest_change(params, before: list[torch.Tensor]) -> dict | None:
    best = None
    for (name, p), b in zip(params, before):
        a = p.detach()
        if not a.is_floating_point() or a.shape != b.shape:
            continue
        d = torch.linalg.vector_norm((a - b).double()).item()
        w = torch.linalg.vector_norm(b.double()).item()
        rel = d / w if w > 0 else (float("inf") if d > 0 else 0.0)
        if best is None or rel > best["ratio"]:
            best = {"param": name, "ratio": rel, "update_norm": d, "norm_before": w}
            if a.dim() == 2 and is_embedding(name):
                rows = torch.linalg.vector_norm((a - b).double(), dim=1)
                k = int(rows.argmax())
                best["row"] = k
                best["row_norm_before"] = torch.linalg.vector_norm(b[k].double()).item()
                best["row_norm_after"] = torch.linalg.vector_norm(a[k].double()).item()
    return best


def _say_untested(found: EarlierCause, starts: list[int], fault_step: int) -> None:
    """Where a search that found no step stopped short: the steps before the oldest window it
    replayed (none at all: every step before the root)."""
    if found.step is not None:
        return
    replayed = [w["checkpoint"] for w in found.windows if w["result"] in ("primed", "prevented")]
    if not replayed:
        found.searched = []
    oldest = min(replayed, default=fault_step)
    if oldest > 0 and (not found.windows or found.windows[-1]["result"] != "prevented"):
        found.untested = [0, oldest - 1]
    if found.windows and found.windows[-1]["result"] == "primed" and found.windows[-1]["checkpoint"] == starts[-1]:
        _window(found, starts[-1], "no older checkpoint", "")
    if not found.detail:
        found.detail = describe_windows(found, fault_step)


def describe_windows(found: EarlierCause, fault_step: int) -> str:
    """One line: what each window showed, and what was not tested."""
    parts = []
    for w in found.windows:
        c = w["checkpoint"]
        if w["result"] == "primed":
            parts.append(f"from checkpoint {c} step {fault_step} still faults with every earlier step left out")
        elif w["result"] == "batches not retained":
            parts.append(f"checkpoint {c} could not be searched: {w['detail']}")
        elif w["result"] == "budget spent":
            parts.append(f"the budget ran out before checkpoint {c}")
        elif w["result"] == "no older checkpoint":
            parts.append("no older checkpoint is retained")
    if found.untested:
        parts.append(f"steps {found.untested[0]}..{found.untested[1]} were not tested")
    return "; ".join(parts)
