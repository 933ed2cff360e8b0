"""`.safetensors` files, parsed and validated here (not by trusting the library).

Layout: an 8-byte little-endian header length N, N bytes of JSON
({"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}}),
then the data; offsets count from the end of the header. Every entry is checked (known dtype,
non-negative shape, size = numel * itemsize, inside the file, no overlap) before any tensor is
read, so a truncated or crafted file gives one clear error instead of a crash or garbage.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

from ckptlab import dtypes
from ckptlab.errors import CorruptFileError, UnknownFormatError
from ckptlab.io.files import open_regular
from ckptlab.io.mapped import FileTensor, MappedFile

MAX_HEADER = 100_000_000  # the safetensors format's own limit
# Metadata key of ckptlab's own files (run checkpoints): tied names, {"lm_head.weight": "wte.weight"}.
ALIASES_KEY = "ckptlab.aliases"


def looks_like_safetensors(head: bytes) -> bool:
    """The first bytes of a file: a plausible header length, then '{'."""
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= MAX_HEADER and head[8:9] == b"{"


def read_header(path: str | os.PathLike) -> tuple[int, dict, int]:
    """(data_start, header, file_size), validated as far as the header itself goes."""
    path = Path(path)
    size = path.stat().st_size
    with open_regular(path) as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptFileError(f"not a safetensors file: only {size} bytes", path=path)
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise CorruptFileError(
                f"corrupt safetensors header: claims {n} bytes of JSON (limit {MAX_HEADER})", path=path
            )
        if 8 + n > size:
            raise CorruptFileError(f"truncated: the header needs {8 + n} bytes, the file has {size}", path=path)
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptFileError(f"corrupt safetensors header: not JSON ({e})", path=path) from None
    except RecursionError:
        raise CorruptFileError("corrupt safetensors header: JSON nested too deeply", path=path) from None
    if not isinstance(header, dict):
        raise CorruptFileError("corrupt safetensors header: not a JSON object", path=path)
    return 8 + n, header, size


def open_safetensors(path: str | os.PathLike, *, sequential: bool = False):
    """(refs in file order, metadata, skipped, the MappedFile) for one safetensors file."""
    path = Path(path)
    data_start, header, size = read_header(path)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CorruptFileError("corrupt safetensors header: __metadata__ is not an object", path=path)
    entries = check_entries(path, header, size - data_start)
    file = MappedFile(path, sequential=sequential)
    refs = {name: FileTensor(file, data_start + begin, shape, dtype) for begin, _, name, shape, dtype in entries}
    skipped: dict[str, str] = {}  # (none: every dtype is read or refused)
    return refs, {str(k): str(v) for k, v in metadata.items()}, skipped, file


def check_entries(path: str | os.PathLike, header: dict, data_size: int) -> list[tuple[int, int, str, tuple, str]]:
    """The tensor entries of a header (its "__metadata__" taken out) with `data_size` bytes of
    data after it, each checked, in file order: (begin, end, name, shape, dtype name: dtypes.py).
    Raises CorruptFileError (UnknownFormatError: a dtype ckptlab
    cannot read)."""
    path = Path(path)
    entries = []
    for name, e in header.items():
        begin, end, shape, dtype_name = _check_entry(path, name, e)
        if end > data_size:
            raise CorruptFileError(
                f"truncated: tensor {name!r} needs data bytes up to {end}, the file holds {data_size}", path=path
            )
        dtype = dtypes.SAFETENSORS_NAMES.get(dtype_name)
        if dtype is None and dtype_name in dtypes.SAFETENSORS_UNREADABLE:
            raise UnknownFormatError(f"tensor {name!r} has dtype {dtype_name}, which ckptlab cannot read", path=path)
        if dtype is None:
            raise CorruptFileError(
                f"corrupt safetensors header: tensor {name!r} has unknown dtype {dtype_name[:40]!r}", path=path
            )
        if (end - begin) != math.prod(shape) * dtypes.itemsize(dtype):
            raise CorruptFileError(
                f"corrupt safetensors header: tensor {name!r} ({dtype_name}{list(shape)}) "
                f"should take {math.prod(shape) * dtypes.itemsize(dtype)} bytes, its offsets span {end - begin}",
                path=path,
            )
        entries.append((begin, end, name, shape, dtype))
    entries.sort(key=lambda x: (x[0], x[1]))
    for (_b0, e0, n0, *_), (b1, _e1, n1, *_) in zip(entries, entries[1:]):
        if b1 < e0:
            raise CorruptFileError(f"corrupt safetensors header: tensors {n0!r} and {n1!r} overlap", path=path)
    return entries


def load_safetensors(path: str | os.PathLike) -> tuple[dict, dict[str, str]]:
    """Every tensor of a safetensors file as a torch tensor, by name (sorted, as
    `safetensors.torch.load_file` gives them), and its metadata. The tensors view a private
    mapping of the file, which lives as long as they do; writing to one changes no file."""
    refs, metadata, _, file = open_safetensors(path)
    try:
        return {name: refs[name].load() for name in sorted(refs)}, metadata
    finally:
        file.close()


def read_aliases(metadata: dict[str, str], path: str | os.PathLike) -> dict[str, str]:
    """The tied names of a ckptlab file (metadata ALIASES_KEY): {} where it has none."""
    if ALIASES_KEY not in metadata:
        return {}
    try:
        aliases = json.loads(metadata[ALIASES_KEY])
    except (ValueError, RecursionError):
        raise CorruptFileError(f"metadata {ALIASES_KEY} is not JSON", path=path) from None
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise CorruptFileError(f"metadata {ALIASES_KEY} is not a name -> name map", path=path)
    return aliases


def _check_entry(path: Path, name, e) -> tuple[int, int, tuple[int, ...], str]:
    where = f"corrupt safetensors header: entry {name!r}"
    if not isinstance(e, dict):
        raise CorruptFileError(f"{where} is not an object", path=path)
    dtype, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if not isinstance(dtype, str):
        raise CorruptFileError(f"{where} has no dtype", path=path)
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise CorruptFileError(f"{where} has an invalid shape {shape!r}", path=path)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise CorruptFileError(f"{where} has invalid data_offsets {offsets!r}", path=path)
    return offsets[0], offsets[1], tuple(shape), dtype
