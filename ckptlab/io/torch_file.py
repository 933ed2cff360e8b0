"""`.pt` / `.pth` / `.bin` files written by `torch.save`.

Only `torch.load(weights_only=True, mmap=True)` ever reads them: tensors, containers and
primitives, never arbitrary objects or code (a file asking for any other global is refused
with UnsafeFileError, before anything of it runs). mmap=True maps the file without reading
tensor data, so loading a 10 GB checkpoint costs milliseconds.

To stream tensors with flat memory, each tensor is then re-addressed as a byte range of the
file: torch.save writes every storage as an uncompressed zip record `<archive>/data/<key>`, and
under mmap every storage's address is base + that record's offset. The base is inferred from
the lowest storage and checked against every record; if anything does not match (or a tensor
is a strided view), that tensor is read through torch's own mapping instead.
"""

from __future__ import annotations

import pickle
import re
import struct
import warnings
import zipfile
from pathlib import Path
from typing import cast

import torch

from ckptlab import dtypes
from ckptlab.errors import CorruptFileError, UnsafeFileError
from ckptlab.io.base import MemoryTensor, TensorRef, check_extent, require_safe_torch, split_tied
from ckptlab.io.files import open_regular
from ckptlab.io.mapped import FileTensor, MappedFile
from ckptlab.io.nested import container_note, describe, find_state_dict


def load_pickled(path: Path, stand_ins: tuple = ()):
    """torch.load(weights_only=True), mmap when the file format allows; (object, notes).
    `stand_ins`: (inert object of ckptlab's, "module.Name") pairs that weights_only's allowlist
    builds in place of the named globals (io/zero.py's, for DeepSpeed's few objects): only
    they, and never the named classes' code."""
    require_safe_torch()
    notes = []
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(list(stand_ins)):
            warnings.simplefilter("ignore")  # (torch warns about pickle protocols it then reads fine)
            try:
                obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap can only be used" not in str(e):
                    raise
                # The legacy (pre-1.6, non-zip) format cannot be mapped: it is read into memory.
                obj = torch.load(path, map_location="cpu", weights_only=True)
                notes.append(f"{path.name}: legacy torch.save format, read into memory (re-save it to stream it)")
    except pickle.UnpicklingError as e:
        raise UnsafeFileError(_refusal(str(e)), path=path) from None
    except (RuntimeError, EOFError, OSError, ValueError, struct.error, zipfile.BadZipFile) as e:
        raise CorruptFileError(f"unreadable torch checkpoint ({_damage(path, e)})", path=path) from None
    return obj, notes


def _damage(path: Path, e: BaseException) -> str:
    """What torch failed on, said plainly where it is the usual damage (torch itself says
    "failed finding central directory", or for a few bytes cut "[Errno 22] Invalid argument")."""
    try:
        with open_regular(path) as f:
            zip_start = f.read(4) == b"PK\x03\x04"
        if zip_start and not zipfile.is_zipfile(path):
            return "truncated: a zip archive without its index at the end (a copy or a save cut short)"
    except OSError:
        pass
    reason = _first_line(e)
    if "not a ZIP archive" in reason:
        return "its zip index does not match the bytes before it: truncated or edited"
    return reason


def _refusal(message: str) -> str:
    found = re.search(r"GLOBAL ([\w.]+)", message)
    if found:
        return (
            f"refused: it holds Python objects, not only tensors (it asks for {found.group(1)}); "
            "ckptlab loads tensors only (torch.load weights_only=True) and never runs code from a file"
        )
    op = re.search(r"Unsupported operand \d+|Unsupported class [\w.]+|[\w ]*unsupported[^\n.]*", message)
    detail = f" ({op.group(0).strip()})" if op else ""
    return f"refused: not a pickle the safe tensor loader accepts{detail}; nothing in it was run"


def _first_line(e: BaseException) -> str:
    """The first sentence of an exception message (torch's run to a paragraph)."""
    text = str(e).strip().splitlines()
    return (text[0].split(". ")[0] if text else type(e).__name__).rstrip(".")[:200]


def open_torch(path: str | Path, *, sequential: bool = False):
    """(refs, aliases, notes, closers) for the model weights inside a torch.save file."""
    path = Path(path)
    if zipfile.is_zipfile(path):
        _refuse_compressed(path)
    obj, notes = load_pickled(path)
    for name, t in _named_tensors(obj, ""):
        check_extent(t, name=name, path=path)
    flat, where = find_state_dict(obj)
    for note in (describe(obj, where), container_note(path.name, obj, flat, where)):
        if note:
            notes.append(note)
    file = MappedFile(path, sequential=sequential) if zipfile.is_zipfile(path) else None
    locate = _locator(path, _all_tensors(obj)) if file else None
    if file and locate is None:
        notes.append(f"{path.name}: tensor data not where the zip index says; read through torch's mapping")
    # (a loaded pickle's leaves are torch tensors: its persistent ids load as nothing else)
    first, aliases = split_tied(cast("dict[str, torch.Tensor]", flat))  # tied weights: one storage, several names
    refs: dict[str, TensorRef] = {}
    for name, t in first.items():
        raw = dtypes.name_of(t.dtype) in dtypes.STORAGE  # (complex, quantized...: torch's mapping)
        offset = locate(t) if locate and raw and t.is_contiguous() and t.numel() else None
        if offset is None:
            refs[name] = MemoryTensor(t)
            continue
        assert file is not None, "an offset comes only from the zip file's locator"
        refs[name] = FileTensor(file, offset, t.shape, dtypes.name_of(t.dtype))
    return refs, aliases, notes, ([file.close] if file else [])


def _refuse_compressed(path: Path) -> None:
    """torch.save stores every tensor's bytes uncompressed, and torch's loader maps them as they
    lie: a compressed (e.g. DEFLATE) data record would be read as garbage, a wrong answer."""
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                parts = info.filename.split("/")
                if len(parts) >= 3 and parts[-2] == "data" and info.compress_type != zipfile.ZIP_STORED:
                    raise CorruptFileError(
                        f"tensor data record {info.filename} is compressed (zip method {info.compress_type}); "
                        "torch.save never compresses, and reading it as stored would give wrong values",
                        path=path,
                    )
    except (zipfile.BadZipFile, OSError, ValueError, struct.error):
        return  # torch.load says what is wrong with the zip itself


def _named_tensors(obj, prefix: str, depth: int = 0):
    """(dotted name, tensor) of every tensor inside a loaded object."""
    if isinstance(obj, torch.Tensor):
        yield prefix or "<tensor>", obj
    elif depth > 100:
        return
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _named_tensors(v, f"{prefix}.{k}" if prefix else str(k), depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _named_tensors(v, f"{prefix}.{i}" if prefix else str(i), depth + 1)


def _all_tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _all_tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _all_tensors(v)]
    return []


def _locator(path: Path, tensors: list[torch.Tensor]):
    """A function tensor -> its byte offset in the file, or None if the layout can't be verified."""
    records = _data_records(path)  # {offset: size} of <archive>/data/<key>
    storages = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            storages[s.data_ptr()] = s.nbytes()
    if not records or not storages:
        return None
    base = min(storages) - min(records)
    if all(ptr - base in records for ptr in storages):  # each storage at the start of its record
        short = [(records[ptr - base], n) for ptr, n in storages.items() if records[ptr - base] < n]
        if short:  # torch would map the bytes after the record (the next ones, the zip index)
            have, need = short[0]
            raise CorruptFileError(
                f"a tensor's storage claims {need} bytes but its data record holds {have} "
                "(a truncated or crafted file); its values would be other bytes of the file",
                path=path,
            )
    for ptr, nbytes in storages.items():
        if records.get(ptr - base, -1) < nbytes:
            return None

    def locate(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr() - base + int(t.storage_offset()) * t.element_size()

    return locate


def _data_records(path: Path) -> dict[int, int]:
    out = {}
    try:
        with open_regular(path) as f, zipfile.ZipFile(f) as z:
            for info in z.infolist():
                parts = info.filename.split("/")
                if len(parts) < 3 or parts[-2] != "data" or info.compress_type != zipfile.ZIP_STORED:
                    continue
                f.seek(info.header_offset)
                local = f.read(30)  # the local header's name/extra lengths can differ from the central one's
                if len(local) < 30 or local[:4] != b"PK\x03\x04":
                    return {}
                name_len, extra_len = struct.unpack("<HH", local[26:30])
                out[info.header_offset + 30 + name_len + extra_len] = info.file_size
    except (zipfile.BadZipFile, OSError, struct.error):
        return {}
    return out
