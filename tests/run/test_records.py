"""records.pack writes exactly the bytes safetensors.torch.save writes (it is only faster)."""

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch

from ckptlab.jsonable import json_safe
from ckptlab.run import records

DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.float16, torch.bfloat16,
    torch.int32, torch.uint32, torch.float32, torch.float64, torch.int64, torch.uint64,
]  # fmt: skip


def test_pack_is_byte_for_byte_what_safetensors_writes():
    g = torch.Generator().manual_seed(0)
    shapes = [(), (0,), (3,), (2, 5), (4, 1, 3)]
    for trial in range(40):
        tensors = {}
        for k in range(1 + trial % 7):
            dtype = DTYPES[(trial * 5 + k * 3) % len(DTYPES)]
            shape = shapes[(trial + k) % len(shapes)]
            t = torch.randint(0, 100, shape, generator=g).to(dtype)
            name = ["batch/ids", "rng/torch", "param_grad_norm", "a", "zé", "batch/inputs/0", "w"][(trial + k) % 7]
            tensors[f"{name}{k}"] = t if trial % 3 else t.t() if t.dim() == 2 else t  # non-contiguous too
        meta = {"step": trial, "note": 'quote " and \\ and é', "nan": "nan"}
        expected = safetensors.torch.save(
            {k: v.contiguous() for k, v in tensors.items()},
            metadata={records.META_KEY: json.dumps(meta, separators=(",", ":"))},
        )
        assert records.pack(meta, tensors) == expected
        got_meta, got = records.unpack(records.pack(meta, tensors), where="test")
        assert got_meta == meta and all(torch.equal(got[k], tensors[k]) for k in tensors)


def test_pack_without_tensors():
    meta = {"step": 1}
    assert records.pack(meta, {}) == safetensors.torch.save({}, metadata={records.META_KEY: '{"step":1}'})


@pytest.mark.parametrize(
    "scalars",
    [
        {"step": 3, "loss": 2.5, "grad_norm": 1.25, "lr": [3e-4, 1e-3], "stepped": True, "nonfinite_grads": 0},
        {"step": 4, "loss": float("nan"), "grad_norm": float("inf"), "lr": (0.1,), "rank_loss": [1.0, -float("inf")]},
        {"step": 5, "loss": np.float64(0.5), "note": "caf\u00e9", "nested": {"a": [1, (2.0, None)]}},
    ],
)
def test_a_step_record_with_finite_numbers_is_the_same_bytes_without_the_json_safe_copy(scalars):
    arrays = {"param_grad_norm": np.array([0.5, -1.0], dtype=np.float32), "update_ratio": None}
    before = records.pack(json_safe(scalars), {"param_grad_norm": arrays["param_grad_norm"]})
    assert records.encode_step(scalars, arrays) == before
    meta, _ = records.decode_step(before, where="x")
    assert meta["step"] == scalars["step"]


def test_a_streamed_checkpoint_file_is_the_librarys_bytes_and_hash(tmp_path, monkeypatch):
    """write_safetensors: what safetensors.torch.save_file writes, byte for byte, in pieces
    (flushed and dropped from the page cache as it goes), hashed as written."""
    import hashlib

    from ckptlab.run import checkpoint

    monkeypatch.setattr(checkpoint, "STREAM_CHUNK", 1000)  # many pieces, and syncs, on a small file
    monkeypatch.setattr(checkpoint, "STREAM_SYNC", 4096)
    monkeypatch.setattr(checkpoint, "DIRECT_MIN", 1 << 62)  # through the page cache (direct: below)
    tensors = {
        "w": torch.randn(64, 33),
        "b": torch.arange(7, dtype=torch.int64),
        "h": torch.randn(5, 3).to(torch.bfloat16),
        "m": torch.tensor([True, False]),
    }
    meta = {"format": "pt"}  # one key: the library orders several as its hash map does (at random)
    record = checkpoint.write_safetensors(tmp_path / "ours.safetensors", tensors, meta)
    safetensors.torch.save_file(tensors, tmp_path / "lib.safetensors", metadata=meta)
    ours, lib = (tmp_path / "ours.safetensors").read_bytes(), (tmp_path / "lib.safetensors").read_bytes()
    assert ours == lib
    two = {"format": "pt", "ckptlab.aliases": "{}"}
    checkpoint.write_safetensors(tmp_path / "two.safetensors", tensors, two)
    with safetensors.safe_open(tmp_path / "two.safetensors", framework="pt") as f:
        assert f.metadata() == two
    assert record == {"bytes": len(ours), "sha256": hashlib.sha256(ours).hexdigest()}


def _tensors_for_direct():
    return {
        "w": torch.randn(300, 77),  # not a multiple of the alignment: the last piece is padded, then cut
        "b": torch.arange(7, dtype=torch.int64),
        "h": torch.randn(5, 3).to(torch.bfloat16),
    }


def _direct_io_works(folder) -> bool:
    import errno
    import os

    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        os.close(os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    finally:
        (folder / "probe").unlink(missing_ok=True)
    return True


def test_a_large_checkpoint_file_is_written_direct_with_the_same_bytes_and_hash(tmp_path, monkeypatch):
    """Past DIRECT_MIN bytes, write_safetensors goes around the page cache (O_DIRECT, from an
    aligned buffer): the same bytes as the library's, the hash of what was written."""
    import hashlib

    from ckptlab.run import checkpoint

    if not _direct_io_works(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    monkeypatch.setattr(checkpoint, "STREAM_CHUNK", 16384)  # several full buffers and a partial one
    monkeypatch.setattr(checkpoint, "DIRECT_MIN", 0)
    direct = []
    real = checkpoint._write_direct
    monkeypatch.setattr(checkpoint, "_write_direct", lambda *a: direct.append(real(*a)) or direct[-1])
    tensors = _tensors_for_direct()
    record = checkpoint.write_safetensors(tmp_path / "ours.safetensors", tensors, {"format": "pt"})
    assert direct and direct[0] is not None  # the direct path wrote it
    safetensors.torch.save_file(tensors, tmp_path / "lib.safetensors", metadata={"format": "pt"})
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "lib.safetensors").read_bytes()
    assert record == {"bytes": len(ours), "sha256": hashlib.sha256(ours).hexdigest()}


@pytest.mark.parametrize("direct", [True, False])
def test_a_live_write_reports_each_tensor_as_its_bytes_are_taken_and_is_hashed_when_read_back(
    tmp_path, monkeypatch, direct
):
    """hash=False (a live checkpoint's files): no hash while writing; `on_copied` hears of each
    tensor once, in file order, once its bytes are out of its memory; the file read back (around
    the page cache when it was written so, in several reads) hashes to what was written."""
    import hashlib

    from ckptlab.run import checkpoint, hashing

    if direct and not _direct_io_works(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    monkeypatch.setattr(checkpoint, "STREAM_CHUNK", 16384)
    monkeypatch.setattr(hashing, "DIRECT_CHUNK", 16384)
    monkeypatch.setattr(checkpoint, "DIRECT_MIN", 0 if direct else 1 << 62)
    tensors = _tensors_for_direct()
    reported = []
    path = tmp_path / "ours.safetensors"
    record = checkpoint.write_safetensors(path, tensors, {"format": "pt"}, hash=False, on_copied=reported.append)
    ours = path.read_bytes()
    assert record == {"bytes": len(ours), "sha256": None}
    by_ptr = {t.data_ptr(): name for name, t in tensors.items()}
    assert [by_ptr[p] for p in reported] == ["b", "w", "h"]  # safetensors' order: I64, F32, BF16
    assert checkpoint.hash_written(path) == hashing.sha256_uncached(path) == hashlib.sha256(ours).hexdigest()


@pytest.mark.parametrize("refused_at", [1, 2])
def test_a_direct_write_refused_after_training_was_told_is_an_error_not_a_second_write(
    tmp_path, monkeypatch, refused_at
):
    """A filesystem that takes O_DIRECT but refuses the writes (EINVAL) gets the page cache
    path, which writes every tensor again from its memory: only while no tensor has been
    reported as taken (training may change it from then on). Reports wait for the first
    direct write to go through."""
    import errno

    from ckptlab.run import checkpoint

    if not _direct_io_works(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    monkeypatch.setattr(checkpoint, "STREAM_CHUNK", 16384)
    monkeypatch.setattr(checkpoint, "DIRECT_MIN", 0)
    calls, real = [], checkpoint._write_all

    def refusing(fd, buf, n):
        calls.append(n)
        if len(calls) == refused_at:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buf, n)

    monkeypatch.setattr(checkpoint, "_write_all", refusing)
    tensors = _tensors_for_direct()
    reported = []
    path = tmp_path / "ours.safetensors"
    if refused_at == 1:  # nothing reported yet: written again through the page cache, each reported once
        checkpoint.write_safetensors(path, tensors, {"format": "pt"}, hash=False, on_copied=reported.append)
        assert sorted(reported) == sorted(t.data_ptr() for t in tensors.values())
        safetensors.torch.save_file(tensors, tmp_path / "lib.safetensors", metadata={"format": "pt"})
        assert path.read_bytes() == (tmp_path / "lib.safetensors").read_bytes()
    else:
        with pytest.raises(OSError, match="Invalid argument"):
            checkpoint.write_safetensors(path, tensors, {"format": "pt"}, hash=False, on_copied=reported.append)
        assert reported and not path.exists()


def test_the_read_back_hash_runs_at_the_lowest_priority_and_passes_errors_on():
    import os
    import sys
    import threading

    from ckptlab.run import checkpoint

    def nice():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    if sys.platform.startswith("linux"):
        assert checkpoint.at_lowest_priority(nice) == 19
        assert nice() < 19  # the caller's own priority is untouched
    with pytest.raises(FileNotFoundError):
        checkpoint.at_lowest_priority(lambda: checkpoint.hash_written(Path("/nonexistent/file")))


def test_a_filesystem_that_refuses_direct_writes_gets_the_page_cache_path(tmp_path, monkeypatch):
    import errno
    import os

    from ckptlab.run import checkpoint

    monkeypatch.setattr(checkpoint, "DIRECT_MIN", 0)
    real_open = os.open

    def refusing(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            real_open(path, flags & ~os.O_DIRECT, *args)  # some kernels create the file first
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(checkpoint.os, "open", refusing)
    tensors = _tensors_for_direct()
    record = checkpoint.write_safetensors(tmp_path / "ours.safetensors", tensors, {"format": "pt"})
    safetensors.torch.save_file(tensors, tmp_path / "lib.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "lib.safetensors").read_bytes()
    assert record["bytes"] == (tmp_path / "lib.safetensors").stat().st_size
