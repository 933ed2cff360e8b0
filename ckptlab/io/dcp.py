"""`torch.distributed.checkpoint` (DCP) folders, read in one process with no process group.

A DCP folder holds `.metadata` (a pickled `Metadata`: each tensor's shape, dtype and chunks,
and where each chunk's bytes are) and `__<rank>_<n>.distcp` files (each chunk a small
torch.save blob at an offset). torch's own reader unpickles `.metadata` with plain `pickle`,
which would run any code a crafted file asks for; here it goes through an allowlist
unpickler that can build only the metadata dataclasses, torch.Size, dtypes and paths. Chunks
are read with torch.load(weights_only=True) and assembled into whole tensors on demand.
"""

from __future__ import annotations

import importlib
import io
import math
import pickle
from pathlib import Path

import torch

from ckptlab.errors import CorruptFileError, UnknownFormatError, UnsafeFileError
from ckptlab.io.base import LazyTensor, check_extent, require_safe_torch, safe_member
from ckptlab.io.files import open_regular
from ckptlab.io.mapped import MappedFile
from ckptlab.io.nested import describe, find_state_dict
from ckptlab.jsonable import is_int

METADATA = ".metadata"

_DCP_META = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP_META, "Metadata"),
    (_DCP_META, "MetadataIndex"),
    (_DCP_META, "StorageMeta"),
    (_DCP_META, "TensorProperties"),
    (_DCP_META, "TensorStorageMetadata"),
    (_DCP_META, "ChunkStorageMetadata"),
    (_DCP_META, "BytesStorageMetadata"),
    (_DCP_META, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # _get_layout("torch.strided") -> torch.strided
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    *(("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and nothing else: any other global is refused before it exists."""

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return getattr(importlib.import_module(module), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeFileError(
            f"refused: it asks for {module}.{name}, which is not DCP checkpoint metadata; nothing in it was run",
            path=self.path,
        )

    def persistent_load(self, pid):
        raise UnsafeFileError("refused: unexpected persistent reference in DCP metadata", path=self.path)


def read_metadata(folder: Path):
    path = folder / METADATA
    if not torch.distributed.is_available():
        raise UnknownFormatError("reading a DCP checkpoint needs a torch built with torch.distributed", path=folder)
    importlib.import_module(_DCP_META)
    try:
        with open_regular(path) as f:
            meta = _MetadataUnpickler(f, path).load()
    except (UnsafeFileError, OSError):
        raise
    except Exception as e:  # noqa: BLE001 - any malformed pickle
        raise CorruptFileError(f"unreadable DCP metadata ({type(e).__name__}: {e})", path=path) from None
    if type(meta).__name__ != "Metadata" or not isinstance(getattr(meta, "state_dict_metadata", None), dict):
        raise CorruptFileError("DCP metadata is not a Metadata object", path=path)
    return meta


def open_dcp(folder: str | Path):
    """(refs, notes, skipped, closers) for the model weights of a DCP folder."""
    tree, skipped, closers = dcp_tree(folder)
    flat, where = find_state_dict(tree)
    notes = [n for n in [describe(tree, where)] if n]
    return flat, notes, skipped, closers


def dcp_tree(folder: str | Path):
    """(tree, skipped, closers): every tensor of a DCP folder as a LazyTensor, nested as it was
    saved (e.g. {"model": {...}, "optim": {"state": {...}}})."""
    require_safe_torch()
    folder = Path(folder)
    meta = read_metadata(folder)
    files: dict[str, MappedFile] = {}
    try:
        tree, skipped = _build_tree(folder, meta, files)
    except BaseException as e:
        for f in files.values():
            f.close()
        if isinstance(e, (TypeError, AttributeError, KeyError, ValueError, IndexError, OverflowError)):
            raise CorruptFileError(
                f"malformed DCP metadata ({type(e).__name__}: {str(e)[:120]})", path=folder / METADATA
            ) from None
        raise
    return tree, skipped, [f.close for f in files.values()]


def _build_tree(folder: Path, meta, files: dict[str, MappedFile]) -> tuple[dict, dict[str, str]]:
    storage = {}
    for index, info in (meta.storage_data or {}).items():
        storage[(index.fqn, tuple(index.offset or ()))] = info
    tree: dict = {}
    skipped: dict[str, str] = {}
    paths = meta.planner_data if isinstance(meta.planner_data, dict) else {}
    for fqn, md in meta.state_dict_metadata.items():
        if type(md).__name__ != "TensorStorageMetadata":
            continue  # bytes entries: step counters, param_groups, ...
        key_path = paths.get(fqn) or (fqn,)
        size, dtype = _tensor_meta(folder, fqn, md)
        infos = []
        for chunk in md.chunks:
            info = storage.get((fqn, tuple(chunk.offsets)))
            if info is None:
                raise CorruptFileError(f"DCP metadata has no storage for a chunk of {fqn!r}", path=folder)
            name = safe_member(folder, info.relative_path, what="DCP metadata")
            if getattr(info, "transform_descriptors", None):
                skipped[fqn] = f"stored with transforms {list(info.transform_descriptors)} (not supported)"
            if name not in files:
                if not (folder / name).is_file():
                    raise CorruptFileError(f"DCP data file {name} is missing", path=folder)
                files[name] = MappedFile(folder / name, sequential=True)
            _check_chunk(folder, fqn, size, dtype, chunk, info, files[name])
            infos.append((chunk, files[name], info))
        if math.prod(size) != sum(math.prod(c.sizes) for c, _, _ in infos):
            raise CorruptFileError(f"DCP chunks of {fqn!r} do not cover its shape {list(size)}", path=folder)
        if fqn not in skipped:
            _insert(
                tree,
                tuple(key_path),
                LazyTensor(size, dtype, _chunk_loader(folder, fqn, size, dtype, infos)),
            )
    return tree, skipped


def _dims(value) -> tuple[int, ...] | None:
    try:
        dims = tuple(value)
    except TypeError:
        return None
    return dims if all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims) else None


def _tensor_meta(folder: Path, fqn: str, md) -> tuple[tuple[int, ...], torch.dtype]:
    size = _dims(getattr(md, "size", None))
    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    if size is None or not isinstance(dtype, torch.dtype) or not isinstance(getattr(md, "chunks", None), list):
        raise CorruptFileError(f"DCP metadata of {fqn!r} is malformed (size, dtype or chunks)", path=folder)
    return size, dtype


def _check_chunk(folder: Path, fqn: str, size, dtype, chunk, info, file: MappedFile) -> None:
    """A chunk lies inside its tensor, and its stored bytes lie inside its file and can hold its
    elements: so a tensor never claims more memory than the files hold (a stride-0 chunk of a
    few bytes cannot stand for gigabytes)."""
    offsets, sizes = _dims(getattr(chunk, "offsets", None)), _dims(getattr(chunk, "sizes", None))
    if (
        offsets is None
        or sizes is None
        or len(offsets) != len(size)
        or len(sizes) != len(size)
        or any(o + s > n for o, s, n in zip(offsets, sizes, size))
    ):
        raise CorruptFileError(f"DCP chunk of {fqn!r} lies outside its shape {list(size)}", path=folder)
    start, length = getattr(info, "offset", None), getattr(info, "length", None)
    if not (is_int(start) and start >= 0 and is_int(length) and length >= 0):
        raise CorruptFileError(f"DCP storage of a chunk of {fqn!r} is malformed", path=folder)
    if start + length > file.size:
        raise CorruptFileError(
            f"truncated: a chunk of {fqn!r} needs bytes up to {start + length}, the file has {file.size}",
            path=file.path,
        )
    need = math.prod(sizes) * dtype.itemsize
    if need > length:
        raise CorruptFileError(
            f"DCP chunk of {fqn!r} ({list(sizes)} {dtype}) needs {need} bytes, its stored record holds {length}",
            path=file.path,
        )


def _insert(tree: dict, key_path: tuple, leaf) -> None:
    node = tree
    for k in key_path[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            return
    node[key_path[-1]] = leaf


def _chunk_loader(folder: Path, fqn: str, size: tuple[int, ...], dtype: torch.dtype, infos):
    def load() -> torch.Tensor:
        out = None
        for chunk, file, info in infos:
            blob = file.read(info.offset, info.length, "uint8")
            try:
                part = torch.load(io.BytesIO(blob.tobytes()), map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as e:
                raise UnsafeFileError(
                    f"refused a DCP chunk of {fqn!r} ({str(e).splitlines()[-1][:120]})", path=file.path
                ) from None
            except Exception as e:  # noqa: BLE001
                raise CorruptFileError(
                    f"unreadable DCP chunk of {fqn!r} ({type(e).__name__})", path=file.path
                ) from None
            if not isinstance(part, torch.Tensor) or tuple(part.shape) != tuple(chunk.sizes):
                raise CorruptFileError(
                    f"DCP chunk of {fqn!r} is not a tensor of shape {list(chunk.sizes)}", path=file.path
                )
            check_extent(part, name=fqn, path=file.path)
            if part.numel() and part.untyped_storage().nbytes() < part.numel() * part.element_size():
                raise CorruptFileError(f"DCP chunk of {fqn!r} is an expanded view, not stored data", path=file.path)
            if len(infos) == 1:
                return part.to(dtype)
            if out is None:
                out = torch.empty(size, dtype=dtype)
            out[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] = part
        if out is None:  # no chunks at all (crafted metadata): only an empty shape passes the coverage check
            out = torch.empty(size, dtype=dtype)
        return out

    return load


# --- loading into live (distributed) training through torch's DCP API ----------------------------


def safe_reader(folder: Path):
    """torch's FileSystemReader, with `.metadata` read by the allowlist unpickler above."""
    import torch.distributed.checkpoint as dcp

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            return read_metadata(Path(folder))

    return Reader(folder)


def safe_planner():
    """torch's load planner, refusing non-tensor items (torch's would unpickle them)."""
    import torch.distributed.checkpoint as dcp

    class Planner(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            raise ValueError(f"unexpected non-tensor item {read_item.dest_index.fqn!r} in a ckptlab DCP checkpoint")

    return Planner()
