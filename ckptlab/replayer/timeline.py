"""Where one replayed step's time goes: its ops and the model's modules, from torch.profiler.

    with module_ranges(model), sources():           # each module's forward, each call's line: ranges
        with torch.profiler.profile(...) as prof:
            ...                                     # the step
    ops, modules = attribute(prof.events(), top=10)

A module's time is its forward's own (its range less its submodules': its ops, Python, a
sleep alike) and the self time of the backward ops of the autograd nodes its forward made (the
profiler gives a forward op and its node the same `sequence_nr`); an op's self time is the
time in it less the ops it called. Its source is the
line of the user's code that called it (`sources`: each torch call the step makes runs in a
profiler range named by that line, found as the per-op trace finds it; the profiler's own
Python stack names the line a function begins, not the line that called the op), the forward
op's for a backward op. Time outside every module (the loss, the optimizer) is
named `(outside the model)`.
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from ckptlab.replayer.trace import user_source
from ckptlab.training.wrappers import own_name, unwrap

RANGE = "ckptlab.module: "  # the profiler range of a module's forward
SOURCE = "ckptlab.source: "  # the profiler range of one torch call, named by its line
BACKWARD = "autograd::engine::evaluate_function: "  # the profiler's range of one autograd node
OUTSIDE = "(outside the model)"
_FRAME = re.compile(r"^[^()]+\.py\(\d+\): ")  # the profiler's event of a Python frame


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


class _Sources(TorchFunctionMode):
    """Each torch call inside a profiler range named by the user's line that made it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        source = user_source()[0]
        if source is None:
            return func(*args, **(kwargs or {}))
        with torch.autograd.profiler.record_function(SOURCE + source):
            return func(*args, **(kwargs or {}))


def sources():
    """While it is active, every torch call runs in a `SOURCE` range (see _Sources)."""
    return _Sources()


def _enclosing(e) -> tuple[str | None, str | None, int | None]:
    """The innermost module range, user frame and autograd node (its sequence_nr) around `e`."""
    module = source = node = None
    p = e.cpu_parent
    while p is not None and (module is None or source is None):
        name = p.name
        if module is None and name.startswith(RANGE):
            module = name[len(RANGE) :]
        elif source is None and name.startswith(SOURCE):
            source = name[len(SOURCE) :]
        elif node is None and name.startswith(BACKWARD) and p.sequence_nr >= 0:
            node = p.sequence_nr
        p = p.cpu_parent
    return module, source, node


def _is_op(e) -> bool:
    """An operator's event (not a Python frame, a module range or an autograd node's wrapper)."""
    return "::" in e.name and not e.name.startswith((RANGE, SOURCE, BACKWARD, "<")) and not _FRAME.match(e.name)


def _forward_times(events) -> dict[str, float]:
    """Each module's own forward time in seconds: its range less the ranges of the modules it
    called. All of it, not only its ops': Python, a sleep, a wait for I/O count too."""
    own: dict[str, float] = defaultdict(float)
    for r in (e for e in events if e.name.startswith(RANGE)):
        inner, stack = 0.0, list(r.cpu_children)
        while stack:
            c = stack.pop()
            if c.name.startswith(RANGE):
                inner += c.cpu_time_total
            else:
                stack.extend(c.cpu_children)
        own[r.name[len(RANGE) :]] += (r.cpu_time_total - inner) / 1e6  # (microseconds)
    return own


def attribute(events, top: int) -> tuple[list[dict], list[dict]]:
    """The `top` ops by self time ({op, self_s, calls, source}: the source that spent most of
    it) and modules ({module, self_s}) of the profiled step's events."""
    ops = [e for e in events if _is_op(e)]
    where = {id(e): _enclosing(e) for e in ops}
    # an autograd node's sequence_nr -> (module, source) of the forward op that made it
    made: dict[int, tuple[str | None, str | None]] = {}
    for e in ops:
        module, source, node = where[id(e)]
        if node is None and e.sequence_nr >= 0:
            made.setdefault(e.sequence_nr, (module, source))
    by_op: dict[str, list] = defaultdict(lambda: [0.0, 0, defaultdict(float)])
    by_module = _forward_times(events)
    for e in ops:
        module, source, node = where[id(e)]
        self_s = e.self_cpu_time_total / 1e6  # (microseconds)
        if module is None and node is not None and node in made:
            module, fwd_source = made[node]
            source = fwd_source or source  # (the line of the forward op, not of `loss.backward()`)
            by_module[module if module is not None else OUTSIDE] += self_s
        elif module is None:
            by_module[OUTSIDE] += self_s
        entry = by_op[e.name]
        entry[0] += self_s
        entry[1] += 1
        entry[2][source] += self_s
    top_ops = [
        {"op": name, "self_s": round(s, 6), "calls": n, "source": max(srcs, key=lambda k: srcs[k])}
        for name, (s, n, srcs) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]
    ]
    top_modules = [
        {"module": name, "self_s": round(s, 6)} for name, s in sorted(by_module.items(), key=lambda kv: -kv[1])[:top]
    ]
    return top_ops, top_modules
