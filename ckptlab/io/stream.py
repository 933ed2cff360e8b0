"""Stream tensors (or A/B pairs of tensors) through accumulators on all cores, memory-flat.

    accs = stream([Job(a_ref, b_ref, lambda: PairAccumulator(a_ref.dtype, b_ref.dtype)), ...])

A tensor stored raw in a file is cut into segments of SEGMENT_BYTES; each segment is a unit
of work for a worker: read it (an mmap view, or a pread into that worker's buffer), as a numpy
array, count it, release its pages. Partial accumulators merge per job, in segment order.
Resident memory stays near workers x 2 x SEGMENT_BYTES whatever the checkpoint's size.
Nothing here needs torch.

Workers are forked processes where they pay (Linux, every tensor in a file, at least
PROCESS_MIN_BYTES in all, a caller under FORK_MAX_RSS without CUDA initialised, not turned
off by CKPTLAB_PROCESSES=0), threads otherwise. numpy releases the GIL inside most of its loops,
but a chunk's work is ~20 short numpy calls, and its pattern count (`np.bincount`) keeps the
GIL while it runs: two threads counting in-memory pieces do 1.03-1.11x the work of one, two
processes 1.4x (scripts/bench_stream_workers.py, docs/performance.md). A process reads the same mapped files (mapped before the
fork, inherited), sends each unit's partial accumulator back through a pipe, and the parent
merges them in segment order, so the results are the same bit for bit either way. A worker
runs none of the caller's signal handlers or finalizers, ignores Ctrl-C (the parent stops the
workers) and exits with os._exit.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_any
from typing import Any, cast

import numpy as np

from ckptlab.errors import CkptlabError, CorruptFileError
from ckptlab.io.base import TensorRef
from ckptlab.io.files import read_text
from ckptlab.io.mapped import FileTensor
from ckptlab.stats.kernels import CHUNK, count_without_torch
from ckptlab.stats.patterns import codec_for

# 32 MiB: big enough that per-unit costs (a syscall, an accumulator) vanish, small enough that
# two threads x two files x one segment stay ~128 MiB resident.
SEGMENT_BYTES = 32 << 20
# Below this many bytes in all, threads: forking costs ~5-20 ms a worker (more for a process
# with torch loaded), what two processes save on 128 MiB is ~50 ms.
PROCESS_MIN_BYTES = 128 << 20
# ... and threads in a process already this large (a training process calling ckptlab.diff).
FORK_MAX_RSS = 4 << 30


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


def stream(
    jobs: Sequence[Job],
    *,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
    processes: bool | None = None,
) -> list:
    """Run every job; returns per job, in order, its merged accumulator (or what its `finish`
    made of it). `processes`: None chooses (see the module docstring); True forks worker
    processes where that is possible, False keeps to threads."""
    units = [u for i, job in enumerate(jobs) for u in _units(i, job)]
    workers = min(workers or default_workers(), max(1, len(units)))
    merge = _Merger(jobs, progress)
    local = threading.local()  # each worker thread's read buffers, freed with this call
    if workers > 1 and _use_processes(jobs, processes) and _run_in_processes(jobs, units, workers, merge):
        pass
    elif workers > 1:
        _run_in_threads(jobs, units, workers, merge, local)
    else:
        for unit in units:
            merge.add(unit, _count_unit(jobs[unit.job], unit, local))
    return merge.results()


class _Merger:
    """Partials merge in segment order, whatever order the workers finish in: float sums then
    add up the same way every run, so results are bit-for-bit reproducible. A job's `finish`
    runs once its last unit is merged (in the worker thread that merged it)."""

    def __init__(self, jobs: Sequence[Job], progress):
        self.jobs, self.progress = jobs, progress
        self.merged: list = [None] * len(jobs)
        self.next_start = [0] * len(jobs)
        self.waiting: list[dict] = [{} for _ in jobs]
        self.lock = threading.Lock()

    def add(self, unit: _Unit, acc) -> None:
        j, job = unit.job, self.jobs[unit.job]
        with self.lock:
            self.waiting[j][unit.start] = (unit.count, acc)
            while self.next_start[j] in self.waiting[j]:
                count, part = self.waiting[j].pop(self.next_start[j])
                self.merged[j] = part if self.merged[j] is None else self.merged[j].merge(part)
                self.next_start[j] += count
            complete = self.next_start[j] == job.a.numel
        if complete and job.finish is not None:  # no other unit of this job is left to touch it
            self.merged[j] = job.finish(self.merged[j])
        if self.progress:
            self.progress(unit.count * (job.a.itemsize + (job.b.itemsize if job.b is not None else 0)))

    def results(self) -> list:
        for i, job in enumerate(self.jobs):
            if self.merged[i] is None:  # an empty tensor: nothing was added
                self.merged[i] = job.make() if job.finish is None else job.finish(job.make())
        return self.merged


def _count_unit(job: Job, unit: _Unit, local: threading.local):
    """One unit's partial accumulator: read, count, release."""
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
    return acc


def _run_in_threads(
    jobs: Sequence[Job], units: list[_Unit], workers: int, merge: _Merger, local: threading.local
) -> None:
    with ThreadPoolExecutor(workers, thread_name_prefix="ckptlab-stream") as pool:
        futures = [pool.submit(lambda u: merge.add(u, _count_unit(jobs[u.job], u, local)), u) for u in units]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        for f in futures:
            error = f.exception() if f.done() and not f.cancelled() else None
            if error is not None:
                raise error


# --- worker processes ------------------------------------------------------------------------

# Python 3.12+ warns when a process with other threads (a progress display, say) forks. The
# children run only numpy on memory and file descriptors they own (no lock another thread
# could hold is taken there: the files are mapped before the fork), so that warning is
# silenced for the forks made here, and only those.
warnings.filterwarnings(
    "ignore", message=r".*fork\(\) may lead to deadlocks", category=DeprecationWarning, module=__name__
)


def _use_processes(jobs: Sequence[Job], asked: bool | None) -> bool:
    if asked is False or not hasattr(os, "fork") or not sys.platform.startswith("linux"):
        return False  # (macOS: system libraries are not fork-safe)
    if os.environ.get("CKPTLAB_PROCESSES", "").strip().lower() in ("0", "no", "false", "off"):
        return False
    in_files = all(isinstance(r, FileTensor) for job in jobs for r in (job.a, job.b) if r is not None)
    if not in_files:  # a tensor in memory may be torch's, even on a GPU: not touched after a fork
        return False
    if asked:
        return True
    if _resident_bytes() > FORK_MAX_RSS or _cuda_initialized():  # e.g. a training process
        return False
    return sum(job.a.nbytes + (job.b.nbytes if job.b is not None else 0) for job in jobs) >= PROCESS_MIN_BYTES


def _resident_bytes() -> int:
    try:
        return int(read_text("/proc/self/statm").split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, CorruptFileError):
        return 0


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")  # (never imported here)
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a partial or odd torch: assume the worst
        return True


def _run_in_processes(jobs: Sequence[Job], units: list[_Unit], workers: int, merge: _Merger) -> bool:
    """Fork `workers` processes that take units off a shared counter (a busy core's worker
    takes fewer) and send back (unit index, partial accumulator); merge them here. False,
    having done nothing, when the system refuses (no shared memory, no fork)."""
    ctx = multiprocessing.get_context("fork")
    try:
        claimed = ctx.Value("q", 0)  # the next unit index to take
    except (OSError, ImportError):  # no usable /dev/shm (some sandboxes)
        return False
    _before_fork(jobs)
    children: dict[int, Connection] = {}
    reaped: set[int] = set()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _CAUGHT)  # no handler runs between fork and set-up
    try:
        for _ in range(workers):
            if not _start_worker(ctx, blocked, children, lambda send: _worker(jobs, units, claimed, send)):
                return False  # (the finally below stops the ones already started)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        _collect(units, children, reaped, merge)
        return True
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        _stop(children, reaped)


def _before_fork(jobs: Sequence[Job]) -> None:
    """What every worker needs, made once here so that each inherits it."""
    for ref in {r.dtype: r for job in jobs for r in (job.a, job.b) if r is not None}.values():
        codec_for(ref.dtype)  # (cached: built once here, not once per worker)
    for ref in (r for job in jobs for r in (job.a, job.b) if r is not None):
        assert isinstance(ref, FileTensor), "workers are forked only for tensors in files (_use_processes)"
        if not ref.file.sequential:
            ref.file.mapping()  # mapped here: every worker inherits the mapping, none takes its lock


def _start_worker(ctx, blocked, children: dict[int, Connection], work: Callable[[Connection], None]) -> bool:
    """Fork one worker running `work(send)`; its pipe's reading end goes into `children`.
    False when the system refuses (out of file descriptors, memory or processes)."""
    try:
        recv, send = ctx.Pipe(duplex=False)
    except OSError:
        return False
    try:
        pid = os.fork()
    except OSError:
        recv.close()
        send.close()
        return False
    if pid == 0:  # the worker: never returns
        try:
            _worker_setup(blocked, [recv, *children.values()])
            work(send)
        finally:
            os._exit(1)
    children[pid] = recv
    send.close()
    return True


def _collect(units: list[_Unit], children: dict[int, Connection], reaped: set[int], merge: _Merger) -> None:
    """Merge every unit's result as the workers send them; a worker's error raised here."""
    done = 0
    open_pipes = dict(children)
    while done < len(units):
        if not open_pipes:
            raise CkptlabError("a diff worker process exited before its work was done")
        for conn in cast("list[Connection]", wait_any(list(open_pipes.values()))):  # (those given it)
            try:
                kind, index, payload = conn.recv()
            except (EOFError, OSError):  # it exited, or died in the middle of a message
                pid = next(p for p, c in open_pipes.items() if c is conn)
                del open_pipes[pid]
                status = _reap(pid)
                reaped.add(pid)
                if status != 0:
                    raise CkptlabError(f"a diff worker process died ({_exit_text(status)})") from None
                continue
            if kind == "error":
                error, remote = payload
                raise error from _WorkerTraceback(remote)
            merge.add(units[index], payload)
            done += 1


def _stop(children: dict[int, Connection], reaped: set[int]) -> None:
    alive = [pid for pid in children if pid not in reaped]
    for pid in alive:  # all killed first, then reaped (long gone when all went well)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in alive:
        _reap(pid)
    for conn in children.values():
        conn.close()


# Signals whose handlers (the parent's: a framework's "save on SIGTERM") must not run in a worker.
_CAUGHT = set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}


def _worker_setup(blocked, inherited: list[Connection]) -> None:
    """In a forked child, before anything else: Ctrl-C is the parent's to handle (it stops the
    workers), other signals do what they do by default, the collector stays off (no finalizer of
    an inherited object runs here), and the pipes of other workers are closed."""
    gc.disable()
    for sig in _CAUGHT:
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            handler = signal.getsignal(sig)
            if sig == signal.SIGINT:
                signal.signal(sig, signal.SIG_IGN)
            elif callable(handler) and handler not in (signal.SIG_DFL, signal.SIG_IGN):
                signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    for conn in inherited:
        conn.close()


def _worker(jobs: Sequence[Job], units: list[_Unit], claimed, send: Connection) -> None:
    """Count units until none is left, then exit without running the parent's exit handlers
    or finalizers (the caller's os._exit)."""
    code = 0
    try:
        count_without_torch()
        local = threading.local()
        while True:
            with claimed.get_lock():
                index = claimed.value
                claimed.value += 1
            if index >= len(units):
                break
            unit = units[index]
            try:
                acc = _count_unit(jobs[unit.job], unit, local)
            except Exception as e:  # noqa: BLE001 - sent to the parent, which raises it
                send.send(("error", index, (_picklable(e), traceback.format_exc())))
                break
            send.send(("part", index, acc))
    except BaseException:  # noqa: BLE001 - a broken pipe (the parent is gone)
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            send.close()
        os._exit(code)


class _WorkerTraceback(Exception):
    """Where, in a worker process, the error being raised came from (its `__cause__`)."""

    def __init__(self, text: str):
        super().__init__(text)

    def __str__(self) -> str:
        return "\n\nin the diff worker process:\n" + self.args[0]


def _picklable(e: Exception) -> Exception:
    """The error as it is when it survives the pipe; a RuntimeError that names it otherwise
    (never a CkptlabError: the CLI shows those as expected one-line failures, not as bugs)."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - anything that does not survive the pipe is described
        return RuntimeError(f"{type(e).__name__}: {e}")


def _reap(pid: int) -> int | None:
    """The child's wait status once it has exited; None when it is not ours to reap any more
    (reaped elsewhere, or SIGCHLD ignored): its status is unknown."""
    try:
        return os.waitpid(pid, 0)[1]
    except ChildProcessError:
        return None


def _exit_text(status: int | None) -> str:
    if status is None:
        return "its exit status is unknown"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = signal.strsignal(sig) or f"signal {sig}"
        with contextlib.suppress(ValueError):
            name = signal.Signals(sig).name
        return f"killed by {name}" + (" - out of memory?" if sig == signal.SIGKILL else "")
    return f"exit status {os.WEXITSTATUS(status)}"


def _units(index: int, job: Job) -> list[_Unit]:
    n = job.a.numel
    if n == 0:
        return []
    itemsize = max(job.a.itemsize, job.b.itemsize if job.b is not None else 1)
    step = max(CHUNK, SEGMENT_BYTES // itemsize // CHUNK * CHUNK)  # whole chunks
    if not (job.a.splittable and (job.b is None or job.b.splittable)):
        step = n
    return [_Unit(index, start, min(step, n - start)) for start in range(0, n, step)]


def _scratch(local: threading.local) -> tuple[np.ndarray, np.ndarray]:
    """This thread's two read buffers (used by sequential reads only; allocated on first use)."""
    bufs = getattr(local, "bufs", None)
    if bufs is None:
        bufs = local.bufs = (np.empty(SEGMENT_BYTES, dtype=np.uint8), np.empty(SEGMENT_BYTES, dtype=np.uint8))
    return bufs
