"""Stream tensors (or A/B pairs of tensors) through accumulators on all cores, memory-flat.

    accs = stream([Job(a_ref, b_ref, lambda: PairAccumulator(a_ref.dtype, b_ref.dtype)), ...])

A tensor stored raw in a file is cut into segments of SEGMENT_BYTES; each segment is a unit
of work for a thread: read it (an mmap view, or a pread into that thread's buffer), as a numpy
array, count it, release its pages. numpy releases the GIL inside its loops, so threads scale;
partial accumulators merge per job. Resident memory stays near workers x 2 x SEGMENT_BYTES
whatever the checkpoint's size. Nothing here needs torch.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptlab import stats
from ckptlab.io.base import TensorRef

# 32 MiB: big enough that per-unit costs (a syscall, an accumulator) vanish, small enough that
# two threads x two files x one segment stay ~128 MiB resident.
SEGMENT_BYTES = 32 << 20


@dataclass
class Job:
    a: TensorRef
    b: TensorRef | None  # None: statistics of `a` alone
    make: Callable[[], Any]  # a fresh accumulator: .add(a[, b, offset]) and .merge(other)
    finish: Callable[[Any], Any] | None = None  # run on the merged accumulator, in a worker


@dataclass(frozen=True)
class _Unit:
    job: int
    start: int
    count: int


def default_workers() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8))  # beyond ~8 threads, memory bandwidth is the limit


def stream(jobs: Sequence[Job], *, workers: int | None = None, progress: Callable[[int], None] | None = None) -> list:
    """Run every job; returns per job, in order, its merged accumulator (or what its `finish`
    made of it: finishing in the worker overlaps it with the reading of other tensors)."""
    units = [u for i, job in enumerate(jobs) for u in _units(i, job)]
    merged: list = [None] * len(jobs)
    # Partials merge in segment order, whatever order threads finish in: float sums then add
    # up the same way every run, so results are bit-for-bit reproducible.
    next_start = [0] * len(jobs)
    waiting: list[dict] = [{} for _ in jobs]
    lock = threading.Lock()
    local = threading.local()

    def run(unit: _Unit) -> None:
        job = jobs[unit.job]
        acc = job.make()
        scratch = _scratch(local)
        if job.b is None:
            acc.add(job.a.segment(unit.start, unit.count, scratch[0]))
        else:
            acc.add(
                job.a.segment(unit.start, unit.count, scratch[0]),
                job.b.segment(unit.start, unit.count, scratch[1]),
                unit.start,
            )
        job.a.release(unit.start, unit.count)
        if job.b is not None:
            job.b.release(unit.start, unit.count)
        j = unit.job
        with lock:
            waiting[j][unit.start] = (unit.count, acc)
            while next_start[j] in waiting[j]:
                count, part = waiting[j].pop(next_start[j])
                merged[j] = part if merged[j] is None else merged[j].merge(part)
                next_start[j] += count
            complete = next_start[j] == job.a.numel
        if complete and job.finish is not None:  # no other unit of this job is left to touch it
            merged[j] = job.finish(merged[j])
        if progress:
            progress(unit.count * (job.a.itemsize + (job.b.itemsize if job.b is not None else 0)))

    workers = workers or default_workers()
    if workers == 1:
        for unit in units:
            run(unit)
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="ckptlab-stream") as pool:
            futures = [pool.submit(run, u) for u in units]
            done, pending = wait(futures, return_when=FIRST_EXCEPTION)
            for f in pending:
                f.cancel()
            for f in futures:
                if f.done() and not f.cancelled() and f.exception() is not None:
                    raise f.exception()
    for i, job in enumerate(jobs):
        if merged[i] is None:  # an empty tensor: nothing was added
            merged[i] = job.make() if job.finish is None else job.finish(job.make())
    return merged


def _units(index: int, job: Job) -> list[_Unit]:
    n = job.a.numel
    if n == 0:
        return []
    itemsize = max(job.a.itemsize, job.b.itemsize if job.b is not None else 1)
    step = max(stats.CHUNK, SEGMENT_BYTES // itemsize // stats.CHUNK * stats.CHUNK)  # whole chunks
    if not (job.a.splittable and (job.b is None or job.b.splittable)):
        step = n
    return [_Unit(index, start, min(step, n - start)) for start in range(0, n, step)]


def _scratch(local: threading.local) -> tuple[np.ndarray, np.ndarray]:
    """This thread's two read buffers (used by sequential reads only; allocated on first use)."""
    bufs = getattr(local, "bufs", None)
    if bufs is None:
        bufs = local.bufs = (np.empty(SEGMENT_BYTES, dtype=np.uint8), np.empty(SEGMENT_BYTES, dtype=np.uint8))
    return bufs
