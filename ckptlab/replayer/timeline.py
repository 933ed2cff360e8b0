"""Where one replayed step's time goes: its ops and the model's modules, from torch.profiler.

    with module_ranges(model):                      # each module's forward as a profiler range
        with torch.profiler.profile(...) as prof:
            ...                                     # the step
    ops, modules = attribute(prof.events(), top=10)

Each op's self time (the time in the op less the ops it called) goes to the innermost module
whose forward was running when it ran; a backward op goes to the module whose forward op made
the autograd node it runs in (the profiler gives both the same `sequence_nr`). Its source is the
innermost frame of the user's code that called it (the profiler's Python stack, `with_stack`),
the forward op's for a backward op. Time outside every module (the loss, the optimizer) is
named `(outside the model)`.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
import sysconfig
from collections import defaultdict
from collections.abc import Iterator

import torch

from ckptlab.training.wrappers import own_name, unwrap

RANGE = "ckptlab.module: "  # the profiler range of a module's forward
BACKWARD = "autograd::engine::evaluate_function: "  # the profiler's range of one autograd node
OUTSIDE = "(outside the model)"
_FRAME = re.compile(r"^(?P<file>[^()]+\.py)\((?P<line>\d+)\): ")
# Frames of these are never the user's code (a frame is named relative to its sys.path entry).
_NOT_USERS = ("torch/", "ckptlab/", "<")
_LIBRARIES = tuple(sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib"))


@contextlib.contextmanager
def module_ranges(model: torch.nn.Module) -> Iterator[None]:
    """Every module's forward (the user's model's names) as a profiler range, while the block
    runs; a forward that raises closes the ranges it left open when the block ends."""
    opened: list = []

    def enter(name: str):
        def hook(module, args):
            r = torch.autograd.profiler.record_function(RANGE + name)
            r.__enter__()
            opened.append(r)

        return hook

    def leave(module, args, output):
        if opened:
            opened.pop().__exit__(None, None, None)

    handles = []
    for name, module in unwrap(model).named_modules():
        handles.append(module.register_forward_pre_hook(enter(own_name(name))))
        handles.append(module.register_forward_hook(leave))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while opened:
            opened.pop().__exit__(None, None, None)


def _enclosing(e) -> tuple[str | None, str | None, int | None]:
    """The innermost module range, user frame and autograd node (its sequence_nr) around `e`."""
    module = source = node = None
    p = e.cpu_parent
    while p is not None and (module is None or source is None):
        name = p.name
        if module is None and name.startswith(RANGE):
            module = name[len(RANGE) :]
        elif source is None and (m := _FRAME.match(name)) and _users(m["file"]):
            source = f"{m['file']}:{m['line']}"
        elif node is None and name.startswith(BACKWARD) and p.sequence_nr >= 0:
            node = p.sequence_nr
        p = p.cpu_parent
    return module, source, node


@functools.cache
def _users(file: str) -> bool:
    """A frame's file is the user's code: not torch's or ckptlab's, nor any installed package's
    or the standard library's (its top-level module, once imported, says where it lives)."""
    if file.startswith(_NOT_USERS):
        return False
    top = sys.modules.get(file.split("/")[0].removesuffix(".py"))
    where = getattr(top, "__file__", None) or ""
    return not where.startswith(_LIBRARIES)


def _is_op(e) -> bool:
    """An operator's event (not a Python frame, a module range or an autograd node's wrapper)."""
    return "::" in e.name and not e.name.startswith((RANGE, BACKWARD)) and not _FRAME.match(e.name)


def attribute(events, top: int) -> tuple[list[dict], list[dict]]:
    """The `top` ops by self time ({op, self_s, calls, source}: the source that spent most of
    it) and modules ({module, self_s}) of the profiled step's events."""
    ops = [e for e in events if _is_op(e)]
    where = {id(e): _enclosing(e) for e in ops}
    made: dict[
        int, tuple[str, str | None]
    ] = {}  # an autograd node's sequence_nr -> (module, source) of the forward op that made it
    for e in ops:
        module, source, node = where[id(e)]
        if node is None and e.sequence_nr >= 0 and module is not None:
            made.setdefault(e.sequence_nr, (module, source))
    by_op: dict[str, list] = defaultdict(lambda: [0.0, 0, defaultdict(float)])
    by_module: dict[str, float] = defaultdict(float)
    for e in ops:
        module, source, node = where[id(e)]
        if module is None and node is not None and node in made:
            module, fwd_source = made[node]
            source = source or fwd_source
        self_s = e.self_cpu_time_total / 1e6  # (microseconds)
        entry = by_op[e.name]
        entry[0] += self_s
        entry[1] += 1
        entry[2][source] += self_s
        by_module[module if module is not None else OUTSIDE] += self_s
    top_ops = [
        {"op": name, "self_s": round(s, 6), "calls": n, "source": max(srcs, key=lambda k: srcs[k])}
        for name, (s, n, srcs) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]
    ]
    top_modules = [
        {"module": name, "self_s": round(s, 6)} for name, s in sorted(by_module.items(), key=lambda kv: -kv[1])[:top]
    ]
    return top_ops, top_modules
