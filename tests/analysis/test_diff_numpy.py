"""A safetensors diff reads and measures with numpy alone: the same findings as when torch reads
the same files, and the same numbers as torch's own float64 arithmetic."""

import math

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

import ckptlab
from ckptlab.jsonable import plain
from tests.io.checkpoints import planted_faults, toy_state, write


def _pair(tmp_path, dtype):
    """A and B (planted faults: NaN, exploded, drifted, frozen; plus an Inf and a -Inf) as
    safetensors files."""
    a = toy_state(dtype=dtype if dtype.itemsize > 1 else torch.bfloat16)  # (torch has no float8 arithmetic)
    b = planted_faults(a)
    b["blocks.1.attn.weight"][0, 0] = float("inf")
    b["blocks.1.attn.weight"][1, 1] = float("-inf")
    a, b = ({k: v.to(dtype) for k, v in x.items()} for x in (a, b))
    return write(tmp_path / "a", a, "safetensors"), write(tmp_path / "b", b, "safetensors")


def _comparable(findings) -> dict:
    doc = plain(findings)
    for key in ("a", "b", "summary", "notes"):  # labels, formats and timings differ by design
        doc.pop(key)
    return doc


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e5m2], ids=str
)
def test_numpy_reads_give_the_findings_torch_reads_give(tmp_path, dtype):
    path_a, path_b = _pair(tmp_path, dtype)
    from_files = ckptlab.diff(path_a, path_b)  # numpy: the safetensors reader and mmap views
    via_torch = ckptlab.diff(safetensors.torch.load_file(path_a), safetensors.torch.load_file(path_b))
    assert from_files.summary["format_a"] == "safetensors" and via_torch.summary["format_a"] == "memory"
    assert _comparable(from_files) == _comparable(via_torch)
    flags = {f.name: f.flags for f in from_files.ranked}
    assert "nonfinite" in flags["blocks.2.attn.weight"] and "nonfinite" in flags["blocks.1.attn.weight"]
    assert "exploded" in flags["blocks.1.mlp.fc.weight"] and "frozen" in flags["blocks.3.ln.weight"]
    alone_files, alone_torch = ckptlab.diff(path_b), ckptlab.diff(safetensors.torch.load_file(path_b))
    assert _comparable(alone_files) == _comparable(alone_torch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_numpy_statistics_match_torch_float64(tmp_path, dtype):
    path_a, path_b = _pair(tmp_path, dtype)
    findings = ckptlab.diff(path_a, path_b)
    ta, tb = safetensors.torch.load_file(path_a), safetensors.torch.load_file(path_b)
    for f in findings.ranked:
        x, y = ta[f.name].double().reshape(-1), tb[f.name].double().reshape(-1)
        fx, fy = x[x.isfinite()], y[y.isfinite()]
        assert (f.b.nan, f.b.posinf, f.b.neginf) == (
            int(y.isnan().sum()),
            int(y.isposinf().sum()),
            int(y.isneginf().sum()),
        )
        assert f.a.l2 == pytest.approx(float(fx.norm()), rel=1e-12)
        assert f.b.l2 == pytest.approx(float(fy.norm()), rel=1e-12)
        assert f.b.absmax == float(fy.abs().max()) and f.b.mean == pytest.approx(float(fy.mean()), rel=1e-9, abs=1e-15)
        both = x.isfinite() & y.isfinite()
        d = torch.where(both, y - x, 0.0)
        assert f.delta.l2 == pytest.approx(float(d.norm()), rel=1e-12)
        assert f.delta.unchanged == pytest.approx(int((x == y).sum()) / x.numel())
        if float(d.abs().max()) > 0:
            assert f.delta.max_change == float(d.abs().max())
            flat = int(np.ravel_multi_index(f.delta.max_index, f.shape))
            assert (f.delta.max_a, f.delta.max_b) == (float(x[flat]), float(y[flat]))


def test_files_numpy_wrote_diff_like_torch_ones(tmp_path):
    """Foreign writers: a file from safetensors.numpy (no torch involved at either end)."""
    rng = np.random.default_rng(0)
    a = {f"layers.{i}.w": rng.standard_normal((64, 32)).astype(np.float32) for i in range(4)}
    b = {k: v + np.float32(1e-3) * rng.standard_normal(v.shape).astype(np.float32) for k, v in a.items()}
    b["layers.2.w"] = a["layers.2.w"] * np.float32(1e4)
    b["layers.3.ids"] = a["layers.3.ids"] = np.arange(10, dtype=np.int64)
    safetensors.numpy.save_file(a, tmp_path / "a.safetensors")
    safetensors.numpy.save_file(b, tmp_path / "b.safetensors")
    findings = ckptlab.diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert findings.verdict.parameter == "layers.2.w" and "exploded" in findings.ranked[0].flags
    ids = findings.finding("layers.3.ids")
    assert ids.dtype_a == "int64" and ids.delta.unchanged == 1 and ids.flags == []
    assert findings.finding("layers.0.w").delta.rel_change == pytest.approx(
        math.sqrt(((b["layers.0.w"].astype(np.float64) - a["layers.0.w"]) ** 2).sum())
        / math.sqrt((a["layers.0.w"].astype(np.float64) ** 2).sum()),
        rel=1e-12,
    )


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_worker_processes_find_what_threads_find(tmp_path, monkeypatch, fmt):
    """A large diff runs in forked worker processes (ckptlab.io.stream): every finding and
    every number is the same as with threads, bit for bit."""
    from ckptlab.io import stream as streaming

    a = toy_state(dtype=torch.float32)
    b = planted_faults(a)
    path_a, path_b = write(tmp_path / "a", a, fmt), write(tmp_path / "b", b, fmt)
    monkeypatch.setattr(streaming, "SEGMENT_BYTES", 1 << 12)  # many units per tensor
    threads = ckptlab.diff(path_a, path_b, workers=2)
    assert threads.summary["workers"] == 2
    monkeypatch.setattr(streaming, "PROCESS_MIN_BYTES", 0)
    used = []
    real = streaming._run_in_processes
    monkeypatch.setattr(streaming, "_run_in_processes", lambda *args: used.append(1) or real(*args))
    processes = ckptlab.diff(path_a, path_b, workers=2)
    assert used == ([1] if streaming._use_processes([], True) else [])
    assert _comparable(processes) == _comparable(threads)
    assert processes.verdict == threads.verdict and processes.verdict is not None
