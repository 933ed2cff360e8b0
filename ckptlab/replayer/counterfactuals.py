"""Counterfactual replays that prove the blame: the root step changed in one way, run again.

    root.report.counterfactuals = counterfactuals(root, samples)

Without the blamed rows; with its recent learning rate (a learning-rate jump); with the origin's
module, then the whole model, in float32 (a precision origin); with Adam's second moment in tune
with its gradient (an optimizer-state origin); the same batch from an older checkpoint (which
sets `root.older_fault` for search.py).
"""

from __future__ import annotations

import copy

from ckptlab.analysis.anomalies import step_anomalies
from ckptlab.analysis.batches import select_rows
from ckptlab.numbers import LOSS_NOT_KNOWN, precise
from ckptlab.replayer.findings import Counterfactual, Origin, SampleBlame
from ckptlab.replayer.optstate import in_tune
from ckptlab.replayer.origin import group_text, lr_jumps
from ckptlab.replayer.precision import in_float32
from ckptlab.replayer.rootstep import RootStep
from ckptlab.replayer.search import faults_again
from ckptlab.training.health import StepHealth
from ckptlab.training.probe import named_parameters

# The anomalies of a step that its own update causes (spikes of its loss and gradient come
# before the update).
AFTER_AN_UPDATE = ("update_explosion", "nonfinite_weight")
NOT_RUN = "could not run"  # how a counterfactual the user's code refused begins its detail


def counterfactuals(root: RootStep, samples: list[SampleBlame]) -> list[Counterfactual]:
    """Each counterfactual the origin and the blamed rows call for, in the report's order; one
    that the user's code refuses (it raises) is listed as not runnable, and the others go on."""
    return (
        _guarded(root, "without the blamed rows", _without_rows, samples)
        + _guarded(root, "with its recent learning rate", _recent_learning_rate)
        + _guarded(root, "in float32", _in_float32, root.report.origin)
        + _guarded(root, "with the second moment in tune", _second_moment_in_tune)
        + _guarded(root, "from an older model state", _older_state, samples)
    )


def _guarded(root: RootStep, name: str, fn, *args) -> list[Counterfactual]:
    """`fn(root, *args)` through `root.attempt`: when the user's code raised in it, a
    counterfactual that says it could not run (fault None), and why."""
    out = root.attempt(name, fn, root, *args)
    if out is not None:
        return out
    failed = root.failed[-1]
    at = f" at {failed['source']}" if failed.get("source") else ""
    return [Counterfactual(f"step {root.root} {name}?", None, f"{NOT_RUN}: the step raised {failed['error']}{at}")]


def _without_rows(root: RootStep, samples: list[SampleBlame]) -> list[Counterfactual]:
    if not samples or not root.rows:
        return []
    keep = [r for r in range(root.rows) if r not in {s.batch_row for s in samples}]
    ids = ", ".join(str(s.sample_id) for s in samples[:5])
    if not keep:
        question = f"does step {root.root} still fail without the blamed rows?"
        return [Counterfactual(question, None, "every row is blamed; nothing left to run")]
    h = root.step(select_rows(root.rec.batch, keep, root.rows))
    found = root.fault(h)
    still = faults_again(root)(found)
    return [
        Counterfactual(
            f"does step {root.root} still fail without the blamed rows ({ids})?",
            still,
            f"without them: loss {precise(h.loss, LOSS_NOT_KNOWN)}, grad norm {h.grad_norm:.4g}"
            + (f" -> still {', '.join(found)}" if still else " -> the fault vanishes" + _others(found)),
        )
    ]


def _others(found: list[str]) -> str:
    """The anomalies of a replay that are not the root step's kind of fault (search.same_fault)."""
    return f" ({', '.join(found)} remain: another kind of fault)" if found else ""


def _recent_learning_rate(root: RootStep) -> list[Counterfactual]:
    """An optimizer origin with a learning-rate jump: the step with each jumped group's own
    recent learning rate (the groups whose rate did not jump keep theirs)."""
    jumps = lr_jumps(root.inv.metrics, root.root, root.base) if root.report.origin.kind == "optimizer" else []
    if not jumps:
        return []
    root.fresh()
    for j in jumps:
        root.replayer.set_lr(root.runner, j.group, j.typical)
    h = root.replayer.run_step(root.runner, root.rec)
    found = root.fault(h)
    every = len(root.base.lr)  # (every group: in a pipeline, every stage's)
    if len(jumps) == 1:
        j = jumps[0]
        where = group_text(root.optimizers, j.group, every)
        what = f"its recent learning rate {j.typical:.3g} instead of {j.lr:.3g}" + (f" ({where})" if where else "")
        lrs = f"lr {j.typical:.3g}"
    else:
        what = (
            "each jumped group's recent learning rate ("
            + "; ".join(
                f"{group_text(root.optimizers, j.group, every)}: {j.typical:.3g} instead of {j.lr:.3g}" for j in jumps
            )
            + ")"
        )
        lrs = "the recent learning rates"
    return [
        Counterfactual(
            f"does step {root.root} still fail with {what}?",
            bool(found),
            f"with {lrs}: loss {precise(h.loss, LOSS_NOT_KNOWN)}, update ratio {h.update_ratio_global or 0:.3g}"
            + (f" -> still {', '.join(found)}" if found else " -> no fault: the learning rate is the cause"),
        )
    ]


def _in_float32(root: RootStep, o: Origin) -> list[Counterfactual]:
    """A precision origin: the trace's answer (the op re-run in float32), then the root step
    with the origin's module in float32, then (if that is not enough) the whole model: which
    part must stay in float32 for the fault to go away."""
    if o.kind != "precision":
        return []
    out = [
        Counterfactual(
            f"does {o.op} still produce {o.produced} in float32 on the same inputs?",
            False,
            f"in {o.dtype} it produced {o.produced}; in float32 it is finite -> a reduced-precision overflow",
        )
    ]
    if o.module is None:
        return out
    if root.replayer.mirror is not None:  # (a stage in float32 would send its peers tensors they do not expect)
        question = f"does step {root.root} still go non-finite with `{o.module}` in float32?"
        return [*out, Counterfactual(question, None, "not run: a pipeline's stages pass tensors of their dtype")]
    for path in dict.fromkeys([o.module, ""]):
        what = f"`{path}`" if path else "the whole model"
        h = root.attempt(f"in float32 ({what})", _step_in_float32, root, path)
        if h is None:  # the user's code refused this part in float32: root.failed says why
            failed = root.failed[-1]
            question = f"does step {root.root} still fail with {what} in float32?"
            out.append(Counterfactual(question, None, f"{NOT_RUN}: the step raised {failed['error']}"))
            continue
        found = root.fault(h)
        # The fault here is the non-finite value; a spike that remains in float32 is an
        # outlier's, which float32 survives.
        nonfinite = [k for k in found if k.startswith("nonfinite")]
        out.append(
            Counterfactual(
                f"does step {root.root} still go non-finite with {what} in float32?",
                bool(nonfinite),
                f"in float32: loss {precise(h.loss, LOSS_NOT_KNOWN)}, grad norm {h.grad_norm:.4g}"
                + (
                    f" -> still {', '.join(nonfinite)}"
                    if nonfinite
                    else f" -> finite: keep {what} in float32"
                    + (f" ({', '.join(found)} remain: an outlier)" if found else "")
                ),
            )
        )
        if not nonfinite:
            o.float32_module = path
            break
    return out


def _step_in_float32(root: RootStep, path: str) -> StepHealth:
    """The root step, from the state it started in, with `path` ("" the whole model) in float32."""
    t = root.replayer.build()
    try:
        root.replayer.restore(t, root.snap)
        with in_float32(t.model, path):
            return root.replayer.run_step(t, root.rec)
    finally:
        root.replayer.close(t)


def _second_moment_in_tune(root: RootStep) -> list[Counterfactual]:
    """An optimizer-state origin: the root step (and the steps after it) with the parameter's
    second moment in tune with the gradient that arrives."""
    name = root.report.origin.parameter
    if root.report.origin.state != "exp_avg_sq" or name is None:
        return []
    param = dict(named_parameters(root.runner.model)).get(name)
    if param is None:
        return []
    h, found = _update_and_after(root, in_tune(root.runner.optimizer, param))
    last = root.inv.step
    return [
        Counterfactual(
            f"does the fault {f'(to step {last}) ' if last > root.root else ''}remain with `{name}`'s "
            "second moment (and any other still empty) in tune with its gradient at the root step "
            "(exp_avg_sq = max(exp_avg_sq, grad^2))?",
            bool(found),
            f"in tune: update ratio {h.update_ratio_global or 0:.3g}"
            + (
                f" -> still {', '.join(found)}: the optimizer state is not the whole cause"
                if found
                else " -> no fault: the out-of-tune second moment is the cause"
            ),
        )
    ]


def _update_and_after(root: RootStep, around) -> tuple[StepHealth, list[str]]:
    """The root step with its update changed by the context manager `around`, then the
    recorded steps after it up to the requested one: the root step's health, and the
    anomalies an update can cause (the root step's own update explosion or non-finite
    weights; anything after it)."""
    root.fresh()
    dets = copy.deepcopy(root.dets)
    with around:
        h = root.replayer.run_step(root.runner, root.rec)
    found = [k for k in (e["kind"] for e in step_anomalies(h, dets)) if k in AFTER_AN_UPDATE]
    inv = root.inv
    for s in range(root.root + 1, inv.step + 1):
        later = inv.anomalies(root.replayer.run_step(root.runner, root.replayer.batch(s)), dets)
        found += [f"{k} at step {s}" for k in later]
    return h, found


def _older_state(root: RootStep, samples: list[SampleBlame]) -> list[Counterfactual]:
    """Blamed rows: the same batch from an older checkpoint (not the one the window started
    from, when there is another). Whether it faults there says whether the data alone does.
    A batch that faults there too is tried from the oldest checkpoint as well: a state primed
    a checkpoint or two before the symptom (a poisoned update) faults from both of the newer
    ones, not from the start of training."""
    older = [c for c in root.inv.run.checkpoints if c < root.root]
    if not older or not samples:
        return []
    c = older[-2] if older[-1] == root.start and len(older) > 1 else older[-1]
    h, found = _from_checkpoint(root, c)
    root.older_fault = faults_again(root)(found)
    if root.older_fault and older[0] < c:
        first = (c, h)
        c = older[0]
        h, found = _from_checkpoint(root, c)
        root.older_fault = faults_again(root)(found)
        if not root.older_fault:  # primed between the two
            return [
                Counterfactual(
                    f"does the same batch fail from the older model states at steps {first[0]} and {c}?",
                    False,
                    f"from checkpoint {first[0]}: loss {precise(first[1].loss, LOSS_NOT_KNOWN)} -> fails too; from "
                    f"checkpoint {c}: loss {precise(h.loss, LOSS_NOT_KNOWN)}, grad norm {h.grad_norm:.4g} -> no "
                    f"fault: it needs a model state reached after step {c}" + _others(found),
                )
            ]
    return [
        Counterfactual(
            f"does the same batch fail from the older model state at step {c}?",
            root.older_fault,
            f"from checkpoint {c}: loss {precise(h.loss, LOSS_NOT_KNOWN)}, grad norm {h.grad_norm:.4g}"
            + (
                " -> fails too: the data alone triggers it"
                if root.older_fault
                else " -> no fault: it needs this model state as well as this data" + _others(found)
            ),
        )
    ]


def _from_checkpoint(root: RootStep, c: int):
    """The root step's batch from checkpoint `c`'s state: its health and anomalies."""
    t = root.replayer.build()
    try:
        root.replayer.load_checkpoint(t, c)
        h = root.replayer.run_step(t, root.rec)
    finally:
        root.replayer.close(t)
    return h, root.fault(h)
