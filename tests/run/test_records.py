"""records.pack writes exactly the bytes safetensors.torch.save writes (it is only faster)."""

import json

import pytest
import safetensors
import safetensors.torch
import torch

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
