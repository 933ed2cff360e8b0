"""Where a traced step's non-finite values come from, and which are made harmless again.

    lineage = Lineage()
    pre = lineage.before(inputs, summaries)  # per traced op, before it runs
    lineage.op(ev, pre, outputs, rows)       # and after: when it has a non-finite input or output
    lineage.absorbed                         # origin candidates whose values were made finite
    pick_origin(events, first_nans, candidates, lineage.absorbed)

Every non-finite tensor an op makes carries its roots: the origin candidates (trace.py's rule,
an op that makes NaN/Inf from clean inputs) whose non-finite values flowed into it, per batch
row where the tensor has the batch's rows (`ALL` where it has none: a (T, T) causal mask).
A forward op that takes non-finite values in and gives finite floats out in a row (a softmax
over a -inf mask, `exp(-inf) = 0`, a `masked_fill` over them) absorbs those rows' roots: a root
absorbed anywhere in the step made its non-finite values on purpose, or at least harmlessly.
(Not a backward op: its finite gradient says nothing of the forward values it was given.)

The origin (`pick_origin`) is then the first root of the first NaN that is not absorbed, so a
causal mask built as `log(tril(ones))` (-inf above the diagonal, softmaxed to 0) is not the
origin of a NaN that a LayerNorm makes later from a sample's absurd value; with no NaN at all,
the first candidate that is not absorbed (an overflow to Inf that nothing makes finite again).
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ckptlab.training.world import local

# Ops that read only their input's shape and dtype, or pick some of its elements: their finite
# output absorbs nothing (the non-finite elements they did not pick are still there). Views
# (`select`, `slice`, ...) are found by their storage.
VALUE_BLIND = tuple(
    f"aten.{k}"
    for k in (
        "ones_like",
        "zeros_like",
        "empty_like",
        "full_like",
        "rand",
        "new_",
        "index.",
        "index_select",
        "gather",
        "masked_select",
        "take",
        "embedding.",
    )
)
ALL = -1  # the key of a tensor's roots when it has no batch rows
Roots = dict[int, frozenset[int]]  # batch row (or ALL) -> indices of the candidate events


def rows_of(shape: tuple[int, ...], index: list[int], rows: int | None) -> int | None:
    """Map an element index to a batch row, for the common layouts: (B, ...), (B*k, ...)
    (flattened tokens, batch-major heads) and (T, B, ...) (sequence-first)."""
    if not rows or not shape:
        return None
    if shape[0] == rows:
        return index[0]
    if shape[0] > rows and shape[0] % rows == 0:
        return index[0] // (shape[0] // rows)
    if len(shape) > 1 and shape[1] == rows:
        return index[1]
    return None


def _layout(shape: tuple[int, ...], n: int | None) -> int | None:
    """The dimension holding a tensor's batch rows for the layouts rows_of maps: 0 for (B, ...)
    and (B*k, ...), 1 for (T, B, ...); None when it has no batch rows."""
    if not n or not shape:
        return None
    if shape[0] == n or (shape[0] > n and shape[0] % n == 0):
        return 0
    return 1 if len(shape) > 1 and shape[1] == n else None


def _by_row(x: torch.Tensor, n: int) -> torch.Tensor:
    """`x` as (n, -1), its batch rows first (`_layout` is not None)."""
    return (x if _layout(tuple(x.shape), n) == 0 else x.transpose(0, 1)).reshape(n, -1)


def row_counts(bad: torch.Tensor, n: int | None) -> torch.Tensor | None:
    """Per batch row, how many elements of the boolean tensor `bad` are set, for the layouts
    rows_of maps: (B, ...), (B*k, ...) batch-major, (T, B, ...) sequence-first. None when
    the tensor has no such rows."""
    if _layout(tuple(bad.shape), n) is None:
        return None
    return _by_row(bad, n or 0).sum(1)


def writes(op: str) -> bool:
    """Whether the aten op writes into a tensor it was given (`copy_`, `add_`, an `.out`)."""
    parts = op.split(".")
    return len(parts) > 1 and (parts[1].endswith("_") or parts[-1] == "out")


def bad_rows(t: torch.Tensor, rows: tuple[int, int | None], every: bool = False) -> set[int] | None:
    """The batch rows (`rows`: the first row and count of the rows the op works on) holding a
    non-finite element of `t` (`every`: all its elements are); None when `t` has no batch rows."""
    first, n = rows
    t = local(t)  # a DTensor: this process's shard
    if n is None or _layout(tuple(t.shape), n) is None:
        return None
    if every:
        return set(range(first, first + n))
    with torch.no_grad():
        flags = _by_row(~torch.isfinite(t), n).any(1)
    return {first + r for r in flags.nonzero().flatten().tolist()}


class Lineage:
    """The roots of every live non-finite tensor of a traced step, and the absorbed roots."""

    def __init__(self) -> None:
        # tensor -> Roots. No version check: every op that writes into a tensor is traced and
        # sets it anew (and its version is bumped only after the op returns to us).
        self._roots = WeakIdKeyDictionary()
        self.absorbed: set[int] = set()

    def roots_of(self, t: torch.Tensor) -> Roots:
        """A non-finite tensor's roots; empty for one no traced op made (the batch, a weight)."""
        try:
            return self._roots.get(t) or {}
        except TypeError:
            return {}

    def _keep(self, t: torch.Tensor, roots: Roots) -> None:
        try:
            if roots:
                self._roots[t] = roots
            else:
                self._roots.pop(t, None)
        except TypeError:  # tensors without weakref support
            pass

    def _into_base(self, base: torch.Tensor, roots: frozenset[int]) -> None:
        """A view of `base` was written in place: `base` holds `roots` now too."""
        old = self.roots_of(base)
        self._keep(base, {ALL: frozenset().union(*old.values()) | roots})

    def alias(self, out, inp) -> None:
        """`out` holds `inp`'s values (an untraced `detach`): the same roots."""
        if isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor):
            self._keep(out, self.roots_of(inp))

    def before(self, inputs: list, summaries: list) -> list[tuple[torch.Tensor, Roots]]:
        """An op's non-finite float inputs with their roots (`summaries`: trace.py's, of its
        tensor inputs in order), taken before it runs (an in-place op changes them)."""
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        return [(t, self.roots_of(t)) for t, s in zip(tensors, summaries) if not s.finite and t.is_floating_point()]

    def op(self, ev, before: list, outputs: list[torch.Tensor], rows: tuple[int, int | None]) -> None:
        """One traced op (`ev`: its OpEvent, whose `outputs` summarize `outputs`; `before`:
        `before`'s answer): the roots of its non-finite outputs (into `ev.roots`), and the
        roots it absorbs."""
        bad_in = [r for _, r in before]
        own = frozenset([ev.index]) if ev.is_origin_candidate else frozenset()
        floats = [(t, s) for t, s in zip(outputs, ev.outputs) if t.is_floating_point()]
        out_rows: set[int] | None = set()
        ev.roots = own
        if not own and not any(bad_in):  # nothing to carry (non-finite values from outside)
            for t, _ in floats:
                self._keep(t, {})
            return
        for t, s in floats:
            if s.finite:
                self._keep(t, {})
                continue
            where = bad_rows(t, rows, every=s.nan + s.posinf + s.neginf == t.numel())
            if where is None or out_rows is None:
                out_rows = None
            else:
                out_rows |= where
            keys = [ALL] if where is None else sorted(where)
            roots = {k: own.union(*(_at(r, k) for r in bad_in)) for k in keys}
            self._keep(t, {k: v for k, v in roots.items() if v})
            ev.roots = ev.roots.union(*roots.values())
            if t._base is not None and writes(ev.op):
                self._into_base(t._base, ev.roots)  # `out[:, i] = h`: the written tensor holds them
        if not floats or out_rows is None or ev.phase != "forward" or ev.op.startswith(VALUE_BLIND):
            return  # (a backward op's finite gradient says nothing of the forward values it saw)
        written = {id(t) for t in outputs}
        viewed = {_storage(t) for t in outputs} - {None}
        for t, r in before:  # rows non-finite in, finite out: absorbed (not when overwritten or viewed)
            if id(t) not in written and _storage(t) not in viewed:
                for k, v in r.items():
                    if k not in out_rows and (k != ALL or not out_rows):
                        self.absorbed |= v


def _storage(t: torch.Tensor) -> int | None:
    try:
        return local(t).untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (meta, DTensor, ...)
        return None


def _at(roots: Roots, key: int) -> frozenset[int]:
    """An input's roots that reach an output's row `key` (ALL: all of them)."""
    if key == ALL:
        return frozenset().union(*roots.values())
    return roots.get(key, frozenset()) | roots.get(ALL, frozenset())


def pick_origin(events: list, first_nans: list[int], candidates: list, absorbed: set[int]):
    """The origin event (see the module docstring), or None: the first NaN with a root not
    absorbed names its first such root (a NaN whose every root was absorbed was guarded: the
    next one is looked at); with no such NaN, or when the first NaN has no root (it came from
    the batch or the weights, or by a way the lineage does not follow), the first candidate
    not absorbed; with none, the first forward op that made a NaN from absorbed values only
    (a softmax over a row whose every key a mask set to -inf)."""
    guarded = None  # the first forward NaN made from absorbed values only
    for i in first_nans:
        roots = events[i].roots
        if not roots:
            break  # (or reached it by a way not followed: the first candidate not absorbed, below)
        live = roots - absorbed
        if live:
            return events[min(live)]
        if guarded is None and events[i].phase == "forward":
            guarded = events[i]
    candidate = next((c for c in candidates if c.index not in absorbed), None)
    # A mask's -inf, harmless in every other row, turned into NaN here (a softmax over a row
    # whose every key is masked: an all-padding document): this op is where the fault starts.
    return candidate if candidate is not None else guarded
