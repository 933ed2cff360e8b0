"""Where each recorded step's time went, and the memory it used, measured on the host without
waiting for the device (no `torch.cuda.synchronize`): what `ckptlab report` judges as
`input_bound`, `slow_steps`, `throughput_drop` and `memory_pressure` (docs/report.md).

    meter = SystemMeter(on_cuda=False)
    meter.begin()                       # a step enters the Recorder: the data wait ends
    meter.batch(batch, sample_ids)      # its samples and tokens
    meter.checkpointed(t0, taken=True, wait=0.0)   # its checkpoint, begun at t0, is taken
    fields = meter.end(ckpt_wait)       # its fields: {"data_wait", "wall_time", "samples", ...}
    meter.returned()                    # its record written, it returns to the loop

The fields (docs/run-format.md, "step"): `data_wait` (seconds from the previous step's return to
this step's entry: data loading, logging, anything the loop does between steps), `wall_time`
(seconds from the previous step's end to this one's: one whole turn of the loop, the previous
record's writing included), `samples`,
`tokens`, `mem_peak`, `mem_limit` (a session's first step), and when not zero `ckpt_time`,
`gc_time`, `recompiles`, `swap`.

Cost: a few `time.perf_counter` calls, one `pread` of /proc/self/statm (~2 us) or two reads of
the CUDA allocator's counters, a shallow walk of the batch's top level, a garbage-collector
callback (~0.3 us a collection) and, when torch._dynamo was imported, one counter read.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ckptlab.analysis.batches import MICRO_BATCHES
from ckptlab.errors import CkptlabError
from ckptlab.io.files import open_fd, read_text

# /proc/self/status is read for the process's swapped-out memory once in this many steps (a
# 20-100 us read: too dear every step; swapping lasts far longer than 256 steps once it starts).
SWAP_EVERY = 256
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class SystemMeter:
    """One Recorder's per-step clock and memory meter (the training thread's; not thread-safe)."""

    def __init__(self, *, on_cuda: bool):
        self.on_cuda = on_cuda
        self._last_end: float | None = None  # when the previous step's fields were taken (None: no step yet)
        self._returned = 0.0  # when the previous step returned to the loop (its record written)
        self._begin = 0.0
        self._counted: dict[str, int] = {}
        self._gc_time, self._gc_start = 0.0, 0.0
        self._compiles = _compiles()
        self._n = 0
        self._ckpt_time = self._wait_before = 0.0  # the running step's checkpoint time, and its ckpt_wait then
        self._ckpt_aside = 0.0  # checkpoints taken since the last step's end, outside a step's opening
        self._statm = _open_statm() if not on_cuda else None
        self._limit = _memory_limit(on_cuda)
        gc.callbacks.append(self._on_gc)

    def begin(self) -> None:
        """A step enters the Recorder (`step` or `begin_step`)."""
        self._begin = time.perf_counter()

    def batch(self, batch: Any, sample_ids, tokens: int | None) -> None:
        """The step's batch: its rows (`samples`) and tokens (`tokens` given, else the batch's)."""
        self._counted = count(batch, sample_ids, tokens)

    def checkpointed(self, t0: float, *, taken: bool, wait: float) -> None:
        """The step's checkpoint part, begun at `t0`, is done: its whole time on this thread
        when one was `taken`, else only its `wait` for the last one's bytes (the step's ckpt_wait)."""
        self._ckpt_time = time.perf_counter() - t0 if taken or wait else 0.0
        self._wait_before = wait

    def end(self, ckpt_wait: float) -> dict:
        """The step returns, having waited `ckpt_wait` seconds in all for checkpoints: its fields
        (see the module docstring)."""
        now = time.perf_counter()
        ckpt_time = self._ckpt_time + (ckpt_wait - self._wait_before) + self._ckpt_aside  # (+ waits in the step)
        self._ckpt_time = self._wait_before = self._ckpt_aside = 0.0
        out: dict[str, Any] = {}
        if self._last_end is not None:
            out["data_wait"] = max(self._begin - max(self._returned, self._last_end), 0.0)
            out["wall_time"] = now - self._last_end
        else:  # a session's first step: nothing before it to measure from
            out["wall_time"] = now - self._begin
        self._last_end = now
        out.update(self._counted)
        self._counted = {}
        out["mem_peak"] = self._memory()
        if self._n == 0 and self._limit:  # (once a session: the device's, or the host's, memory)
            out["mem_limit"] = self._limit
        if ckpt_time > 0:
            out["ckpt_time"] = ckpt_time
        if ckpt_wait:
            out["ckpt_wait"] = ckpt_wait
        if self._gc_time > 0:
            out["gc_time"], self._gc_time = self._gc_time, 0.0
        compiles = _compiles()
        if compiles > self._compiles:
            out["recompiles"], self._compiles = compiles - self._compiles, compiles
        self._n += 1
        if not self.on_cuda and self._n % SWAP_EVERY == 1:
            swap = _swap()
            if swap:
                out["swap"] = swap
        return out

    def aside(self, take: Callable[..., float], *args) -> float:
        """`take(*args)`: a checkpoint taken outside a step's opening (`rec.checkpoint()`, a new
        best validation's): its time is ckptlab's (the next step's `ckpt_time`), not the loop's
        data wait."""
        t0 = time.perf_counter()
        try:
            return take(*args)
        finally:
            spent = time.perf_counter() - t0
            self._ckpt_aside += spent
            if self._returned >= self._begin:  # (between two steps: the data wait starts after it)
                self._returned += spent

    def returned(self) -> None:
        """The step returns to the loop, its record written: the next step's data wait starts
        now (the record's time is ckptlab's, in the next step's `wall_time`, not its data wait)."""
        self._returned = time.perf_counter()

    def skip(self) -> None:
        """A step failed: the next step's data wait starts now, not at the last one's end."""
        self._last_end = self._returned = time.perf_counter()
        self._counted = {}

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._statm is not None:
            os.close(self._statm)
            self._statm = None

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start:
            self._gc_time += time.perf_counter() - self._gc_start
            self._gc_start = 0.0

    def _memory(self) -> int:
        """CUDA: the allocator's peak since the previous step (then reset; counters only, no
        sync). The CPU: the resident set size now (its pages, from /proc/self/statm)."""
        if self.on_cuda:
            peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            return int(peak)
        if self._statm is not None:
            try:
                return int(os.pread(self._statm, 128, 0).split()[1]) * _PAGE
            except (OSError, IndexError, ValueError):
                pass
        import resource  # (not Linux: the peak so far, in KiB on Linux, bytes on macOS)

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)


def count(batch: Any, sample_ids, tokens: int | None) -> dict[str, int]:
    """{"samples": rows, "tokens": tokens} of a batch, each when known: rows from `sample_ids`,
    else the first tensor's first dimension; tokens as given, else the size of the first
    2-D integer tensor (token ids, (B, T)) in the batch's first levels (`_top_leaves`). A step of several
    micro-batches (the integrations' `{"micro_batches": [...]}`) adds up theirs."""
    if isinstance(batch, dict) and isinstance(batch.get(MICRO_BATCHES), list):
        parts = [count(part, None, None) for part in batch[MICRO_BATCHES]]
        out = {k: sum(p[k] for p in parts) for k in ("samples", "tokens") if parts and all(k in p for p in parts)}
        if sample_ids is not None and hasattr(sample_ids, "__len__"):
            out["samples"] = len(sample_ids)
        if tokens is not None:
            out["tokens"] = int(tokens)
        return out
    out = {}
    leaves = _top_leaves(batch)
    if sample_ids is not None and hasattr(sample_ids, "__len__"):
        out["samples"] = len(sample_ids)
    elif leaves and leaves[0].ndim:
        out["samples"] = int(leaves[0].shape[0])
    if tokens is None:
        for t in leaves:
            if t.ndim == 2 and (t.dtype in _INT_DTYPES if type(t) is torch.Tensor else _is_int(t)):
                tokens = t.shape[0] * t.shape[1]
                break
    if tokens is not None:
        out["tokens"] = int(tokens)
    return out


def _top_leaves(batch: Any, depth: int = 3) -> list:
    """The tensors and arrays of the batch's first `depth` levels of nesting (a dict of tensors,
    a tuple of inputs and targets, a framework's batch inside its record: {"batch": {...}}),
    in order; at most 16 items a level are looked at."""
    kind = type(batch)  # (`type` first: an isinstance of torch.Tensor costs ~1 us)
    if kind is torch.Tensor or kind is np.ndarray:
        return [batch]
    if kind is dict or (kind is not list and kind is not tuple and isinstance(batch, dict)):
        items: Any = batch.values()
    elif kind is list or kind is tuple or isinstance(batch, (list, tuple)):
        items = batch
    else:
        return [batch] if isinstance(batch, (torch.Tensor, np.ndarray)) else []
    if depth == 0:
        return []
    out = []
    for i, v in enumerate(items):
        if i == 16:
            break
        if type(v) is torch.Tensor:  # (the usual item: no call)
            out.append(v)
        else:
            out += _top_leaves(v, depth - 1)
    return out


_INT_DTYPES = frozenset([torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])


def _is_int(t) -> bool:
    if isinstance(t, torch.Tensor):
        return t.dtype in _INT_DTYPES
    return t.dtype.kind in "iu"


def _compiles() -> int:
    """Frames torch.compile has compiled in this process (recompilations included); 0 when
    torch._dynamo was never imported (nothing is imported to ask)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    if dynamo is None:
        return 0
    return int(dynamo.counters["frames"]["total"])


def _memory_limit(on_cuda: bool) -> int | None:
    """Bytes of memory `mem_peak` can reach: the CUDA device's, or the host's RAM."""
    try:
        if on_cuda:
            return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError, RuntimeError):
        return None


def _open_statm() -> int | None:
    try:
        return open_fd("/proc/self/statm")
    except (OSError, CkptlabError):
        return None


def _swap() -> int:
    """Bytes of this process's memory swapped out (VmSwap), 0 when unknown."""
    try:
        for line in read_text("/proc/self/status").splitlines():
            if line.startswith("VmSwap:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError, CkptlabError):
        pass
    return 0
