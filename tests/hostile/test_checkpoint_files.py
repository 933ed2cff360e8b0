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
