"""The full-tensor dump of the root step (`ckptlab replay --step N --dump FILE.h5`).

    request = DumpRequest(Path("nan.h5"), select=r"blocks\\.0", max_bytes=10**9)
    entries, came_from, notes = capture_root_step(blame, tracer.origin, request)  # one more replay
    report.dump = write(report, entries, came_from, request)                       # the .h5 file

The trace (trace.py) keeps summaries; this keeps the tensors, and only when asked. The root
step runs once more, traced again, with a watcher: the op indices of that run are those of
the first trace (replay is deterministic, and the watcher's copies are not traced), so the
origin op is known before it runs and its inputs are copied as they were before it (an
in-place op overwrites them). Also copied: each selected module's outputs (forward hooks),
the gradients that reach them (tensor hooks: no op is added to the step), its parameters'
gradients as accumulated by backward, and the batch. A tensor is copied only while the copies
stay within the byte budget (the origin's room kept free until it runs); the file
(run/dumpfile.py) holds what fits, origin first, and lists the rest with its size.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils._pytree import tree_flatten

from ckptlab import __version__
from ckptlab.analysis.batches import python_leaves
from ckptlab.replayer.findings import DumpInfo, ReplayReport
from ckptlab.replayer.trace import OpEvent, Tracer, user_source
from ckptlab.run.dumpfile import DEFAULT_MAX_BYTES, DumpEntry, write_dump
from ckptlab.training.world import local
from ckptlab.training.wrappers import unwrap

# The first non-finite elements of a tensor worth listing (row-major order), and those of the
# origin's outputs whose input elements are traced back.
FIRST_NONFINITE = 8
EXPLAINED = 4
SCANNED = 4096  # non-finite output elements looked at for EXPLAINED with distinct inputs


@dataclass(frozen=True)
class DumpRequest:
    path: Path
    select: str | None = None  # a regex (re.search) on module paths; None: every module
    max_bytes: int = DEFAULT_MAX_BYTES
    force: bool = False

    def selects(self, module: str) -> bool:
        return self.select is None or re.search(self.select, module) is not None


class Capture:
    """The tracer's watcher during the dump run: copies tensors, within a byte budget."""

    def __init__(self, model: torch.nn.Module, origin: OpEvent | None, request: DumpRequest):
        self.model, self.origin, self.request = unwrap(model), origin, request  # the model's own module names
        self.tracer: Tracer | None = None
        self.captured = 0  # bytes copied so far
        self.origin_inputs: list[DumpEntry] = []
        self.origin_outputs: list[DumpEntry] = []
        self.came_from: list[str] = []
        self.forward: list[DumpEntry] = []
        self.backward: list[DumpEntry] = []
        self.param_grads: dict[int, DumpEntry] = {}
        self.calls: dict[str, int] = {}
        self._before: list[torch.Tensor] = []
        self.mismatch: str | None = None
        # The origin op comes first in the file, but mid-step in time: its bytes (known from
        # the first trace) are kept free until it runs, so modules before it cannot crowd it out.
        self.reserved = sum(_summary_bytes(s) for s in (origin.inputs + origin.outputs)) if origin else 0

    @contextlib.contextmanager
    def hooks(self, tracer: Tracer):
        """Module and parameter hooks on the selected modules, for one traced step."""
        self.tracer = tracer
        handles, seen = [], set()
        for name, module in self.model.named_modules():
            if not self.request.selects(name):
                continue
            handles.append(module.register_forward_hook(self._forward_hook(name)))
            for pname, p in module.named_parameters(recurse=False):
                if id(p) not in seen and p.requires_grad:  # a tied weight: under its first module
                    seen.add(id(p))
                    handles.append(p.register_post_accumulate_grad_hook(self._param_hook(name, pname)))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    # --- copies -------------------------------------------------------------------------------

    def entry(self, path: str, role: str, t: torch.Tensor, **where) -> DumpEntry:
        """A DumpEntry for `t`, copied to the CPU when the budget allows (else data None)."""
        t = local(t)
        dtype = str(t.dtype).removeprefix("torch.")
        shape = tuple(t.shape)
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            return DumpEntry(path, role, None, 0, shape, dtype, note="not a dense tensor", **where)
        itemsize = 4 if t.dtype == torch.bfloat16 else t.element_size()  # bf16 is stored as float32
        nbytes = t.numel() * itemsize
        if self.captured + nbytes + (0 if role.startswith("origin") else self.reserved) > self.request.max_bytes:
            return DumpEntry(path, role, None, nbytes, shape, dtype, **where)
        self.captured += nbytes
        with self._untraced(), torch.no_grad():
            c = t.detach().to("cpu", copy=True)
            arr = (c.float() if c.dtype == torch.bfloat16 else c).numpy()
        count, first = nonfinite(arr)
        return DumpEntry(path, role, arr, nbytes, shape, dtype, nonfinite=count, first_nonfinite=first, **where)

    def _untraced(self):
        return self.tracer.pause() if self.tracer is not None else contextlib.nullcontext()

    # --- the origin op (Tracer's watch) ----------------------------------------------------

    def before_op(self, index: int, name: str, flat_in: list) -> None:
        if self.origin is None or index != self.origin.index:
            return
        if name != self.origin.op:
            self.mismatch = f"op {index} of the dump run is {name}, not the origin {self.origin.op}"
            return
        with self._untraced(), torch.no_grad():
            self._before = [local(a).detach().clone() for a in flat_in if isinstance(a, torch.Tensor)]

    def after_op(self, ev: OpEvent, flat_in: list, out) -> None:
        if self.origin is None or ev.index != self.origin.index or self.mismatch:
            return
        where = dict(module=ev.module, op=ev.op, phase=ev.phase, source=ev.source, event=ev.index)
        self.reserved = 0
        for i, t in enumerate(self._before):
            self.origin_inputs.append(self.entry(f"origin/input{i}", "origin_input", t, **where))
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for i, t in enumerate(outs):
            self.origin_outputs.append(self.entry(f"origin/output{i}", "origin_output", t, **where))
            with self._untraced(), torch.no_grad():
                self.came_from += explain_elements(ev.op, flat_in, self._before, local(t).detach(), i)

    # --- modules -------------------------------------------------------------------------------

    def _forward_hook(self, name: str):
        def hook(module, args, output):
            k = self.calls.get(name, 0)
            self.calls[name] = k + 1
            last = self.tracer.events[-1] if self.tracer and self.tracer.events else None
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"  # recomputed
            source = user_source()[0]
            label = module_label(name)
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
            for i, t in enumerate(tensors):
                where = dict(module=label, phase=phase, source=source, call=k)
                if last is not None:
                    where.update(op=last.op, event=last.index)
                self.forward.append(
                    self.entry(f"modules/{_h5(label)}/forward/{k}/output{i}", "forward_output", t, **where)
                )
                if t.requires_grad and t.grad_fn is not None:
                    t.register_hook(self._grad_hook(label, k, i, source))

        return hook

    def _grad_hook(self, label: str, k: int, i: int, source: str | None):
        def hook(grad):
            last = self.tracer.events[-1] if self.tracer and self.tracer.events else None
            where = dict(module=label, phase="backward", source=source, call=k)
            if last is not None:
                where.update(op=last.op, event=last.index)
            path = f"modules/{_h5(label)}/backward/{k}/grad_output{i}"
            self.backward.append(self.entry(path, "grad_output", grad, **where))

        return hook

    def _param_hook(self, name: str, pname: str):
        label = module_label(name)

        def hook(p):
            old = self.param_grads.pop(id(p), None)
            if old is not None and old.data is not None:
                self.captured -= old.nbytes  # a later micro-batch: the accumulated gradient replaces it
            path = f"modules/{_h5(label)}/param_grad/{_h5(pname)}"
            e = self.entry(path, "param_grad", p.grad, module=label, phase="backward")
            e.note = "as accumulated by backward, before clipping and the update"
            self.param_grads[id(p)] = e

        return hook

    def entries(self) -> list[DumpEntry]:
        """Everything captured, most important first (the order the byte budget fills in)."""
        return [*self.origin_inputs, *self.origin_outputs, *self.forward, *self.backward, *self.param_grads.values()]


def capture_root_step(
    blame, origin: OpEvent | None, request: DumpRequest
) -> tuple[list[DumpEntry], list[str], list[str]]:
    """Replay the root step once more (rootstep.py's `RootStep`), copying what the dump holds.
    Returns (entries in order of priority, the origin's came-from lines, notes)."""
    capture = Capture(blame.runner.model, origin, request)
    tracer = Tracer(blame.runner.model, blame.runner.optimizer, rows=blame.rows, batch=blame.rec.batch, watch=capture)
    # The batch first: copied before the step runs (step_fn may change it in place).
    batch = batch_entries(capture, blame.rec.batch, blame.ids, [s.row for s in blame.report.samples])
    with capture.hooks(tracer):
        blame.step(tracer=tracer)
    notes = []
    if capture.mismatch:
        notes.append(f"the dump holds no origin op tensors: {capture.mismatch} (the replay is not deterministic)")
    entries = capture.entries()
    k = len(capture.origin_inputs) + len(capture.origin_outputs)
    return entries[:k] + batch + entries[k:], capture.came_from, notes


def _summary_bytes(s) -> int:
    """The bytes a traced tensor (trace.py's TensorSummary) takes in the dump."""
    dtype = getattr(torch, s.dtype, None)
    itemsize = 4 if dtype in (torch.bfloat16, None) else torch.empty((), dtype=dtype).element_size()
    return int(np.prod(s.shape, dtype=np.int64)) * itemsize


def batch_entries(capture: Capture, batch, ids, blamed: list[int]) -> list[DumpEntry]:
    """Each tensor (or array) of the batch, every row; the sample ids; the blamed rows."""
    out = []
    for path, leaf in python_leaves(batch):
        if isinstance(leaf, np.ndarray) and leaf.dtype.kind in "biufc":
            leaf = torch.from_numpy(leaf)
        if isinstance(leaf, torch.Tensor):
            e = capture.entry(f"batch/{_h5(path or 'batch')}", "batch", leaf, phase="forward")
            e.note = f"batch{path}"
            out.append(e)
    if ids is not None:
        arr = np.array([str(i) for i in ids], dtype=object) if any(isinstance(i, str) for i in ids) else np.array(ids)
        out.append(_small("batch/sample_ids", arr, "the sample id of each row"))
    rows = np.array(blamed, dtype=np.int64)
    out.append(_small("batch/blamed_rows", rows, "the blamed rows, most to blame first"))
    return out


def _small(path: str, arr: np.ndarray, note: str) -> DumpEntry:
    nbytes = arr.size * (8 if arr.dtype == object else arr.itemsize)
    return DumpEntry(path, "batch", arr, nbytes, arr.shape, str(arr.dtype), nonfinite=0, note=note)


def write(report: ReplayReport, entries: list[DumpEntry], came_from: list[str], request: DumpRequest) -> DumpInfo:
    o = report.origin
    attrs = {
        "ckptlab_version": __version__,
        "run": report.run,
        "root_step": report.root_step,
        "requested_step": report.requested_step,
        "select": request.select or "",
        "origin_kind": o.kind,
        "origin_module": module_label(o.module) if o.module is not None else "",
        "origin_op": o.op or "",
        "origin_phase": o.phase or "",
        "origin_source": o.source or "",
        "verdict": report.verdict,
    }
    w = write_dump(
        request.path,
        entries,
        attrs=attrs,
        max_bytes=request.max_bytes,
        texts={"origin/came_from": came_from} if came_from else None,
        force=request.force,
    )
    return DumpInfo(
        path=w.path,
        select=request.select,
        max_bytes=request.max_bytes,
        data_bytes=w.data_bytes,
        file_bytes=w.file_bytes,
        datasets=w.datasets,
        omitted=[{"path": p, "bytes": b} for p, b in w.omitted],
        origin_came_from=came_from,
        origin_first_nonfinite=[
            {"dataset": e.path, "index": c} for e in entries if e.role == "origin_output" for c in e.first_nonfinite
        ],
    )


# --- where a non-finite element came from -------------------------------------------------------


def nonfinite(arr: np.ndarray) -> tuple[int, list[list[int]]]:
    """(non-finite elements, the first FIRST_NONFINITE's coordinates in row-major order)."""
    if arr.dtype.kind not in "fc" or not arr.size:
        return 0, []
    bad = ~np.isfinite(arr)
    count = int(bad.sum())
    if not count:
        return 0, []
    flat = np.flatnonzero(bad)[:FIRST_NONFINITE]
    return count, [[int(i) for i in np.unravel_index(j, arr.shape)] for j in flat]


def explain_elements(op: str, flat_in: list, before: list[torch.Tensor], out: torch.Tensor, k: int) -> list[str]:
    """For the first non-finite elements of the origin op's output `k`: the input elements
    each was computed from, as they were before the op, and what they hold. One line each:
    `output0[5, 7, 0] = nan <- input0[5, 7, :] all -inf (8 elements)`."""
    if not out.is_floating_point() or not out.numel():
        return []
    bad = (~torch.isfinite(out)).nonzero()[:SCANNED].tolist()
    scalars = [a for a in flat_in if not isinstance(a, torch.Tensor)]
    lines, seen = [], set()
    for coord in bad:
        found = sources(op, scalars, before, tuple(out.shape), tuple(coord))
        key = repr(found)
        if key in seen:  # the same input elements as an earlier output element (a softmax row)
            continue
        seen.add(key)
        parts = [f"input{i}{_fmt_index(idx)} {describe(before[i][idx])}" for i, idx in found]
        value = float(out[tuple(coord)])
        lines.append(f"output{k}{_fmt_index(tuple(coord))} = {value} <- " + ("; ".join(parts) or "no tensor input"))
        if len(lines) >= EXPLAINED:
            break
    return lines


_SOFTMAX = {"_softmax", "_log_softmax", "softmax", "log_softmax", "_safe_softmax"}


def sources(op: str, scalars: list, ins: list[torch.Tensor], shape: tuple, coord: tuple) -> list[tuple[int, tuple]]:
    """(input number, index) of the input elements that output element `coord` of `op` was
    computed from: a softmax's row, a matmul's row and column, else the element broadcasting
    puts there (an input that does not broadcast to the output: all of it)."""
    base = op.split(".")[1] if op.startswith("aten.") and op.count(".") >= 1 else op
    every = slice(None)
    if base in _SOFTMAX and ins and len(coord) == ins[0].dim():
        dim = next((a for a in scalars if isinstance(a, int) and not isinstance(a, bool)), -1)
        idx = list(coord)
        idx[dim % len(idx)] = every
        return [(0, tuple(idx))]
    if base == "mm" and len(ins) == 2 and len(coord) == 2:
        return [(0, (coord[0], every)), (1, (every, coord[1]))]
    if base in ("addmm", "baddbmm") and len(ins) == 3 and len(coord) in (2, 3):
        *b, i, j = coord
        return [(0, _broadcast(ins[0].shape, coord)), (1, (*b, i, every)), (2, (*b, every, j))]
    if base == "bmm" and len(ins) == 2 and len(coord) == 3:
        return [(0, (coord[0], coord[1], every)), (1, (coord[0], every, coord[2]))]
    return [(i, _broadcast(t.shape, coord) if _broadcasts(t.shape, shape) else (...,)) for i, t in enumerate(ins)]


def _broadcasts(src: torch.Size, dst: tuple) -> bool:
    return len(src) <= len(dst) and all(s in (1, d) for s, d in zip(src[::-1], dst[::-1]))


def _broadcast(src: torch.Size, coord: tuple) -> tuple:
    tail = coord[len(coord) - len(src) :] if src else ()
    return tuple(0 if n == 1 else c for n, c in zip(src, tail))


def describe(t: torch.Tensor) -> str:
    """What a few input elements hold: `= -inf`, `all -inf (8 elements)`, `8 elements: 2 NaN, |x| max 3.1`."""
    if t.dim() == 0:
        return f"= {float(t) if t.is_floating_point() else t.item()}"
    n = t.numel()
    if not n:
        return "(no elements)"
    flat = t.reshape(-1)
    if n > 1 and bool((flat == flat[0]).all()):  # e.g. targets all -100 (ignore_index), all 0
        return f"all {flat[0].item()} ({n} elements)"
    if not t.is_floating_point():
        return (
            f"({n} elements from {t.min().item()} to {t.max().item()})" if t.dtype != torch.bool else f"({n} elements)"
        )
    counts = {
        "NaN": int(torch.isnan(t).sum()),
        "+Inf": int(torch.isposinf(t).sum()),
        "-Inf": int(torch.isneginf(t).sum()),
    }
    for name, c in counts.items():
        if c == n:
            return f"all {name.lower().lstrip('+')} ({n} elements)"
    finite = t[torch.isfinite(t)]
    bad = ", ".join(f"{c} {name}" for name, c in counts.items() if c)
    top = f"|x| max {float(finite.abs().max()):.4g}" if finite.numel() else ""
    return f"({n} elements: " + ", ".join(x for x in (bad or "all finite", top) if x) + ")"


def _fmt_index(idx: tuple) -> str:
    if idx == (...,):
        return "[...]"
    if idx == ():
        return ""  # a scalar
    return "[" + ", ".join(":" if isinstance(i, slice) else str(i) for i in idx) + "]"


def module_label(name: str) -> str:
    return "<root>" if name == "" else name


def _h5(name: str) -> str:
    """A name usable as one HDF5 path component ("/" separates them; "." alone is special)."""
    name = name.replace("/", "\u2215")
    return name if name not in ("", ".", "..") else f"({name})"
