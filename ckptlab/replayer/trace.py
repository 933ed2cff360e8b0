"""Trace one training step per op and per element, forward, backward and optimizer.

    with Tracer(model, optimizer, rows=16) as tracer:
        loss = step_fn(model, optimizer, batch)
    tracer.origin          # the op that produced the fault's first non-finite values from clean inputs
    tracer.events          # every op: phase, aten name, module path, user source line, input
                           # and output summaries (shape, dtype, NaN/Inf counts, abs max)

How an op is placed:
- the aten op name comes from a TorchDispatchMode (below autograd, so backward ops are seen);
- the user-level call (`softmax`, `linear`) and its source line come from a TorchFunctionMode
  (above autograd), which also stamps every autograd node it creates with (call, module,
  source); in backward, `torch._C._current_autograd_node()` finds that stamp, so a backward op
  is charged to the module whose forward created it;
- the module path comes from global forward pre/post hooks (a stack of module names);
- compiled code (torch.compile) runs eagerly while traced: the modes cannot see inside its
  graphs (the report says so, `trace_eager`);
- the rows an op works on: the batch's rows, unless `step_fn` runs the model on a slice of the
  batch (a micro-batch loop): each forward of the root model is matched to the rows of the
  recorded batch it was given (its input is a view into the batch: the view's offset says
  which rows; else micro-batches are taken in order), and the forward and backward ops until
  the next such forward map their elements into those rows. A scalar (a micro-batch's loss)
  maps to its row when the micro-batch is one row. A batch recorded as micro-batches
  (gradient accumulation, analysis/batches.py) is matched the same way, micro-batch by
  micro-batch: a forward on a whole micro-batch (or a part of one) names its rows.

The origin rule. An op is an origin candidate when it
  - outputs NaN while none of its tensor inputs holds a NaN, or
  - outputs +-Inf while all of its inputs (tensors and scalars) are finite.
So `masked_fill(mask, -inf)` (an Inf scalar in, on purpose) is not a candidate, but a softmax
over a fully masked row (-inf in, NaN out) is; an overflowing matmul (finite in, Inf out) is,
and so is a float16 cast of a value above 65504. Uninitialized outputs (`empty*`) are ignored.
The origin is the first candidate whose non-finite values reach the first NaN (lineage.py
follows them op by op, per batch row): a candidate whose values some op makes finite again
(a causal mask `log(tril(ones))` softmaxed to 0) made them harmlessly and is passed over; with
no NaN, the first candidate whose values are never made finite again.

Reduced precision. A candidate that computed in float16 or bfloat16 (under autocast, or in a
half module) is run once more on the same inputs cast to float32: `fp32_finite` says whether
the op alone gives finite values there, i.e. whether the overflow exists only in the reduced
precision. That re-runs one op, not the model: precision lost by earlier ops (a sum rounded
to 0 before a log) is not seen here.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import warnings
from dataclasses import dataclass
from types import FrameType
from typing import Any, cast

import torch
from torch.autograd.graph import Node
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from ckptlab.analysis.batches import row_groups
from ckptlab.replayer.lineage import Lineage, pick_origin, row_counts, writes
from ckptlab.training.crash import call_through, library, ours
from ckptlab.training.world import local

_STAMP = "ckptlab"
# Ops whose output is uninitialized memory (may hold NaN bit patterns) or only a view.
_IGNORE_PREFIXES = ("aten.empty", "aten.new_empty", "aten.empty_like", "aten.empty_strided")
REDUCED_DTYPES = (torch.float16, torch.bfloat16)
MAX_LOCATED = 64  # candidates whose rows (and float32 re-run) are worked out


def _metadata(node: Node) -> dict:
    """An autograd node's metadata dict (torch's Node declares `metadata` a method; it is a dict)."""
    return cast(dict, node.metadata)


@dataclass
class TensorSummary:
    shape: tuple[int, ...]
    dtype: str
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    absmax: float = 0.0  # over finite elements

    @property
    def finite(self) -> bool:
        return self.nan == 0 and self.posinf == 0 and self.neginf == 0

    def describe(self) -> str:
        bad = ", ".join(f"{n} {k}" for k, n in (("NaN", self.nan), ("+Inf", self.posinf), ("-Inf", self.neginf)) if n)
        return f"{self.dtype}{list(self.shape)} |x|max={self.absmax:.3g}" + (f" ({bad})" if bad else "")


def summarize(t: torch.Tensor) -> TensorSummary:
    s = TensorSummary(tuple(t.shape), str(t.dtype).removeprefix("torch."))
    t = local(t)  # a DTensor (FSDP): this process's shard
    if t.numel() == 0 or t.is_complex() or t.dtype == torch.bool:
        return s
    with torch.no_grad():
        # One pass, no temporary: min and max propagate NaN, and +-Inf shows up in them, so a
        # finite result proves the whole tensor finite. Only a non-finite one is counted.
        lo_t, hi_t = torch.aminmax(t)
        lo, hi = float(lo_t), float(hi_t)
        if math.isfinite(lo) and math.isfinite(hi):
            s.absmax = max(-lo, hi)
            return s
        s.nan = int(torch.isnan(t).sum())
        s.posinf = int(torch.isposinf(t).sum())
        s.neginf = int(torch.isneginf(t).sum())
        fin = t[torch.isfinite(t)]
        s.absmax = float(fin.abs().max()) if fin.numel() else 0.0
    return s


@dataclass
class OpEvent:
    index: int
    phase: str  # forward | backward | optimizer
    op: str  # aten name, e.g. "aten.addmm.default"
    call: str | None  # the user-level torch call, e.g. "linear", "softmax"
    module: str | None  # module path; "" = the root model; None = outside the model
    source: str | None  # "model.py:57"
    inputs: list[TensorSummary]
    outputs: list[TensorSummary]
    scalar_nonfinite: bool = False
    new_nan: bool = False
    new_inf: bool = False
    bad_rows: dict[int, int] | None = None  # batch row -> non-finite output elements
    roots: frozenset[int] = frozenset()  # the candidates whose non-finite values it outputs (lineage.py)
    fp32_finite: bool | None = None  # reduced-precision candidate: the op is finite in float32

    @property
    def dtype(self) -> str | None:
        """The dtype of its first non-finite output (else of its first output)."""
        bad = [o for o in self.outputs if not o.finite] or self.outputs
        return bad[0].dtype if bad else None

    @property
    def is_origin_candidate(self) -> bool:
        return self.new_nan or self.new_inf

    @property
    def output_finite(self) -> bool:
        return all(o.finite for o in self.outputs)

    def to_json(self) -> dict:
        """The event as the report's causal chain holds it."""
        return {
            "phase": self.phase,
            "module": self.module,
            "op": self.op,
            "call": self.call,
            "source": self.source,
            "inputs": [s.describe() for s in self.inputs[:4]],
            "outputs": [s.describe() for s in self.outputs[:2]],
            "rows": sorted((self.bad_rows or {}).keys())[:16],
        }

    def where(self) -> str:
        mod = "<root>" if self.module == "" else (self.module or "<outside the model>")
        return f"{mod} {self.op}" + (f" ({self.call}, {self.source})" if self.source else "")


def user_source() -> tuple[str | None, str | None]:
    """(short "file.py:line", full path:line) of the innermost frame outside torch (and the engines
    between the user's code and torch: crash.library) and ckptlab."""
    f: FrameType | None = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        mine = ours(fn)
        if not (mine or fn.startswith("<") or library(fn)):
            return f"{os.path.basename(fn)}:{f.f_lineno}", f"{fn}:{f.f_lineno}"
        if mine and f.f_code.co_name == "run_step":  # reached the replay driver: no user frame
            return None, None
        f = f.f_back
    return None, None


def batch_slice(
    inputs: list, batch_leaves: list[torch.Tensor], rows: int | None, *, whole: bool = False
) -> tuple[int, int] | None:
    """(first row, row count) of the recorded batch that a forward's inputs are a view into:
    `x[i : i + k]` (or `x[i : i + k, 1:]`) or `x[i]` of a batch leaf `x` whose first dimension
    is the batch's `rows`. None when no input is such a view (a copy, or -- unless `whole` --
    the whole batch)."""
    if not rows:
        return None
    for t in inputs:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            continue
        for leaf in batch_leaves:
            try:
                if t.untyped_storage().data_ptr() != leaf.untyped_storage().data_ptr():
                    continue
            except (RuntimeError, NotImplementedError):  # no storage (meta, DTensor, ...)
                return None
            stride = leaf.stride(0)
            if stride <= 0 or t.dtype != leaf.dtype or t.dim() not in (leaf.dim(), leaf.dim() - 1):
                continue
            first, within = divmod(int(t.storage_offset() - leaf.storage_offset()), stride)
            row_extent = sum((n - 1) * st for n, st in zip(leaf.shape[1:], leaf.stride()[1:]))
            if within > row_extent:
                continue  # another tensor sharing the storage (`seq[:, 1:]` beside `seq[:, :-1]`)
            if t.dim() == leaf.dim() - 1:
                count = 1  # x[i]: one row, its batch dimension gone
            elif t.stride(0) == stride or t.shape[0] == 1:
                count = t.shape[0]
            else:
                continue  # x[::2]: not a run of rows
            if 0 <= first and 0 < count and (count < rows or whole) and first + count <= rows:
                return first, count
    return None


def _row_tensors(batch, rows: int | None) -> list[torch.Tensor]:
    """The batch's tensors with `rows` rows."""
    return [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == rows]


def copied_rows(inputs: list, batch_leaves: list[torch.Tensor], rows: int | None, *, whole: bool = False) -> int | None:
    """How many rows a forward's input holds when it looks like a copy of a part of the batch:
    fewer rows than the batch (or all of them, with `whole`), the rest of its shape and its
    dtype those of a batch leaf."""
    for t in inputs:
        if not isinstance(t, torch.Tensor) or not t.dim():
            continue
        for leaf in batch_leaves:
            fits = 0 < t.shape[0] < (rows or 0) or (whole and t.shape[0] == rows)
            if t.dtype == leaf.dtype and tuple(t.shape[1:]) == tuple(leaf.shape[1:]) and fits:
                return t.shape[0]
    return None


class _FunctionMode(TorchFunctionMode):
    def __init__(self, tracer: Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tr = self.tracer
        if tr.paused:
            return call_through(func, *args, **kwargs)
        outer = tr._call
        name = getattr(func, "__name__", None) or str(func)
        short, full = user_source()
        tr._call = (name, short, full)
        try:
            out = call_through(func, *args, **kwargs)
        finally:
            tr._call = outer
        tr._stamp(out, (name, tr.current_module(), short))
        return out


class _DispatchMode(TorchDispatchMode):
    def __init__(self, tracer: Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tr = self.tracer
        name = str(func)
        record = not (tr.paused or name.startswith(_IGNORE_PREFIXES) or name == "aten.detach.default")
        flat_in = tree_flatten((args, kwargs))[0] if record else []
        inputs = [tr.summary(a) for a in flat_in if isinstance(a, torch.Tensor)] if record else []
        before = tr.lineage.before(flat_in, inputs) if record else []
        if record and tr.watch is not None:
            tr.watch.before_op(len(tr.events), name, flat_in)
        out = call_through(func, *args, **kwargs)
        if name == "aten.detach.default" and not tr.paused and args:
            tr.lineage.alias(out, args[0])  # not an op of the step, but its values go on
        if record:
            ev = tr._record(name, flat_in, inputs, out, before, rerun=lambda: finite_in_float32(func, args, kwargs))
            if ev is not None and tr.watch is not None:
                tr.watch.after_op(ev, flat_in, out)
        return out


def finite_in_float32(func, args, kwargs) -> bool | None:
    """Whether `func` gives only finite values with its float16/bfloat16 inputs (and dtype
    arguments) in float32; None when it cannot run so (an `out=` op, an op without a float32
    kernel). Inputs are copied, never changed."""
    if "out" in kwargs:
        return None

    def up(x):
        if isinstance(x, torch.Tensor) and x.dtype in REDUCED_DTYPES:
            return x.detach().float()
        if isinstance(x, torch.dtype) and x in REDUCED_DTYPES:
            return torch.float32
        return x

    args, kwargs = tree_map(up, (args, kwargs))
    try:
        with torch.no_grad():
            out = func(*args, **kwargs)
    except Exception:  # noqa: BLE001 - no float32 path for this op: no answer, not an error
        return None
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return all(bool(torch.isfinite(local(t)).all()) for t in outs)


class Tracer:
    """Context manager that traces everything run inside it. See the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer=None,
        *,
        rows: int | None = None,
        batch=None,
        max_events: int = 200_000,
        watch=None,
    ):
        from ckptlab.training.wrappers import unwrap

        self.model = unwrap(model)
        self.optimizer = optimizer
        self.rows = rows
        # Per group of rows (the batch, or each recorded micro-batch): its first row, its row
        # count and its tensors with that many rows. A forward's input that is a view into one
        # of them names the micro-batch it runs on.
        self._groups = [(first, n, _row_tensors(part, n)) for first, part, n in row_groups(batch, rows)]
        self.micro: tuple[int, int] | None = None  # (first row, rows) of the running micro-batch
        self.micro_batches = 0  # forwards of the root model on a slice of the batch
        self._micro_next = 0  # in-order fallback: the first row not yet given to a forward
        self.max_events = max_events
        # Sees every traced op before and after it runs (`before_op(index, name, flat_inputs)`,
        # `after_op(event, flat_inputs, output)`): the full-tensor dump (dump.py) hangs here.
        self.watch = watch
        self.paused = False  # while True, nothing is traced (a watcher's own copies)
        self.events: list[OpEvent] = []
        self.candidates: list[OpEvent] = []  # the origin rule's candidates, in order
        self.nan_events: list[int] = []  # indices of the events that output NaN, in order
        self.lineage = Lineage()
        self.truncated = False
        self._names = {id(m): n for n, m in self.model.named_modules()}
        self._stack: list[str] = []
        self._call: tuple[str, str | None, str | None] | None = None
        self._in_optimizer = False
        self._seen_backward = False
        self._handles: list[Any] = []
        # Summaries of tensors already seen (most op inputs are earlier outputs or parameters),
        # valid while the tensor's version counter is unchanged (in-place ops bump it).
        self._seen = WeakIdKeyDictionary()

    def summary(self, t: torch.Tensor) -> TensorSummary:
        try:
            hit = self._seen.get(t)
            version = t._version
        except (TypeError, RuntimeError):  # tensors without weakref/version support
            return summarize(t)
        if hit is not None and hit[0] == version:
            return hit[1]
        s = summarize(t)
        self._seen[t] = (version, s)
        return s

    # --- context ------------------------------------------------------------------------

    def __enter__(self) -> Tracer:
        # Compiled code (torch.compile) runs graphs our dispatch modes cannot see into: the
        # traced step runs eagerly. Only when dynamo is loaded (else nothing was compiled).
        self._stance = torch.compiler.set_stance("force_eager") if "torch._dynamo" in sys.modules else None
        # Our global module hooks make torch warn that they fire for the compiled wrapper too:
        # they do, and the wrapper is not a module the tracer names, so it is ignored.
        self._quiet = warnings.catch_warnings()
        self._quiet.__enter__()
        warnings.filterwarnings("ignore", message=".*global hooks on modules.*")
        nn = torch.nn.modules.module
        self._handles = [
            self.model.register_forward_pre_hook(self._on_root_forward, with_kwargs=True),
            nn.register_module_forward_pre_hook(self._push),
            nn.register_module_forward_hook(self._pop),
        ]
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(self._on_pre_step))
            self._handles.append(self.optimizer.register_step_post_hook(lambda *a: self._set_opt(False)))
        self._fmode, self._dmode = _FunctionMode(self), _DispatchMode(self)
        self._fmode.__enter__()
        self._dmode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._dmode.__exit__(*exc)
        self._fmode.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._stance is not None:
            self._stance.__exit__(*exc)
        self._quiet.__exit__(*exc)

    def _set_opt(self, on: bool) -> None:
        self._in_optimizer = on

    def _on_pre_step(self, optimizer, args, kwargs):
        """The update begins -- except that `optimizer.step(closure)` (LBFGS, Lightning's
        automatic optimization) first runs the closure: its forward and backward are not the
        optimizer's, so the closure runs with the optimizer phase off."""
        self._in_optimizer = True
        self.micro = None
        closure = kwargs.get("closure", args[0] if args else None)
        if not callable(closure):
            return None

        def closure_outside_the_update(*a, **k):
            self._in_optimizer = False
            try:
                return call_through(closure, *a, **k)
            finally:
                self._in_optimizer = True

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_outside_the_update}
        return (closure_outside_the_update, *args[1:]), kwargs

    def _on_root_forward(self, module, args, kwargs) -> None:
        """A forward of the whole model begins: on which rows of the recorded batch?"""
        if not self.rows:
            return None
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        micro = None
        recorded = len(self._groups) > 1  # the batch was recorded as micro-batches
        for first, n, leaves in self._groups:
            found = batch_slice(inputs, leaves, n, whole=recorded)
            if found is not None:
                micro = (first + found[0], found[1])
                break
        if micro is None:
            # Not a view into the batch: a copy of a part of it (`x[i : i + k].to(device)`)
            # is taken to be the next micro-batch, in order.
            for first, n, leaves in self._groups:
                if first + (n or 0) <= self._micro_next:
                    continue
                lead = copied_rows(inputs, leaves, n, whole=recorded)
                if lead is not None and n is not None and self._micro_next + lead <= first + n:
                    micro = (self._micro_next, lead)
                break
        if micro is not None:
            self._micro_next = micro[0] + micro[1]
            self.micro_batches += 1
        self.micro = micro
        return None

    def _push(self, module, args) -> None:
        name = self._names.get(id(module))
        if name is not None:
            self._stack.append(name)
            self._seen_backward = False  # a new forward (e.g. the next micro-batch) begins

    def _pop(self, module, args, output) -> None:
        name = self._names.get(id(module))
        if name is not None and self._stack and self._stack[-1] == name:
            self._stack.pop()

    @contextlib.contextmanager
    def pause(self):
        """Run something inside the traced step without tracing it (a watcher's copies): the
        op indices stay those of the step alone."""
        was, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = was

    def current_module(self) -> str | None:
        return self._stack[-1] if self._stack else None

    # --- autograd stamps ------------------------------------------------------------------

    def _stamp(self, out, stamp) -> None:
        """Stamp the autograd nodes created by one user-level call with (call, module, source)."""
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.grad_fn is None:
                continue
            todo: list[Node | None] = [t.grad_fn]
            while todo:
                node = todo.pop()
                if node is None or _STAMP in _metadata(node) or type(node).__name__ == "AccumulateGrad":
                    continue
                _metadata(node)[_STAMP] = stamp
                todo.extend(nf for nf, _ in node.next_functions)

    # --- per-op record ------------------------------------------------------------------------

    def _phase(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            self._seen_backward = True
            return "backward"
        # After backward and outside any module: gradient clipping and the update itself.
        if self._in_optimizer or (self._seen_backward and not self._stack):
            return "optimizer"
        return "forward"

    def _record(
        self, name: str, flat_in: list, inputs: list[TensorSummary], out, before: list, rerun=None
    ) -> OpEvent | None:
        if len(self.events) >= self.max_events:
            self.truncated = True
            return None
        phase = self._phase()
        call = module = source = None
        if phase == "backward":
            node = torch._C._current_autograd_node()
            stamp = _metadata(node).get(_STAMP) if node is not None else None
            if stamp:
                call, module, source = stamp
        else:
            module = self.current_module()
            if self._call is not None:
                call, source = self._call[0], self._call[1]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        ev = OpEvent(
            index=len(self.events),
            phase=phase,
            op=name,
            call=call,
            module=module,
            source=source,
            inputs=inputs,
            # (an in-place op's output: its version is bumped only after this returns)
            outputs=[summarize(t) if writes(name) else self.summary(t) for t in outs],
            scalar_nonfinite=any(isinstance(a, float) and not math.isfinite(a) for a in flat_in),
        )
        in_nan = any(s.nan for s in inputs)
        in_nonfinite = any(not s.finite for s in inputs) or ev.scalar_nonfinite
        ev.new_nan = not in_nan and any(s.nan for s in ev.outputs)
        ev.new_inf = not in_nonfinite and any(s.posinf or s.neginf for s in ev.outputs)
        self.events.append(ev)
        if before or not ev.output_finite:
            self.lineage.op(ev, before, outs, self._op_rows(ev))
        if any(s.nan for s in ev.outputs):
            self.nan_events.append(ev.index)
        if ev.is_origin_candidate:
            if len(self.candidates) < MAX_LOCATED:
                self._locate(ev, outs)
                if rerun is not None and any(t.dtype in REDUCED_DTYPES for t in outs):
                    ev.fp32_finite = rerun()
            self.candidates.append(ev)
        return ev

    @property
    def origin(self) -> OpEvent | None:
        """The op that started the fault: the first whose non-finite values reach the first NaN
        (or, with no NaN, are never made finite again); see lineage.py."""
        return pick_origin(self.events, self.nan_events, self.candidates, self.lineage.absorbed)

    def _op_rows(self, ev: OpEvent) -> tuple[int, int | None]:
        """(first row, row count) of the rows an op works on: the running micro-batch's, else
        (an update's op too) the batch's."""
        micro = self.micro if ev.phase != "optimizer" else None
        return micro if micro is not None else (0, self.rows)

    def _locate(self, ev: OpEvent, outs: list[torch.Tensor]) -> None:
        """The new non-finite values of its first non-finite output, counted by batch row (in a
        micro-batch: the rows of the micro-batch, then the batch's)."""
        first, n = self._op_rows(ev)
        for t, s in zip(outs, ev.outputs):
            if s.finite or not t.is_floating_point():
                continue
            with torch.no_grad():
                bad = ~torch.isfinite(local(t))  # (a DTensor: this process's shard)
                counts = row_counts(bad, n)
                if counts is None and n == 1 and self.micro is not None and ev.phase != "optimizer":
                    counts = bad.sum().reshape(1)  # a one-row micro-batch: what it computes (its loss) is that row's
            rows = {} if counts is None else {first + r: int(c) for r, c in enumerate(counts.tolist()) if c}
            ev.bad_rows = rows or None
            return

    # --- summaries ------------------------------------------------------------------------------

    def chain(self, limit: int = 12) -> list[OpEvent]:
        """The non-finite values' path from the origin on (the events its values reach): one
        event per (phase, module) run."""
        origin = self.origin
        if origin is None:
            return []
        out: list[OpEvent] = [origin]
        for ev in self.events[origin.index + 1 :]:
            if origin.index not in ev.roots or ev.op in (
                "aten.view.default",
                "aten._unsafe_view.default",
                "aten.t.default",
            ):
                continue
            last = out[-1]
            if (ev.phase, ev.module) == (last.phase, last.module):
                continue
            out.append(ev)
            if len(out) >= limit:
                break
        return out
