"""Streaming: memory stays flat as checkpoints grow, threads run at once, results don't depend
on how the work was cut or read."""

import threading
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from ckptlab import stats
from ckptlab.io import open_checkpoint
from ckptlab.io import stream as streaming
from ckptlab.io.stream import Job, stream


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
    return [Job(ra, rb, lambda: stats.PairAccumulator(ra.dtype, rb.dtype))]


@pytest.mark.skipif(_rss_file_kb() is None, reason="needs /proc/self/status (Linux)")
def test_mapped_pages_are_released_so_memory_stays_flat(tmp_path, monkeypatch):
    monkeypatch.setattr(streaming, "SEGMENT_BYTES", 2 << 20)
    _pair_files(tmp_path, 24 << 20)  # 2 x 96 MB
    sd_a, sd_b = open_checkpoint(tmp_path / "a.safetensors"), open_checkpoint(tmp_path / "b.safetensors")
    with PeakRss() as flat:
        stream(_jobs(sd_a, sd_b), workers=2)
    # Without releasing, every page read stays resident: the whole 192 MB.
    monkeypatch.setattr("ckptlab.io.mapped.MappedFile.release", lambda self, offset, nbytes: None)
    sd_a, sd_b = open_checkpoint(tmp_path / "a.safetensors"), open_checkpoint(tmp_path / "b.safetensors")
    with PeakRss() as kept:
        stream(_jobs(sd_a, sd_b), workers=2)
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
        return stats.PairAccumulator(ra.dtype, rb.dtype)

    stream([Job(ra, rb, make)], workers=2)
    assert len(threads) == 2 and not both.broken


def test_results_do_not_depend_on_threads_segments_or_reads(tmp_path, monkeypatch):
    a, b = _pair_files(tmp_path, 3 << 18)
    b[123_457] = float("nan")
    b[700_000] = a[700_000] + 7
    safetensors.torch.save_file({"w": b}, tmp_path / "b.safetensors")
    results = []
    for workers, segment, sequential in [
        (1, 64 << 20, False),
        (2, 1 << 20, False),
        (2, 1 << 20, True),
        (1, 3 << 20, True),
    ]:
        monkeypatch.setattr(streaming, "SEGMENT_BYTES", segment)
        sd_a = open_checkpoint(tmp_path / "a.safetensors", sequential=sequential)
        sd_b = open_checkpoint(tmp_path / "b.safetensors", sequential=sequential)
        results.append(stream(_jobs(sd_a, sd_b), workers=workers)[0].result())
    first = results[0]
    assert first.delta.max_index == 700_000 and first.b.nan == 1
    assert _same(results[2], results[1])  # same segments, other reads: bit for bit
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

    with pytest.raises(CorruptFileError, match="truncated"):
        stream(_jobs(sd_a, sd_b), workers=2)
