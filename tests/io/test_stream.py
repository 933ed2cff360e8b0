"""Streaming: memory stays flat as checkpoints grow, threads run at once, results don't depend
on how the work was cut or read."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from ckptlab.io import open_checkpoint
from ckptlab.io import stream as streaming
from ckptlab.io.base import MemoryTensor
from ckptlab.io.stream import Job, stream
from ckptlab.stats.pair import PairAccumulator


def _rss_file_kb() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssFile:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


class PeakRss:
    """Polls this process's file-backed resident memory (mmap'd pages) from a thread."""

    def __enter__(self):
        self.base = self.peak = _rss_file_kb()
        self._stop = False
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()
        return self

    def _poll(self):
        while not self._stop:
            self.peak = max(self.peak, _rss_file_kb())
            time.sleep(0.0005)

    def __exit__(self, *exc):
        self._stop = True
        self._t.join()
        self.peak = max(self.peak, _rss_file_kb())

    @property
    def grew_mb(self) -> float:
        return (self.peak - self.base) / 1024


def _pair_files(tmp_path, n: int):
    a = torch.randn(n)
    b = a + 1e-3 * torch.randn(n)
    safetensors.torch.save_file({"w": a}, tmp_path / "a.safetensors")
    safetensors.torch.save_file({"w": b}, tmp_path / "b.safetensors")
    return a, b


def _jobs(sd_a, sd_b):
    ra, rb = sd_a.info("w"), sd_b.info("w")
    return [Job(ra, rb, lambda: PairAccumulator(ra.dtype, rb.dtype))]


@pytest.mark.skipif(_rss_file_kb() is None, reason="needs /proc/self/status (Linux)")
def test_mapped_pages_are_released_so_memory_stays_flat(tmp_path, monkeypatch):
    monkeypatch.setattr(streaming, "SEGMENT_BYTES", 2 << 20)
    _pair_files(tmp_path, 24 << 20)  # 2 x 96 MB
    sd_a, sd_b = open_checkpoint(tmp_path / "a.safetensors"), open_checkpoint(tmp_path / "b.safetensors")
    with PeakRss() as flat:  # (threads: worker processes' pages are not this process's)
        stream(_jobs(sd_a, sd_b), workers=2, processes=False)
    # Without releasing, every page read stays resident: the whole 192 MB.
    monkeypatch.setattr("ckptlab.io.mapped.MappedFile.release", lambda self, offset, nbytes: None)
    sd_a, sd_b = open_checkpoint(tmp_path / "a.safetensors"), open_checkpoint(tmp_path / "b.safetensors")
    with PeakRss() as kept:
        stream(_jobs(sd_a, sd_b), workers=2, processes=False)
    assert flat.grew_mb < 48, flat.grew_mb
    assert kept.grew_mb > 150, kept.grew_mb  # the measurement itself can see the difference


def test_units_run_concurrently_on_two_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(streaming, "SEGMENT_BYTES", 1 << 20)
    _pair_files(tmp_path, 1 << 20)
    sd_a, sd_b = open_checkpoint(tmp_path / "a.safetensors"), open_checkpoint(tmp_path / "b.safetensors")
    ra, rb = sd_a.info("w"), sd_b.info("w")
    both = threading.Barrier(2, timeout=20)
    threads = set()

    def make():
        threads.add(threading.get_ident())
        if len(threads) <= 2 and both.n_waiting < 2:
            try:
                both.wait()  # returns only when a second thread is inside a unit at the same time
            except threading.BrokenBarrierError:
                pass
        return PairAccumulator(ra.dtype, rb.dtype)

    stream([Job(ra, rb, make)], workers=2, processes=False)
    assert len(threads) == 2 and not both.broken


def test_results_do_not_depend_on_workers_segments_or_reads(tmp_path, monkeypatch):
    a, b = _pair_files(tmp_path, 3 << 18)
    b[123_457] = float("nan")
    b[700_000] = a[700_000] + 7
    safetensors.torch.save_file({"w": b}, tmp_path / "b.safetensors")
    results = []
    for workers, segment, sequential, processes in [
        (1, 64 << 20, False, False),
        (2, 1 << 20, False, False),
        (2, 1 << 20, True, False),
        (1, 3 << 20, True, False),
        (2, 1 << 20, False, True),  # worker processes
        (3, 1 << 20, True, True),
    ]:
        monkeypatch.setattr(streaming, "SEGMENT_BYTES", segment)
        sd_a = open_checkpoint(tmp_path / "a.safetensors", sequential=sequential)
        sd_b = open_checkpoint(tmp_path / "b.safetensors", sequential=sequential)
        results.append(stream(_jobs(sd_a, sd_b), workers=workers, processes=processes)[0].result())
    first = results[0]
    assert first.delta.max_index == 700_000 and first.b.nan == 1
    # same segments, other reads or other workers: bit for bit
    assert _same(results[2], results[1]) and _same(results[4], results[1]) and _same(results[5], results[1])
    for r in results[1:]:
        assert (r.delta.compared, r.delta.unchanged, r.delta.max_index, r.delta.max_abs, r.w1) == (
            first.delta.compared,
            first.delta.unchanged,
            first.delta.max_index,
            first.delta.max_abs,
            first.w1,
        )
        assert r.delta.l2 == pytest.approx(first.delta.l2, rel=1e-12)
        for side in ("a", "b"):
            x, y = getattr(r, side), getattr(first, side)
            assert (x.numel, x.nan, x.min, x.max, x.quantiles) == (y.numel, y.nan, y.min, y.max, y.quantiles)
            assert x.mean == pytest.approx(y.mean, rel=1e-12) and x.l2 == pytest.approx(y.l2, rel=1e-12)
            assert (x.hist == y.hist).all()


def _same(x, y) -> bool:
    return (
        x.delta == y.delta
        and x.w1 == y.w1
        and all(
            (getattr(x, s).l2, getattr(x, s).mean, getattr(x, s).std)
            == (getattr(y, s).l2, getattr(y, s).mean, getattr(y, s).std)
            for s in "ab"
        )
    )


def test_a_failing_read_stops_the_stream_with_its_error(tmp_path):
    _pair_files(tmp_path, 1 << 16)
    sd_a = open_checkpoint(tmp_path / "a.safetensors", sequential=True)
    sd_b = open_checkpoint(tmp_path / "b.safetensors", sequential=True)
    with open(tmp_path / "b.safetensors", "r+b") as f:  # the file shrinks after it was opened
        f.truncate(1000)
    from ckptlab.errors import CorruptFileError

    for processes in (False, True):
        with pytest.raises(CorruptFileError, match="truncated") as caught:
            stream(_jobs(sd_a, sd_b), workers=2, processes=processes)
        assert caught.value.path == str(tmp_path / "b.safetensors")  # the same error, from a worker process too


needs_fork = pytest.mark.skipif(not streaming._use_processes([], True), reason="worker processes need Linux (fork)")


@needs_fork
def test_worker_processes_take_every_unit_once_and_report_progress(tmp_path, monkeypatch):
    monkeypatch.setattr(streaming, "SEGMENT_BYTES", 1 << 19)
    _pair_files(tmp_path, 1 << 20)  # 8 units of 128K elements
    sd_a, sd_b = open_checkpoint(tmp_path / "a.safetensors"), open_checkpoint(tmp_path / "b.safetensors")
    done = []
    parent = os.getpid()

    def make():
        assert os.getpid() != parent  # counted in a worker process, not here
        return PairAccumulator("float32", "float32")

    ra, rb = sd_a.info("w"), sd_b.info("w")
    merged = stream([Job(ra, rb, make, finish=PairAccumulator.result)], workers=2, progress=done.append, processes=True)
    assert merged[0].a.numel == 1 << 20 and merged[0].delta.compared == 1 << 20
    assert sum(done) == 2 * 4 * (1 << 20) and len(done) == 8


@needs_fork
def test_a_worker_process_that_dies_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(streaming, "SEGMENT_BYTES", 1 << 18)
    _pair_files(tmp_path, 1 << 18)
    sd_a, sd_b = open_checkpoint(tmp_path / "a.safetensors"), open_checkpoint(tmp_path / "b.safetensors")
    ra, rb = sd_a.info("w"), sd_b.info("w")

    def make():  # as the kernel's OOM killer would
        os.kill(os.getpid(), signal.SIGKILL)

    from ckptlab.errors import CkptlabError

    with pytest.raises(CkptlabError, match="a diff worker process died \\(killed by SIGKILL"):
        stream([Job(ra, rb, make)], workers=2, processes=True)


def test_large_file_diffs_use_worker_processes_and_small_ones_threads(tmp_path, monkeypatch):
    _pair_files(tmp_path, 1 << 10)
    sd_a, sd_b = open_checkpoint(tmp_path / "a.safetensors"), open_checkpoint(tmp_path / "b.safetensors")
    jobs = _jobs(sd_a, sd_b)
    assert not streaming._use_processes(jobs, None)
    assert not streaming._use_processes(jobs, False)
    monkeypatch.setattr(streaming, "PROCESS_MIN_BYTES", 1 << 10)
    assert streaming._use_processes(jobs, None) == streaming._use_processes([], True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # a process using a GPU: threads
    assert not streaming._use_processes(jobs, None)
    # A tensor in memory (possibly torch's, possibly on a GPU) is never counted after a fork.
    memory = Job(MemoryTensor(torch.zeros(4)), None, lambda: None)
    assert not streaming._use_processes([memory], True)


def _small_pair(tmp_path, monkeypatch):
    monkeypatch.setattr(streaming, "SEGMENT_BYTES", 1 << 19)
    _pair_files(tmp_path, 1 << 20)  # 8 units
    sd_a, sd_b = open_checkpoint(tmp_path / "a.safetensors"), open_checkpoint(tmp_path / "b.safetensors")
    return sd_a.info("w"), sd_b.info("w")


@needs_fork
def test_worker_processes_do_not_run_the_callers_signal_handlers(tmp_path, monkeypatch):
    """A training process's "save on SIGTERM" handler must not run in a diff's workers: there a
    SIGTERM does what it does by default, and Ctrl-C is left to the parent."""
    ra, rb = _small_pair(tmp_path, monkeypatch)
    marker = tmp_path / "handler-ran"
    previous = signal.signal(signal.SIGTERM, lambda *_: marker.write_text(str(os.getpid())))
    try:

        def interrupted():  # a Ctrl-C reaching a worker: ignored there
            os.kill(os.getpid(), signal.SIGINT)
            return PairAccumulator("float32", "float32")

        merged = stream([Job(ra, rb, interrupted)], workers=2, processes=True)
        assert merged[0].result().delta.compared == 1 << 20

        def terminated():
            os.kill(os.getpid(), signal.SIGTERM)
            return PairAccumulator("float32", "float32")

        from ckptlab.errors import CkptlabError

        with pytest.raises(CkptlabError, match="killed by SIGTERM"):
            stream([Job(ra, rb, terminated)], workers=2, processes=True)
        assert not marker.exists()
    finally:
        signal.signal(signal.SIGTERM, previous)


@needs_fork
def test_a_file_lock_held_by_another_thread_does_not_hang_the_workers(tmp_path, monkeypatch):
    ra, rb = _small_pair(tmp_path, monkeypatch)
    holding = threading.Event()

    def hold():  # another thread inside the file's lock for a while (a forked copy of it: forever)
        with rb.file._lock:
            holding.set()
            time.sleep(1.5)

    threading.Thread(target=hold, daemon=True).start()
    holding.wait(5)
    result = []
    run = threading.Thread(target=lambda: result.append(stream(_jobs_of(ra, rb), workers=2, processes=True)))
    run.start()
    run.join(30)
    assert not run.is_alive() and result[0][0].result().a.numel == 1 << 20


def _jobs_of(ra, rb):
    return [Job(ra, rb, lambda: PairAccumulator(ra.dtype, rb.dtype))]


@needs_fork
def test_only_workers_not_yet_reaped_are_killed(tmp_path, monkeypatch):
    """A process id is free for reuse once reaped: killing it then could hit another process."""
    ra, rb = _small_pair(tmp_path, monkeypatch)
    reaped, killed_after_reaping = set(), []
    real_wait, real_kill = os.waitpid, os.kill

    def waitpid(pid, options):
        out = real_wait(pid, options)
        reaped.add(pid)
        return out

    def kill(pid, sig):
        if pid in reaped:
            killed_after_reaping.append(pid)
        return real_kill(pid, sig)

    monkeypatch.setattr(os, "waitpid", waitpid)
    monkeypatch.setattr(os, "kill", kill)
    for _ in range(3):
        stream(_jobs_of(ra, rb), workers=2, processes=True)
    assert killed_after_reaping == []


def test_worker_exit_texts():
    assert streaming._exit_text(signal.SIGKILL) == "killed by SIGKILL - out of memory?"
    assert streaming._exit_text(3 << 8) == "exit status 3"
    assert streaming._exit_text(None) == "its exit status is unknown"
    rt = signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else 40  # no name in signal.Signals
    assert streaming._exit_text(int(rt)).startswith("killed by ")


def test_threads_when_processes_cannot_be_had(tmp_path, monkeypatch):
    ra, rb = _small_pair(tmp_path, monkeypatch)
    monkeypatch.setenv("CKPTLAB_PROCESSES", "0")
    assert not streaming._use_processes(_jobs_of(ra, rb), None)
    monkeypatch.delenv("CKPTLAB_PROCESSES")
    import multiprocessing.context

    def no_shared_memory(*args, **kwargs):
        raise OSError("no /dev/shm")

    monkeypatch.setattr(multiprocessing.context.BaseContext, "Value", no_shared_memory)
    merge = streaming._Merger(_jobs_of(ra, rb), None)
    assert streaming._run_in_processes(_jobs_of(ra, rb), [], 2, merge) is False
    merged = stream(_jobs_of(ra, rb), workers=2, processes=True)  # falls back to threads
    assert merged[0].result().delta.compared == 1 << 20


class _Unpicklable(Exception):
    def __init__(self, a, b):  # (pickle re-creates it with one argument: fails)
        super().__init__(f"{a}/{b}")


@needs_fork
def test_errors_raised_in_a_worker_carry_its_traceback(tmp_path, monkeypatch):
    ra, rb = _small_pair(tmp_path, monkeypatch)
    from ckptlab.errors import CorruptFileError

    def corrupt():
        raise CorruptFileError("bad bytes", path=tmp_path / "b.safetensors")

    with pytest.raises(CorruptFileError, match="bad bytes") as caught:
        stream([Job(ra, rb, corrupt)], workers=2, processes=True)
    assert caught.value.path == str(tmp_path / "b.safetensors")
    assert "in the diff worker process" in str(caught.value.__cause__) and "def corrupt" not in str(caught.value)
    assert "in corrupt" in str(caught.value.__cause__)

    def bug():
        raise _Unpicklable(1, 2)

    with pytest.raises(RuntimeError, match="_Unpicklable: 1/2"):  # a bug stays a bug (not a one-line CkptlabError)
        stream([Job(ra, rb, bug)], workers=2, processes=True)
