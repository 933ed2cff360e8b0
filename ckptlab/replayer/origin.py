"""The origin of the fault in the root step, and the rows it blames.

    o, samples = origin(root, tracer, h, data_rows(root), per_row(root))

Three cases, in order: the batch itself carries non-finite values (the origin is the data);
the per-op trace saw an op produce the first NaN/Inf (that op, its module and kind: numeric,
precision, optimizer, or data when its bad rows are absurd ones); nothing went non-finite in
the root step (a finite explosion: the rows that dominate it, Adam's second moment out of tune,
a learning-rate jump, or gradients that exploded with no row to blame).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ckptlab.analysis.batches import micro_row
from ckptlab.replayer.findings import Origin, SampleBlame
from ckptlab.replayer.optstate import SecondMomentGap, second_moment_gaps
from ckptlab.replayer.parameters import outsized_weight
from ckptlab.replayer.rootstep import RootStep
from ckptlab.replayer.rows import dominant_rows, nonfinite_alone, repeated_sample
from ckptlab.replayer.trace import OpEvent, Tracer
from ckptlab.run.manifest import OptimizerGroups
from ckptlab.training.health import StepHealth
from ckptlab.training.optimizer_set import key_text
from ckptlab.training.probe import named_parameters
from ckptlab.training.wrappers import unwrap

Samples = dict[int, SampleBlame]  # the blamed rows, by row across the step's micro-batches


def origin(
    root: RootStep,
    tracer: Tracer | None,
    h: StepHealth,
    data_rows: dict[str, dict[int, str]],
    rows: dict[int, StepHealth],
) -> tuple[Origin, list[SampleBlame]]:
    """The origin of the fault and the blamed rows, most to blame first. `h`: the root step
    replayed; `data_rows`: rows.data_rows; `rows`: rows.per_row (empty for a single row)."""
    samples: Samples = {}
    o = nonfinite_origin(root, tracer, data_rows, rows, samples)
    if o is None:
        o = _finite_explosion(root, h, data_rows["absurd"], rows, samples)
    if o.kind == "optimizer" and o.param_group is None:
        o.optimizer, o.param_group = root.optimizers.where(root.optimizers.of_parameter.get(o.parameter or ""))
    return o, _ranked(root, samples, data_rows, rows)


def nonfinite_origin(
    root: RootStep,
    tracer: Tracer | None,
    data_rows: dict[str, dict[int, str]],
    rows: dict[int, StepHealth],
    samples: Samples,
) -> Origin | None:
    """Where the root step's first non-finite value came from (the batch, or the first op that
    produced one), its rows blamed into `samples`; None when nothing went non-finite. Also the
    origin of a step that raised because a value went non-finite (a loss that checks its
    input's range, an `assert torch.isfinite`, clipping with `error_if_nonfinite`)."""
    ev: OpEvent | None = tracer.origin if tracer is not None else None
    if data_rows["nonfinite"]:
        return _nonfinite_batch(root, tracer, data_rows["nonfinite"], samples)
    if ev is not None:
        return _first_nonfinite_op(root, ev, data_rows["absurd"], nonfinite_alone(rows), samples)
    return None


RECENT_LR = 8  # steps


@dataclass
class LrJump:
    group: int  # the parameter group: its index in every step's `lr` (every optimizer's groups in order)
    factor: float  # how many times its recent value
    lr: float  # the root step's learning rate
    typical: float  # its recent value


def lr_jumps(m, root: int, h: StepHealth) -> list[LrJump]:
    """The parameter groups (of every optimizer) whose learning rate at the root step jumped
    more than tenfold over the recorded steps just before it (their median: the last
    RECENT_LR; a schedule restarted on resume jumps back to a rate the run had long before, so
    a longer history would hide it), the largest jump first."""
    hist = m.window(max(0, root - RECENT_LR), root - 1)
    if hist.stop <= hist.start or not h.lr:
        return []
    out = []
    for g, lr in enumerate(h.lr[: m.lr.shape[1]]):
        recent = m.lr[hist, g]
        if np.isnan(recent).all():  # a loop whose learning rate is unknown (a hand-written update without lr=)
            continue
        typical = float(np.nanmedian(recent))
        if typical > 0 and float(lr) > 10 * typical:
            out.append(LrJump(g, float(lr) / typical, float(lr), typical))
    return sorted(out, key=lambda j: -j.factor)


def group_text(groups: OptimizerGroups, group: int, groups_in_all: int) -> str:
    """A parameter group as a sentence names it: "optimizer `g`, group 0" (several
    optimizers), "group 1" (one optimizer with several groups), "" (the only group)."""
    key, local = groups.where(group)
    if key is not None:
        return f"optimizer {key_text(key)}, group {local}"
    return f"group {group}" if groups_in_all > 1 else ""


def lr_jump_text(groups: OptimizerGroups, jumps: list[LrJump], groups_in_all: int) -> str:
    """The jumps as the origin's detail says them, the largest first."""
    first, *rest = jumps
    where = group_text(groups, first.group, groups_in_all)
    text = (
        f"the learning rate of {where}, {first.lr:.3g}, is {first.factor:.0f}x its recent value"
        if where
        else f"learning rate {first.lr:.3g} is {first.factor:.0f}x its recent value"
    )
    also = "; ".join(f"{group_text(groups, j.group, groups_in_all)}: {j.factor:.0f}x" for j in rest[:3])
    return text + (f" (also {also})" if also else "")


def _blame(root: RootStep, samples: Samples, row: int, reason: str) -> None:
    if row in samples:
        samples[row].reason += "; " + reason
    else:
        samples[row] = SampleBlame(row, root.sample_id(row), reason, batch_row=row)


def _top_parameter(root: RootStep, in_group: int | None = None) -> str | None:
    """The parameter parameters.py blames most (of the parameter group `in_group`, when
    given and the run says which parameters are whose), if any."""
    of = root.optimizers.of_parameter
    blamed = [p.name for p in root.report.parameters if in_group is None or of.get(p.name) == in_group]
    return blamed[0] if blamed else None


def _nonfinite_batch(root: RootStep, tracer: Tracer | None, nonfinite: dict[int, str], samples: Samples) -> Origin:
    """The batch carries non-finite values: its rows are blamed, and the trace says where they
    enter the model."""
    for r, why in nonfinite.items():
        _blame(root, samples, r, why)
    events = tracer.events if tracer else []
    enters = next((e for e in events if e.phase == "forward" and any(not s.finite for s in e.inputs)), None)
    where = (
        f"; it enters the model at `{enters.module or '<root>'}` ({enters.op})"
        if enters is not None and enters.module is not None
        else ""
    )
    return Origin("data", "forward", None, None, None, None, detail="the batch carries non-finite values" + where)


def _first_nonfinite_op(
    root: RootStep, ev: OpEvent, absurd: dict[int, str], alone: dict[int, str], samples: Samples
) -> Origin:
    """The traced op that produced the step's first NaN/Inf: the rows its bad elements map
    to, and for a forward op in a module, the weight there that is out of scale (if one is)."""
    for r, n in sorted((ev.bad_rows or {}).items(), key=lambda kv: -kv[1]):
        _blame(root, samples, r, f"{n} non-finite value(s) first appear in this row at {ev.op}")
    for r, why in absurd.items():
        _blame(root, samples, r, why)
    if not samples:
        # The trace could not map the op to rows (e.g. a loss reduced over a micro-batch
        # of several rows): the rows that fail when replayed alone, the others not.
        for r, why in alone.items():
            _blame(root, samples, r, why)
    kind = _op_kind(ev, absurd)
    outsized = None
    if ev.phase == "forward" and ev.module is not None and kind == "numeric":
        root.fresh()  # the weights the root step started with (the replays left theirs)
        outsized = outsized_weight(unwrap(root.runner.model), ev.module)
    produced = "NaN" if ev.new_nan else "Inf"
    return Origin(
        kind,
        ev.phase,
        ev.module,
        ev.op,
        _top_parameter(root) if ev.phase != "forward" else outsized[0] if outsized else None,
        ev.source,
        call=ev.call,
        produced=produced,
        inputs_finite=all(x.finite for x in ev.inputs) and not ev.scalar_nonfinite,
        detail=f"{ev.op} produced {produced} from {'finite' if ev.new_inf else 'NaN-free'} inputs "
        f"({', '.join(s.describe() for s in ev.inputs[:3])})"
        + ("; in float32 the same op on the same inputs is finite" if kind == "precision" else "")
        + (f"; `{outsized[0]}` {outsized[1]}" if outsized else ""),
        dtype=ev.dtype,
    )


def _op_kind(ev: OpEvent, absurd: dict[int, str]) -> str:
    if absurd and (not ev.bad_rows or set(ev.bad_rows) <= set(absurd)):
        return "data"
    if ev.phase == "optimizer":
        return "optimizer"
    if ev.fp32_finite:  # the op overflowed in float16/bfloat16 only (trace.py)
        return "precision"
    return "numeric"


def _finite_explosion(
    root: RootStep, h: StepHealth, absurd: dict[int, str], rows: dict[int, StepHealth], samples: Samples
) -> Origin:
    """Nothing went non-finite in the root step itself: an explosion (finite) that breaks
    later. The rows that explain it, else the optimizer (its state, its learning rate), else
    the gradients with no row to blame."""
    jumps = lr_jumps(root.inv.metrics, root.root, h)
    alone, dominant = nonfinite_alone(rows), dominant_rows(rows)
    for r, why in absurd.items():
        _blame(root, samples, r, why)
    for r, why in alone.items():
        _blame(root, samples, r, why)
    for r, ratio in dominant.items():
        if r not in alone:
            _blame(root, samples, r, f"its gradient norm is {ratio:.3g}x the median row's")
    repeated = {} if samples or jumps else repeated_sample(root.ids, root.rows)
    for r, why in repeated.items():
        _blame(root, samples, r, why)
    param = _top_parameter(root)
    if absurd or dominant or alone or repeated:
        detail = (
            "an absurd value in the batch makes the gradients explode"
            if absurd
            else "a row alone makes the step non-finite"
            if alone
            else "one row dominates the update"
            if dominant
            else "one sample repeated across the batch is the whole update"
        )
        phase = None if alone and not (absurd or dominant) else "backward"
        return Origin("data", phase, None, None, param, None, detail=detail)
    if not jumps and (gaps := _second_moment_gaps(root, h)):
        g = gaps[0]
        return Origin("optimizer", "optimizer", None, None, g.name, None, detail=g.describe(), state="exp_avg_sq")
    if jumps:  # the group whose learning rate jumped most is the one to name
        key, local = root.optimizers.where(jumps[0].group)
        detail = lr_jump_text(root.optimizers, jumps, len(h.lr))
        param = most_moved(root, h, in_group=jumps[0].group) or _top_parameter(root, in_group=jumps[0].group) or param
        return Origin(
            "optimizer", "optimizer", None, None, param, None, detail=detail, optimizer=key, param_group=local
        )
    if "update_explosion" in root.fault(h):
        detail = "the update exploded without a gradient explosion"
        param = most_moved(root, h) or param
        key, local = root.optimizers.where(root.optimizers.of_parameter.get(param)) if param else (None, None)
        return Origin(
            "optimizer", "optimizer", None, None, param, None, detail=detail, optimizer=key, param_group=local
        )
    if root.report.parameters:
        detail = "gradients exploded with no single row to blame"
        return Origin("numeric", "backward", None, None, param, None, detail=detail)
    return Origin("none", None, None, None, None, None)


def most_moved(root: RootStep, h: StepHealth, in_group: int | None = None) -> str | None:
    """The parameter whose update moved it most against its own norm (the largest finite
    update ratio; of the parameter group `in_group`, when given and the run says which
    parameters are whose): the worst of an optimizer fault, whose gradients may be ordinary."""
    names, of = root.inv.metrics.param_names, root.optimizers.of_parameter
    ratios = [] if h.update_ratio is None else [float(r) for r in h.update_ratio]
    finite = [
        (r, i)
        for i, r in enumerate(ratios)
        if math.isfinite(r) and i < len(names) and (in_group is None or of.get(names[i], in_group) == in_group)
    ]
    return names[max(finite)[1]] if finite else None


def _second_moment_gaps(root: RootStep, h: StepHealth) -> list[SecondMomentGap]:
    """optstate.py's check, on the optimizer state the root step started in."""
    root.fresh()
    return second_moment_gaps(root.runner.optimizer, named_parameters(root.runner.model), h)


def _ranked(
    root: RootStep, samples: Samples, data_rows: dict[str, dict[int, str]], rows: dict[int, StepHealth]
) -> list[SampleBlame]:
    """The blamed rows with what else is wrong with their content, their own loss and gradient
    norm, and their place in an accumulated step; the largest gradient norm first."""
    for category in ("empty", "out_of_range"):
        for r, why in data_rows[category].items():
            if r in samples:
                samples[r].reason = why + "; " + samples[r].reason
    for r, row_h in rows.items():
        if r in samples:
            samples[r].loss, samples[r].grad_norm = row_h.loss, row_h.grad_norm
    for s in samples.values():  # an accumulated step: the row within its micro-batch
        where = micro_row(root.rec.batch, s.row, root.rows)
        if where is not None:
            s.batch_row, (s.micro_batch, s.row) = s.row, where

    def norm(s: SampleBlame) -> float:
        if s.grad_norm is None:
            return 0
        return s.grad_norm if math.isfinite(s.grad_norm) else math.inf

    return sorted(samples.values(), key=lambda s: -norm(s))
