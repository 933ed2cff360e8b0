"""Blame the root step of a fault: trace it per op, name the rows (with their sample ids) and
the parameters, find the origin, and prove the blame by counterfactual replay.

    Blame(investigation, window).explain(report, trace, counterfactuals)   # window.root: the root step

Works on the state the root step started in (a snapshot), re-running the step as often as it
needs: once traced, once plain, once per row, once without the blamed rows, and from an older
checkpoint or with the recent learning rate.
"""

from __future__ import annotations

import copy
import math
import time
import warnings

import numpy as np
import torch

from ckptlab.analysis.anomalies import UPDATE_EXPLOSION, step_anomalies
from ckptlab.analysis.batches import batch_rows, micro_row, python_leaves, row_groups, select_rows
from ckptlab.analysis.spikes import GRAD_RULE
from ckptlab.errors import CkptlabError
from ckptlab.numbers import same
from ckptlab.replayer.findings import Counterfactual, Origin, ParameterBlame, ReplayReport, SampleBlame
from ckptlab.replayer.optstate import SecondMomentGap, in_tune, second_moment_gaps
from ckptlab.replayer.precision import in_float32
from ckptlab.replayer.search import doomed_earlier, minimal_culprit
from ckptlab.replayer.trace import OpEvent, Tracer
from ckptlab.run.reader import Run
from ckptlab.run.records import NO_GRAD
from ckptlab.training.crash import is_step_error
from ckptlab.training.probe import StepHealth, named_parameters
from ckptlab.training.state import restore_snapshot, unwrap

# A row is "absurd" when its largest |value| is this many times the run's typical row maximum
# for the same field (median over the retained batches).
ABSURD_RATIO = 1e3
# A row dominates a step when its own gradient norm is this many times the median row's.
DOMINANT_ROW_RATIO = 10.0
# The anomalies of a step that its own update causes (spikes of its loss and gradient come
# before the update).
AFTER_AN_UPDATE = ("update_explosion", "nonfinite_weight")
# The ignore_index of PyTorch's cross-entropy (and Hugging Face's label padding): a row whose
# targets are all this value has nothing to train on, and a mean over it is 0/0.
IGNORE_INDEX = -100


class Blame:
    """Everything about the root step: trace, rows, parameters, counterfactuals, origin."""

    def __init__(self, inv, window):
        """`inv`: the Investigation (its run, replayer, record and timing); `window`: the
        replayed window whose root step is blamed, with the state that step started in."""
        self.inv, self.root, self.start = inv, window.root, window.start
        self.snap, self.dets = window.root_state, window.root_detectors
        self.replayer = inv.replayer
        self.rec = self.replayer.batch(self.root)
        self.ids = self.rec.sample_ids
        self.rows = batch_rows(self.rec.batch, self.ids)
        self.trainee = self.replayer.build()
        self.older_fault: bool | None = None  # the same batch from an older checkpoint: faults?

    def close(self) -> None:
        self.replayer.close(self.trainee)

    def fresh(self) -> None:
        restore_snapshot(
            self.snap,
            self.trainee.model,
            self.trainee.optimizer,
            self.trainee.scheduler,
            self.trainee.scaler,
            rank=self.replayer.rank,
        )

    def step(self, batch=None, tracer=None) -> StepHealth:
        self.fresh()
        return self.replayer.run_step(self.trainee, self.rec, batch, tracer=tracer)

    def fault(self, h: StepHealth) -> list[str]:
        return [e["kind"] for e in step_anomalies(h, copy.deepcopy(self.dets))]

    def sample_id(self, row: int):
        return self.ids[row] if self.ids is not None and row < len(self.ids) else None

    def explain(self, rep: ReplayReport, do_trace: bool, do_counterfactuals: bool, dump=None) -> None:
        """`dump`: a DumpRequest (dump.py): the root step replayed once more, its tensors kept
        in `self.captured` for the investigation to write once the verdict is said."""
        self.report = rep
        t0 = time.perf_counter()
        tracer = None
        if do_trace:
            self.inv.log(f"tracing step {self.root} per op")
            tracer = Tracer(self.trainee.model, self.trainee.optimizer, rows=self.rows, batch=self.rec.batch)
            traced = self.step(tracer=tracer)
            if self.replayer.compiled:  # the Tracer ran it with torch.compile off
                rep.trace_eager = True
                rep.notes.append(
                    "the per-op trace ran eagerly: its dispatch modes cannot see inside torch.compile's graphs"
                )
            if not same(traced.loss, rep.steps[self.root - rep.start_checkpoint].loss):
                rep.notes.append(
                    "the traced step's loss differs from the plain replay (tracing changed the kernels used)"
                )
            rep.chain = [_event_json(e) for e in tracer.chain()]
            self.inv.timing["trace_s"] = time.perf_counter() - t0
        base = self.base = self.step()  # the root step as replayed, for parameter blame
        data_rows = self.data_rows()
        rows = self.per_row() if self.rows and self.rows > 1 else {}
        rep.parameters = self.parameters(base)
        rep.origin, rep.samples = self.origin(tracer, base, data_rows, rows)
        if do_counterfactuals:
            rep.counterfactuals = self.counterfactuals(rep.samples)
            self.search(rep)
        if dump is not None:
            from ckptlab.replayer.dump import capture_root_step

            t1 = time.perf_counter()
            self.inv.log(f"copying the tensors of step {self.root} for {dump.path}")
            self.captured = capture_root_step(self, tracer.origin if tracer is not None else None, dump)
            self.inv.timing["dump_capture_s"] = time.perf_counter() - t1
        self.replayer.close(self.trainee)
        self.inv.timing["blame_s"] = time.perf_counter() - t0

    def explain_crash(self, rep: ReplayReport, crash: dict) -> None:
        """The root step raised (`crash`: training/crash.py's description): the origin is the
        exception where the user's code raised it; a row is blamed when its content is wrong
        (empty, token ids out of range, non-finite) or when it raises the same exception
        alone through the step; then: does the step run without the blamed rows?"""
        self.report = rep
        t0 = time.perf_counter()
        rep.origin = Origin(
            "exception",
            crash.get("phase"),
            crash.get("module"),
            crash.get("type"),
            None,
            crash.get("source"),
            call=crash.get("call"),
            detail=crash.get("message"),
        )
        samples: dict[int, SampleBlame] = {}
        content = self.data_rows()
        for category in ("out_of_range", "empty", "nonfinite", "absurd"):
            for r, why in content[category].items():
                samples.setdefault(r, SampleBlame(r, self.sample_id(r), why, batch_row=r))
        alone: dict[int, bool] = {}
        if self.rows and self.rows > 1:
            for r in range(self.rows):
                alone[r] = self.raises_like(crash, select_rows(self.rec.batch, [r], self.rows))
            if all(alone.values()):
                rep.notes.append(
                    f"every row raises {crash.get('type')} alone: no row is to blame (the code, the batch's "
                    "shape or the model state is)"
                )
            elif not any(alone.values()):
                rep.notes.append(
                    f"no row raises {crash.get('type')} alone: the step fails on the batch as a whole (its size or "
                    "shape), not on one sample"
                )
            else:
                for r in (r for r, raised in alone.items() if raised):
                    why = f"raises {crash.get('type')} alone through the step"
                    if r in samples:
                        samples[r].reason += "; " + why
                    else:
                        samples[r] = SampleBlame(r, self.sample_id(r), why, batch_row=r)
        for sb in samples.values():  # an accumulated step: the row within its micro-batch
            where = micro_row(self.rec.batch, sb.row)
            if where is not None:
                sb.batch_row, (sb.micro_batch, sb.row) = sb.row, where
        rep.samples = sorted(samples.values(), key=lambda sb: (not alone.get(sb.batch_row, False), sb.batch_row))
        keep = [r for r in range(self.rows or 0) if r not in {sb.batch_row for sb in rep.samples}]
        if rep.samples and keep:
            ids = ", ".join(str(sb.sample_id) for sb in rep.samples[:5])
            raised = self.raises_like(crash, select_rows(self.rec.batch, keep, self.rows), any_error=True)
            rep.counterfactuals.append(
                Counterfactual(
                    f"does step {self.root} still raise without the blamed rows ({ids})?",
                    raised,
                    "without them the step still raises" if raised else "without them the step runs",
                )
            )
        self.replayer.close(self.trainee)
        self.inv.timing["blame_s"] = time.perf_counter() - t0

    def raises_like(self, crash: dict, batch, *, any_error: bool = False) -> bool:
        """Does the root step, on `batch` from the root's state, raise the step's own
        exception (of the same type, unless `any_error`)?"""
        try:
            self.step(batch)
        except Exception as e:  # noqa: BLE001 - the user's code raising is what is measured
            if not is_step_error(e):
                raise
            return any_error or type(e).__qualname__ == crash.get("type")
        return False

    # rows ------------------------------------------------------------------------------------------

    def data_rows(self) -> dict[str, dict[int, str]]:
        """What is wrong with each row's content, by category: "nonfinite" values, "absurd"
        values (against the run's own typical row maximum per field), "empty" rows (all
        padding, when the run's data_info names pad_id), token ids "out_of_range"."""
        found: dict[str, dict[int, str]] = {"nonfinite": {}, "absurd": {}, "empty": {}, "out_of_range": {}}
        if not self.rows:
            return found
        info = self.inv.run.manifest.get("data_info") or {}
        pad, vocab = info.get("pad_id"), info.get("vocab_size")
        ignore = info.get("ignore_index", IGNORE_INDEX)
        typical = _typical_row_absmax(self.inv.run, self.root)
        for first, path, flat in _row_leaves(self.rec.batch, self.rows):
            if not flat.is_floating_point():
                for row in range(first, first + flat.shape[0]):
                    if pad is not None and flat.shape[1] and bool((flat[row - first] == pad).all()):
                        found["empty"].setdefault(row, f"batch{path} is empty (all padding, id {pad})")
                    elif pad != ignore and flat.shape[1] > 1 and bool((flat[row - first] == ignore).all()):
                        found["empty"].setdefault(
                            row, f"batch{path} is empty (every target is {ignore}, the ignore_index)"
                        )
                    ids = flat[row - first][flat[row - first] != ignore]  # an ignored label is not a token id
                    if vocab is not None and ids.numel() and (int(ids.max()) >= vocab or int(ids.min()) < 0):
                        found["out_of_range"].setdefault(row, f"batch{path} has token ids outside [0, {vocab})")
                continue
            flat = flat.float()
            bad = (~torch.isfinite(flat)).sum(dim=1)
            finite = torch.where(torch.isfinite(flat), flat.abs(), torch.zeros_like(flat))
            absmax = finite.max(dim=1).values if flat.shape[1] else torch.zeros(flat.shape[0])
            for i in range(flat.shape[0]):
                row = first + i
                if int(bad[i]):
                    found["nonfinite"].setdefault(row, f"{int(bad[i])} non-finite value(s) in batch{path}")
                elif path in typical and typical[path] > 0 and float(absmax[i]) > ABSURD_RATIO * typical[path]:
                    found["absurd"].setdefault(
                        row,
                        f"batch{path} reaches |x|={float(absmax[i]):.3g}, {float(absmax[i]) / typical[path]:.3g}x the run's typical {typical[path]:.3g}",
                    )
        return found

    def per_row(self) -> dict[int, StepHealth]:
        """Each row alone through the step: its own loss and gradient norm."""
        out = {}
        for row in range(self.rows):
            try:
                out[row] = self.step(select_rows(self.rec.batch, [row], self.rows))
            except Exception:  # noqa: BLE001 - a model that cannot take one row (BatchNorm...)
                return {}
        return out

    # parameters -------------------------------------------------------------------------------------

    def parameters(self, h: StepHealth) -> list[ParameterBlame]:
        m = self.inv.metrics
        names = m.param_names
        hist = m.window(max(0, self.root - 128), self.root - 1)
        typical = np.full(len(names), np.nan)
        if hist.stop > hist.start:
            with warnings.catch_warnings():  # a parameter that never had a gradient: NaN, said below
                warnings.simplefilter("ignore", RuntimeWarning)
                typical = np.nanmedian(np.where(m.param_grad_norm[hist] >= 0, m.param_grad_norm[hist], np.nan), axis=0)
        out = []
        for i, name in enumerate(names):
            g = float(h.param_grad_norm[i])
            nf = int(h.param_nonfinite[i]) if h.param_nonfinite is not None else 0
            ratio = float(h.update_ratio[i]) if h.update_ratio is not None else None
            w = float(h.weight_norm[i]) if h.weight_norm is not None else None
            typ = float(typical[i]) if i < len(typical) and math.isfinite(typical[i]) else None
            reasons = []
            if nf or (g != NO_GRAD and not math.isfinite(g)):
                reasons.append(f"{nf} non-finite gradient elements" if nf > 0 else "non-finite gradient")
            if w is not None and not math.isfinite(w):
                reasons.append("weights went non-finite")
            if typ and math.isfinite(g) and g > GRAD_RULE.min_ratio * 5 * typ:
                reasons.append(f"gradient norm {g:.3g} is {g / typ:.0f}x its typical {typ:.3g}")
            if ratio is not None and math.isfinite(ratio) and ratio > UPDATE_EXPLOSION:
                reasons.append(f"update moved the weights by {ratio:.3g}x their norm")
            elif ratio is not None and not math.isfinite(ratio) and w is not None and math.isfinite(w):
                pass  # a zero-initialized tensor's first move: not an explosion
            if reasons:
                out.append(ParameterBlame(name, "; ".join(reasons), g if g != NO_GRAD else None, typ, nf, ratio, w))
        out.sort(
            key=lambda p: (
                -p.nonfinite_grad,
                -(
                    p.grad_norm / p.typical_grad_norm
                    if p.grad_norm and p.typical_grad_norm and math.isfinite(p.grad_norm)
                    else (math.inf if p.grad_norm is not None and not math.isfinite(p.grad_norm) else 0)
                ),
                -(p.update_ratio or 0),
            )
        )
        return out

    # the origin ----------------------------------------------------------------------------------------

    def origin(
        self, tracer: Tracer | None, h: StepHealth, data_rows: dict[str, dict[int, str]], rows: dict[int, StepHealth]
    ):
        samples: dict[int, SampleBlame] = {}

        def blame(row: int, reason: str) -> None:
            if row in samples:
                samples[row].reason += "; " + reason
            else:
                samples[row] = SampleBlame(row, self.sample_id(row), reason, batch_row=row)

        ev: OpEvent | None = tracer.origin if tracer is not None else None
        nonfinite_in_batch, absurd = data_rows["nonfinite"], data_rows["absurd"]
        dominant = _dominant_rows(rows)
        alone = _nonfinite_alone(rows)
        param = self.report.parameters[0].name if self.report.parameters else None

        if nonfinite_in_batch:
            for r, why in nonfinite_in_batch.items():
                blame(r, why)
            enters = next(
                (
                    e
                    for e in (tracer.events if tracer else [])
                    if e.phase == "forward" and any(not s.finite for s in e.inputs)
                ),
                None,
            )
            where = (
                f"; it enters the model at `{enters.module or '<root>'}` ({enters.op})"
                if enters is not None and enters.module is not None
                else ""
            )
            o = Origin("data", "forward", None, None, None, None, detail="the batch carries non-finite values" + where)
        elif ev is not None:
            for r, n in sorted((ev.bad_rows or {}).items(), key=lambda kv: -kv[1]):
                blame(r, f"{n} non-finite value(s) first appear in this row at {ev.op}")
            for r, why in absurd.items():
                blame(r, why)
            if not samples:
                # The trace could not map the op to rows (e.g. a loss reduced over a micro-batch
                # of several rows): the rows that fail when replayed alone, the others not.
                for r, why in alone.items():
                    blame(r, why)
            kind = "numeric"
            if absurd and (not ev.bad_rows or set(ev.bad_rows) <= set(absurd)):
                kind = "data"
            elif ev.phase == "optimizer":
                kind = "optimizer"
            elif ev.fp32_finite:  # the op overflowed in float16/bfloat16 only (trace.py)
                kind = "precision"
            if ev.phase == "forward" and ev.module is not None and kind == "numeric":
                self.fresh()  # the weights the root step started with (the replays left theirs)
            outsized = (
                outsized_weight(unwrap(self.trainee.model), ev.module)
                if ev.phase == "forward" and ev.module is not None and kind == "numeric"
                else None
            )
            o = Origin(
                kind,
                ev.phase,
                ev.module,
                ev.op,
                param if ev.phase != "forward" else outsized[0] if outsized else None,
                ev.source,
                call=ev.call,
                produced="NaN" if ev.new_nan else "Inf",
                inputs_finite=all(x.finite for x in ev.inputs) and not ev.scalar_nonfinite,
                detail=f"{ev.op} produced {'NaN' if ev.new_nan else 'Inf'} from {'finite' if ev.new_inf else 'NaN-free'} inputs "
                f"({', '.join(s.describe() for s in ev.inputs[:3])})"
                + ("; in float32 the same op on the same inputs is finite" if kind == "precision" else "")
                + (f"; `{outsized[0]}` {outsized[1]}" if outsized else ""),
                dtype=ev.dtype,
            )
        else:
            # Nothing went non-finite in the root step itself: an explosion (finite) that breaks later.
            lr_jump = _lr_jump(self.inv.metrics, self.root, h)
            for r, why in absurd.items():
                blame(r, why)
            for r, why in alone.items():
                blame(r, why)
            for r, ratio in dominant.items():
                if r not in alone:
                    blame(r, f"its gradient norm is {ratio:.3g}x the median row's")
            repeated = {} if samples or lr_jump else _repeated_sample(self.ids, self.rows)
            for r, why in repeated.items():
                blame(r, why)
            if absurd or dominant or alone or repeated:
                o = Origin(
                    "data",
                    None if alone and not (absurd or dominant) else "backward",
                    None,
                    None,
                    param,
                    None,
                    detail="an absurd value in the batch makes the gradients explode"
                    if absurd
                    else "a row alone makes the step non-finite"
                    if alone
                    else "one row dominates the update"
                    if dominant
                    else "one sample repeated across the batch is the whole update",
                )
            elif lr_jump is None and (gaps := self.second_moment_gaps(h)):
                g = gaps[0]
                o = Origin("optimizer", "optimizer", None, None, g.name, None, detail=g.describe(), state="exp_avg_sq")
            elif lr_jump is not None or "update_explosion" in self.fault(h):
                detail = (
                    f"learning rate {lr_jump[1]:.3g} is {lr_jump[0]:.0f}x its recent value"
                    if lr_jump
                    else "the update exploded without a gradient explosion"
                )
                o = Origin("optimizer", "optimizer", None, None, param, None, detail=detail)
            elif self.report.parameters:
                o = Origin(
                    "numeric",
                    "backward",
                    None,
                    None,
                    param,
                    None,
                    detail="gradients exploded with no single row to blame",
                )
            else:
                o = Origin("none", None, None, None, None, None)
        for category in ("empty", "out_of_range"):
            for r, why in data_rows[category].items():
                if r in samples:
                    samples[r].reason = why + "; " + samples[r].reason
        for r, row_h in rows.items():
            if r in samples:
                samples[r].loss, samples[r].grad_norm = row_h.loss, row_h.grad_norm
        for s in samples.values():  # an accumulated step: the row within its micro-batch
            where = micro_row(self.rec.batch, s.row)
            if where is not None:
                s.batch_row, (s.micro_batch, s.row) = s.row, where
        ranked = sorted(
            samples.values(),
            key=lambda s: (
                -(
                    s.grad_norm
                    if s.grad_norm is not None and math.isfinite(s.grad_norm)
                    else math.inf
                    if s.grad_norm is not None
                    else 0
                )
            ),
        )
        return o, ranked

    def in_float32(self, o: Origin) -> list[Counterfactual]:
        """The root step with the origin's module in float32, then (if that is not enough)
        the whole model: which part must stay in float32 for the fault to go away."""
        out = []
        for path in dict.fromkeys([o.module, ""]):
            what = f"`{path}`" if path else "the whole model"
            t = self.replayer.build()
            try:
                restore_snapshot(self.snap, t.model, t.optimizer, t.scheduler, t.scaler, rank=self.replayer.rank)
                with in_float32(t.model, path):
                    h = self.replayer.run_step(t, self.rec)
                found = self.fault(h)
            except Exception as e:  # noqa: BLE001 - a model that cannot run this part in float32
                out.append(Counterfactual(f"does step {self.root} still fail with {what} in float32?", None, str(e)))
                continue
            finally:
                self.replayer.close(t)
            # The fault here is the non-finite value; a spike that remains in float32 is an
            # outlier's, which float32 survives.
            nonfinite = [k for k in found if k.startswith("nonfinite")]
            out.append(
                Counterfactual(
                    f"does step {self.root} still go non-finite with {what} in float32?",
                    bool(nonfinite),
                    f"in float32: loss {h.loss:.6g}, grad norm {h.grad_norm:.4g}"
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

    def second_moment_gaps(self, h: StepHealth) -> list[SecondMomentGap]:
        """optstate.py's check, on the optimizer state the root step started in."""
        self.fresh()
        return second_moment_gaps(self.trainee.optimizer, named_parameters(self.trainee.model), h)

    def update_and_after(self, around) -> tuple[StepHealth, list[str]]:
        """The root step with its update changed by the context manager `around`, then the
        recorded steps after it up to the requested one: the root step's health, and the
        anomalies an update can cause (the root step's own update explosion or non-finite
        weights; anything after it)."""
        self.fresh()
        dets = copy.deepcopy(self.dets)
        with around:
            h = self.replayer.run_step(self.trainee, self.rec)
        found = [k for k in (e["kind"] for e in step_anomalies(h, dets)) if k in AFTER_AN_UPDATE]
        for s in range(self.root + 1, self.inv.step + 1):
            found += [
                f"{k} at step {s}"
                for k in self.inv.anomalies(self.replayer.run_step(self.trainee, self.replayer.batch(s)), dets)
            ]
        return h, found

    # the deeper searches (search.py) ---------------------------------------------------------------

    def search(self, rep: ReplayReport) -> None:
        """Within the investigation's budget of replays: the minimal culprit of a fault with
        blamed rows, and the earlier step that doomed a fault the batch alone does not explain
        (it needs this model state, or no row is to blame)."""
        budget = self.inv.budget
        if budget.limit <= 0:
            return
        t0 = time.perf_counter()
        self.inv.log(f"searching for the minimal culprit of step {self.root}")
        rep.culprit = minimal_culprit(self, budget)
        # an optimizer origin already explained: a learning-rate jump, or its own state
        explained = rep.origin.kind == "optimizer" and (
            rep.origin.state is not None or _lr_jump(self.inv.metrics, self.root, self.base) is not None
        )
        doomed = self.older_fault is False or (not rep.samples and rep.origin.kind != "none" and not explained)
        if doomed and self.inv.run.world_size == 1:  # (one process replays one rank: no window)
            self.inv.log(f"looking for an earlier step that doomed step {self.root}")
            rep.rewind = doomed_earlier(self, budget)
        rep.budget = budget.to_json()
        self.inv.timing["search_s"] = time.perf_counter() - t0

    # counterfactuals ------------------------------------------------------------------------------------

    def counterfactuals(self, samples: list[SampleBlame]) -> list[Counterfactual]:
        out = []
        if samples and self.rows:
            keep = [r for r in range(self.rows) if r not in {s.batch_row for s in samples}]
            ids = ", ".join(str(s.sample_id) for s in samples[:5])
            if keep:
                h = self.step(select_rows(self.rec.batch, keep, self.rows))
                found = self.fault(h)
                out.append(
                    Counterfactual(
                        f"does step {self.root} still fail without the blamed rows ({ids})?",
                        bool(found),
                        f"without them: loss {h.loss:.6g}, grad norm {h.grad_norm:.4g}"
                        + (f" -> still {', '.join(found)}" if found else " -> the fault vanishes"),
                    )
                )
            else:
                out.append(
                    Counterfactual(
                        f"does step {self.root} still fail without the blamed rows?",
                        None,
                        "every row is blamed; nothing left to run",
                    )
                )
        lr = _lr_jump(self.inv.metrics, self.root, self.base) if self.report.origin.kind == "optimizer" else None
        if lr is not None:
            typical = lr[1] / lr[0]
            self.fresh()
            for g in self.trainee.optimizer.param_groups:
                g["lr"] = typical
            h = self.replayer.run_step(self.trainee, self.rec)
            found = self.fault(h)
            out.append(
                Counterfactual(
                    f"does step {self.root} still fail with its recent learning rate {typical:.3g} instead of {lr[1]:.3g}?",
                    bool(found),
                    f"with lr {typical:.3g}: loss {h.loss:.6g}, update ratio {h.update_ratio_global or 0:.3g}"
                    + (f" -> still {', '.join(found)}" if found else " -> no fault: the learning rate is the cause"),
                )
            )
        o = self.report.origin
        if o.kind == "precision":  # answered by the trace: the origin op re-run in float32
            out.append(
                Counterfactual(
                    f"does {o.op} still produce {o.produced} in float32 on the same inputs?",
                    False,
                    f"in {o.dtype} it produced {o.produced}; in float32 it is finite -> a reduced-precision overflow",
                )
            )
        if o.kind == "precision" and o.module is not None:
            out.extend(self.in_float32(o))
        if self.report.origin.state == "exp_avg_sq":
            name = self.report.origin.parameter
            param = dict(named_parameters(self.trainee.model)).get(name)
            if param is not None:
                h, found = self.update_and_after(in_tune(self.trainee.optimizer, param))
                last = self.inv.step
                out.append(
                    Counterfactual(
                        f"does the fault {f'(to step {last}) ' if last > self.root else ''}remain with `{name}`'s "
                        "second moment in tune with its gradient at the root step (exp_avg_sq = max(exp_avg_sq, grad^2))?",
                        bool(found),
                        f"in tune: update ratio {h.update_ratio_global or 0:.3g}"
                        + (
                            f" -> still {', '.join(found)}: the optimizer state is not the whole cause"
                            if found
                            else " -> no fault: the out-of-tune second moment is the cause"
                        ),
                    )
                )
        older = [c for c in self.inv.run.checkpoints if c < self.root]
        if older and samples:
            c = older[0] if older[-1] == self.root else older[-1]
            if c == self.start and len(older) > 1:
                c = older[-2]
            t = self.replayer.build()
            self.replayer.load_checkpoint(t, c)
            h = self.replayer.run_step(t, self.rec)
            self.replayer.close(t)
            found = self.fault(h)
            self.older_fault = bool(found)
            out.append(
                Counterfactual(
                    f"does the same batch fail from the older model state at step {c}?",
                    bool(found),
                    f"from checkpoint {c}: loss {h.loss:.6g}, grad norm {h.grad_norm:.4g}"
                    + (
                        " -> fails too: the data alone triggers it"
                        if found
                        else " -> no fault: it needs this model state as well as this data"
                    ),
                )
            )
        return out


# --- parameters ------------------------------------------------------------------------------------

# A weight this many times its peers' RMS (the same parameter in sibling modules: heads.0.fc.weight
# for heads.2.fc.weight), or with no peers this many times the RMS of PyTorch's default init
# (uniform in +-1/sqrt(fan_in)), is outsized: a bad init or a corrupted load, not training.
OUTSIZED_VS_PEERS = 30.0
OUTSIZED_VS_INIT = 100.0


def outsized_weight(model, module: str) -> tuple[str, str] | None:
    """(parameter name, why) for the weight of `module`'s subtree most out of scale with its
    peers (or, without peers, with a default init), when one is: the forward op that went
    non-finite in `module` did so because of that weight, not of its input."""
    params = dict(named_parameters(model))
    prefix = f"{module}." if module else ""
    peers: dict[tuple, list[str]] = {}  # heads.2.fc.weight, heads.0.fc.weight -> heads.#.fc.weight
    for name, p in params.items():
        peers.setdefault((_peer_key(name), tuple(p.shape)), []).append(name)
    rms = {name: _rms(p) for name, p in params.items() if p.dim() >= 2 and p.is_floating_point()}
    best = None
    for name, own in rms.items():
        if not name.startswith(prefix) or not math.isfinite(own) or own == 0:
            continue
        others = [o for o in peers[(_peer_key(name), tuple(params[name].shape))] if o != name]
        peer_rms = [r for r in (rms[o] for o in others) if math.isfinite(r) and r > 0]
        if peer_rms:
            typical = float(np.median(peer_rms))
            against, limit = (
                f"its peers' ({', '.join(others[:2])}{', ...' if len(others) > 2 else ''})",
                OUTSIZED_VS_PEERS,
            )
        elif _default_init_is_kaiming(model, name):
            fan_in = params[name][0].numel()
            typical = 1.0 / math.sqrt(3.0 * fan_in)
            against, limit = f"a default init for fan-in {fan_in}", OUTSIZED_VS_INIT
        else:
            continue
        ratio = own / typical
        if ratio > limit and (best is None or ratio > best[0]):
            best = (ratio, name, f"has RMS {own:.3g}, {ratio:.0f}x {against} ({typical:.3g})")
    return (best[1], best[2]) if best else None


def _peer_key(name: str) -> str:
    """The parameter's name with its layer indices blanked: what its peers share."""
    return ".".join("#" if part.isdigit() else part for part in name.split("."))


def _default_init_is_kaiming(model, name: str) -> bool:
    """The weight of a Linear or convolution (their default init is uniform in
    +-1/sqrt(fan_in)); not an Embedding's (N(0, 1)) or a custom module's."""
    owner, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(owner) if owner else model
    except AttributeError:
        return False
    return attr == "weight" and isinstance(module, (torch.nn.Linear, torch.nn.modules.conv._ConvNd))


def _rms(t) -> float:
    with torch.no_grad():
        return float(t.detach().float().pow(2).mean().sqrt())


# --- rows -----------------------------------------------------------------------------------------


def _typical_row_absmax(run: Run, step: int, max_batches: int = 32) -> dict[str, float]:
    """Median per-row max |value| per float field, over retained batches near `step`."""
    steps = [s for s in run.steps if s != step]
    steps = sorted(steps, key=lambda s: abs(s - step))[:max_batches]
    per_field: dict[str, list[float]] = {}
    for s in steps:
        try:
            batch, ids = run.batch(s)
        except CkptlabError:
            continue
        for _, path, flat in _row_leaves(batch, batch_rows(batch, ids), of_any_rows=True):
            if flat.is_floating_point() and flat.numel():
                flat = flat.float()
                finite = torch.where(torch.isfinite(flat), flat.abs(), torch.zeros_like(flat))
                per_field.setdefault(path, []).extend(finite.max(dim=1).values.tolist())
    return {k: float(np.median(v)) for k, v in per_field.items() if v}


def _row_leaves(batch, rows: int | None, *, of_any_rows: bool = False):
    """(first row, path, tensor as (rows, -1)) for each non-boolean tensor leaf with one entry
    per row (`of_any_rows`: of any first dimension), micro-batch by micro-batch when the batch
    records an accumulated step; paths are within the micro-batch."""
    for first, part, n in row_groups(batch, rows):
        for path, leaf in python_leaves(part):
            if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or leaf.dtype == torch.bool:
                continue
            if of_any_rows or leaf.shape[0] == n:
                yield first, path, leaf.detach().reshape(leaf.shape[0], -1)


def _dominant_rows(rows: dict[int, StepHealth]) -> dict[int, float]:
    if len(rows) < 2:
        return {}
    norms = {r: h.grad_norm for r, h in rows.items()}
    finite = [v for v in norms.values() if math.isfinite(v)]
    med = float(np.median(finite)) if finite else 0.0
    out = {}
    for r, v in norms.items():
        if not math.isfinite(v) or (med > 0 and v > DOMINANT_ROW_RATIO * med):
            out[r] = v / med if med > 0 and math.isfinite(v) else math.inf
    return out if len(out) < len(rows) / 2 else {}


def _repeated_sample(ids, rows: int | None) -> dict[int, str]:
    """The rows of one sample id that fills more than half of the batch (a sampler or collation
    bug): no row stands out from the others, yet that one sample drives the whole update."""
    if ids is None or not rows or rows < 3 or len(ids) != rows:
        return {}
    counts: dict = {}
    for sid in ids:
        counts[sid] = counts.get(sid, 0) + 1
    sid, n = max(counts.items(), key=lambda kv: kv[1])
    if n <= rows // 2:
        return {}
    return {r: f"sample {sid} fills {n} of the batch's {rows} rows" for r in range(rows) if ids[r] == sid}


def _nonfinite_alone(rows: dict[int, StepHealth]) -> dict[int, str]:
    """The rows whose step alone has a non-finite loss or gradient norm while most rows' is
    finite: the culprits, however `step_fn` splits or reduces the batch."""
    bad = {r: h for r, h in rows.items() if not (math.isfinite(h.loss) and math.isfinite(h.grad_norm))}
    if not bad or len(bad) > len(rows) // 2:
        return {}
    return {
        r: f"alone through the step, its loss is {h.loss:.4g} and gradient norm {h.grad_norm:.4g} "
        "(the other rows' are finite)"
        for r, h in bad.items()
    }


def _lr_jump(m, root: int, h: StepHealth) -> tuple[float, float] | None:
    hist = m.window(max(0, root - 32), root - 1)
    if hist.stop <= hist.start or not h.lr:
        return None
    typical = float(np.nanmedian(m.lr[hist, 0]))
    lr = float(h.lr[0])
    if typical > 0 and lr > 10 * typical:
        return lr / typical, lr
    return None


def _event_json(e: OpEvent) -> dict:
    return {
        "phase": e.phase,
        "module": e.module,
        "op": e.op,
        "call": e.call,
        "source": e.source,
        "inputs": [s.describe() for s in e.inputs[:4]],
        "outputs": [s.describe() for s in e.outputs[:2]],
        "rows": sorted((e.bad_rows or {}).keys())[:16],
    }
