"""Hostile checkpoint files given to `ckptlab diff`: safetensors, .pt, DCP folders."""

from __future__ import annotations

import json
import struct

import torch
from safetensors.torch import save_file

from tests.hostile.conftest import refused


def _set_dtype(path, name, dtype):
    data = path.read_bytes()
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + n])
    header[name]["dtype"] = dtype
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)  # same length: the data offsets stay valid
    assert len(raw) == n
    path.write_bytes(data[:8] + raw + data[8 + n :])


def test_unknown_safetensors_dtype_in_both_files(tmp_path):
    """Was skipped with a warning, exit 0: the diff then called the files identical although
    the tensor it could not read differs."""
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"w": torch.ones(4), "secret": torch.zeros(8, dtype=torch.int32)}, a)
    save_file({"w": torch.ones(4), "secret": torch.ones(8, dtype=torch.int32)}, b)
    for p in (a, b):
        _set_dtype(p, "secret", "Q32")
    refused(tmp_path, "diff", a, b, names="a.safetensors", says="'secret' has unknown dtype 'Q32'")


# --- .pt files: storages must back the tensors they claim ---------------------------------------


def test_expanded_tensor_in_a_pt_file(tmp_path):
    """1.6 KB that torch loads as a 16 GiB tensor (stride 0 over one element)."""
    path = tmp_path / "expanded.pt"
    torch.save({"w": torch.zeros(1).expand(1 << 32)}, path)
    assert path.stat().st_size < 4096
    refused(tmp_path, "diff", path, path, names="expanded.pt", says="expansion (stride 0)")


def test_compressed_data_record_in_a_pt_file(tmp_path):
    """torch.save never compresses; a DEFLATE-compressed data record is read through torch's
    mapping as raw bytes: garbage, and a verdict with exit 0."""
    import zipfile

    good, bad = tmp_path / "good.pt", tmp_path / "deflated.pt"
    # random bits do not compress: the DEFLATE record is at least as long as the storage, so
    # torch maps its first bytes as the tensor's values instead of failing
    g = torch.Generator().manual_seed(0)
    torch.save({"w": torch.randint(-(2**31), 2**31 - 1, (4096,), dtype=torch.int32, generator=g)}, good)
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(bad, "w") as zout:
        for info in zin.infolist():
            method = zipfile.ZIP_DEFLATED if "/data/" in info.filename else zipfile.ZIP_STORED
            zout.writestr(info.filename, zin.read(info), compress_type=method)
    refused(tmp_path, "diff", good, bad, names="deflated.pt", says="is compressed")


# --- DCP folders: sizes bounded by the bytes on disk --------------------------------------------


def test_dcp_chunks_of_stride_zero_claiming_gigabytes(tmp_path):
    """A 4 KB DCP folder whose metadata claims a 4 GiB tensor in two chunks, each a torch.save
    of a stride-0 view: the shape check passed, and diff allocated the whole tensor."""
    import io
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    folder = tmp_path / "dcp"
    folder.mkdir()
    half = 1 << 29
    buf = io.BytesIO()
    torch.save(torch.zeros(1).expand(half), buf)
    blob = buf.getvalue()
    (folder / "__0_0.distcp").write_bytes(blob * 2)
    chunks, storage = [], {}
    for i in range(2):
        offsets = torch.Size([i * half])
        chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([half])))
        storage[MetadataIndex("w", offsets)] = _StorageInfo("__0_0.distcp", i * len(blob), len(blob))
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([2 * half]), chunks)
    (folder / ".metadata").write_bytes(pickle.dumps(Metadata({"w": md}, storage_data=storage)))
    assert sum(p.stat().st_size for p in folder.iterdir()) < 8192
    refused(folder, "diff", folder, folder, names="__0_0.distcp", says="needs 2147483648 bytes")


def test_a_pt_data_record_shorter_than_its_tensor(tmp_path):
    """A record cut to 8 bytes under a tensor of 40: torch would map the bytes after it (the
    zip's own index) as the tensor's values; the diff refuses instead of ranking garbage."""
    import io
    import zipfile

    buf = io.BytesIO()
    torch.save({"w": torch.ones(10)}, buf)
    path = tmp_path / "short.pt"
    with zipfile.ZipFile(buf) as zin, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for info in zin.infolist():
            data = zin.read(info)
            z.writestr(info, data[:8] if "/data/" in info.filename else data)
    refused(path, "diff", path, names="short.pt", says="claims 40 bytes but its data record holds 8")
