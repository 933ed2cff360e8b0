"""Blame the root step of a fault, stage by stage, over one RootStep (rootstep.py):

    root = RootStep(investigation, window)                       # window.root: the root step
    captured = explain(root, report, trace, counterfactuals, dump)
    explain_crash(root, report, crash)                           # a root step that raised

The stages, in order: trace it per op (trace.py); name the rows (rows.py) and the parameters
(parameters.py); find the origin (origin.py); prove the blame by counterfactual replay
(counterfactuals.py); the deeper searches within the budget (search.py). Each works on the
state the root step started in (a snapshot), re-running the step as often as it needs: once
traced, once plain, once per row, once without the blamed rows, and from an older checkpoint or
with the recent learning rate.
"""

from __future__ import annotations

import time

from ckptlab.analysis.batches import micro_row, select_rows
from ckptlab.numbers import same_loss
from ckptlab.replayer.counterfactuals import counterfactuals
from ckptlab.replayer.findings import Counterfactual, Origin, ReplayReport, SampleBlame
from ckptlab.replayer.origin import nonfinite_origin, origin
from ckptlab.replayer.parameters import nonfinite_buffers, parameters
from ckptlab.replayer.rootstep import RootStep
from ckptlab.replayer.rows import data_rows, per_row
from ckptlab.replayer.search import search
from ckptlab.replayer.trace import Tracer
from ckptlab.training.crash import is_step_error


def explain(root: RootStep, rep: ReplayReport, do_trace: bool, do_counterfactuals: bool, dump=None):
    """Write the root step's evidence into `rep`. `dump`: a DumpRequest (dump.py): the root
    step replayed once more, its tensors copied; they come back for the investigation to write
    once the verdict is said (None without a dump)."""
    root.report = rep
    t0 = time.perf_counter()
    tracer = root.attempt("per-op trace", _trace, root, rep) if do_trace else None
    base = root.base = root.step()  # the root step as replayed, for parameter blame
    rep.nonfinite_buffers = _buffers_gone_bad(root)
    content = data_rows(root)
    if root.rows and root.rows > 1:
        root.inv.log(f"replaying each of the {root.rows} rows of step {root.root} alone")
    rows = root.attempt("rows alone", per_row, root, default={}) if root.rows and root.rows > 1 else {}
    rep.parameters = parameters(root, base)
    rep.origin, rep.samples = origin(root, tracer, base, content, rows)
    if do_counterfactuals:
        root.inv.log(f"counterfactual replays of step {root.root}")
        rep.counterfactuals = counterfactuals(root, rep.samples)
        search(root, rep)
    captured = None
    if dump is not None:
        from ckptlab.replayer.dump import capture_root_step

        t1 = time.perf_counter()
        root.inv.log(f"copying the tensors of step {root.root} for {dump.path}")
        origin_op = tracer.origin if tracer is not None else None
        captured = root.attempt("dump", capture_root_step, root, origin_op, dump)
        root.inv.timing["dump_capture_s"] = time.perf_counter() - t1
    rep.failed_experiments = root.failed
    root.close()
    root.inv.timing["blame_s"] = time.perf_counter() - t0
    return captured


def _trace(root: RootStep, rep: ReplayReport) -> Tracer:
    """The root step traced per op: the causal chain into `rep`, and the tracer (its origin op
    and events) for the stages after it."""
    t0 = time.perf_counter()
    root.inv.log(f"tracing step {root.root} per op")
    tracer = Tracer(root.runner.model, root.runner.optimizer, rows=root.rows, batch=root.rec.batch)
    traced = root.step(tracer=tracer)
    if root.replayer.compiled:  # the Tracer ran it with torch.compile off
        rep.trace_eager = True
        rep.notes.append("the per-op trace ran eagerly: its dispatch modes cannot see inside torch.compile's graphs")
    check = rep.steps[root.root - rep.start_checkpoint]  # (distributed: the traced rank's own loss, not the mean)
    plain = check.rank_loss[rep.rank] if check.rank_loss and rep.rank is not None else check.loss
    if not same_loss(traced.loss, plain):
        rep.notes.append("the traced step's loss differs from the plain replay (tracing changed the kernels used)")
    rep.chain = [e.to_json() for e in tracer.chain()]
    root.inv.timing["trace_s"] = time.perf_counter() - t0
    return tracer


# --- a root step that raised ----------------------------------------------------------------------


def explain_crash(root: RootStep, rep: ReplayReport, crash: dict, do_trace: bool = True) -> None:
    """The root step raised (`crash`: training/crash.py's description). When a value went
    non-finite before it raised (traced per op up to the raise), the origin is where that
    value came from, as for a NaN loss, with the exception as `origin.raised`; else the origin
    is the exception where the user's code raised it. A row is blamed when its content is
    wrong (empty, token ids out of range, non-finite), when the first non-finite values are
    its, or when it raises the same exception alone through the step; then: does the step run
    without the blamed rows?"""
    root.report = rep
    t0 = time.perf_counter()
    tracer = root.attempt("per-op trace", _trace_to_the_raise, root, rep) if do_trace else None
    samples: dict[int, SampleBlame] = {}
    content = data_rows(root)
    # (only when a non-finite value reached an op before the raise: a NaN in a field the step
    # never read is no cause of its exception)
    went_nonfinite = nonfinite_origin(root, tracer, content, {}, samples) if _saw_nonfinite(tracer) else None
    if went_nonfinite is not None:
        went_nonfinite.raised = {k: crash[k] for k in ("error", "source", "call") if crash.get(k) is not None}
    rep.origin = went_nonfinite or Origin(
        "exception",
        crash.get("phase"),
        crash.get("module"),
        crash.get("type"),
        None,
        crash.get("source"),
        call=crash.get("call"),
        detail=crash.get("message"),
    )
    for category in ("out_of_range", "empty", "nonfinite", "absurd"):
        for r, why in content[category].items():
            samples.setdefault(r, SampleBlame(r, root.sample_id(r), why, batch_row=r))
    alone = _rows_raising_alone(root, rep, crash, samples)
    for sb in samples.values():  # an accumulated step: the row within its micro-batch
        where = micro_row(root.rec.batch, sb.row, root.rows)
        if where is not None:
            sb.batch_row, (sb.micro_batch, sb.row) = sb.row, where
    # (samples is keyed by each blamed row's batch row)
    rep.samples = [samples[r] for r in sorted(samples, key=lambda r: (not alone.get(r, False), r))]
    rep.counterfactuals.extend(_runs_without_blamed(root, rep.samples, crash))
    rep.failed_experiments = root.failed
    root.close()
    root.inv.timing["blame_s"] = time.perf_counter() - t0


def _saw_nonfinite(tracer: Tracer | None) -> bool:
    """The traced step ran an op on (or producing) a non-finite value."""
    return tracer is not None and any(not x.finite for e in tracer.events for x in (*e.inputs, *e.outputs))


def _buffers_gone_bad(root: RootStep) -> list[dict]:
    """The buffers the root step (just replayed) left non-finite that were finite before it."""
    after = nonfinite_buffers(root.runner.model)
    if not after:
        return []
    root.fresh()
    before = nonfinite_buffers(root.runner.model)
    return [{"buffer": name, "count": n} for name, n in after.items() if name not in before]


def _trace_to_the_raise(root: RootStep, rep: ReplayReport) -> Tracer:
    """The root step traced per op up to where it raised: what went non-finite before it."""
    tracer = Tracer(root.runner.model, root.runner.optimizer, rows=root.rows, batch=root.rec.batch)
    try:
        root.step(tracer=tracer)
    except Exception as e:  # noqa: BLE001 - the step's own exception is what is traced up to
        if not is_step_error(e):
            raise
    rep.chain = [e.to_json() for e in tracer.chain()]
    return tracer


def _rows_raising_alone(
    root: RootStep, rep: ReplayReport, crash: dict, samples: dict[int, SampleBlame]
) -> dict[int, bool]:
    """Each row alone through the step: does it raise the step's exception? Blames the rows
    that do, unless all or none do (then the note says what is to blame instead)."""
    if not root.rows or root.rows < 2:
        return {}
    kind = crash.get("type")
    alone = {r: _raises_like(root, crash, select_rows(root.rec.batch, [r], root.rows)) for r in range(root.rows)}
    if all(alone.values()):
        rep.notes.append(
            f"every row raises {kind} alone: no row is to blame (the code, the batch's shape or the model state is)"
        )
    elif not any(alone.values()):
        rep.notes.append(
            f"no row raises {kind} alone: the step fails on the batch as a whole (its size or shape), not on one sample"
        )
    else:
        for r in (r for r, raised in alone.items() if raised):
            why = f"raises {kind} alone through the step"
            if r in samples:
                samples[r].reason += "; " + why
            else:
                samples[r] = SampleBlame(r, root.sample_id(r), why, batch_row=r)
    return alone


def _runs_without_blamed(root: RootStep, samples: list[SampleBlame], crash: dict) -> list[Counterfactual]:
    keep = [r for r in range(root.rows or 0) if r not in {sb.batch_row for sb in samples}]
    if not samples or not keep:
        return []
    ids = ", ".join(str(sb.sample_id) for sb in samples[:5])
    raised = _raises_like(root, crash, select_rows(root.rec.batch, keep, root.rows), any_error=True)
    return [
        Counterfactual(
            f"does step {root.root} still raise without the blamed rows ({ids})?",
            raised,
            "without them the step still raises" if raised else "without them the step runs",
        )
    ]


def _raises_like(root: RootStep, crash: dict, batch, *, any_error: bool = False) -> bool:
    """Does the root step, on `batch` from the root's state, raise the step's own
    exception (of the same type, unless `any_error`)?"""
    try:
        root.step(batch)
    except Exception as e:  # noqa: BLE001 - the user's code raising is what is measured
        if not is_step_error(e):
            raise
        return any_error or type(e).__qualname__ == crash.get("type")
    return False
