"""The full-tensor dump of a replayed root step (`ckptlab replay --dump FILE.h5`): one HDF5
file, written whole or not at all, bounded in size, and read back as untrusted input.

    written = write_dump("nan.h5", entries, attrs={"root_step": 12, ...}, max_bytes=10**9)
    written.omitted           # [(path, bytes)]: what did not fit in max_bytes
    dump = read_dump("nan.h5")  # DumpFile: the file's attributes and its index, validated

Only numpy and h5py here: the replayer turns tensors into `DumpEntry`s (replayer/dump.py);
`ckptlab show` reads them back. docs/replay.md ("The dump file") specifies the layout:

    /                 attrs: format="ckptlab-dump", version, root_step, origin_*, ...
    /index            one row per tensor, written or left out (INDEX_FIELDS)
    /origin/...       the origin op's inputs (as they were before it ran) and outputs
    /batch/...        the root step's batch (every row), sample ids, blamed rows
    /modules/<module>/forward/<call>/output<i>        a selected module's outputs ...
    /modules/<module>/backward/<call>/grad_output<i>  ... and the gradients that reached them
    /modules/<module>/param_grad/<name>               its parameters' gradients, accumulated
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ckptlab.errors import CkptlabError, CorruptFileError, FormatVersionError
from ckptlab.run.atomic import atomic_file

FORMAT = "ckptlab-dump"
VERSION = 1
DEFAULT_MAX_BYTES = 10**9  # --dump-max-bytes: the tensors' bytes, uncompressed
# The index of a file we wrote has one row per captured tensor; a larger one is not ours.
MAX_INDEX_ROWS = 1_000_000
# Each tensor is stored in chunks of about this many bytes, gzip-compressed (level 4: most
# of the gain at a fraction of level 9's time) after byte shuffling (floats compress better).
CHUNK_BYTES = 1 << 20
GZIP_LEVEL = 4

_STR = h5py.string_dtype()
# (name, numpy type) of each column of /index; strings are "" and integers -1 when unknown.
INDEX_FIELDS = (
    ("path", _STR),  # where the tensor is in the file (left-out rows: where it would be)
    ("role", _STR),  # origin_input | origin_output | batch | forward_output | grad_output | param_grad
    ("module", _STR),  # module path; "<root>" the root model; "" none
    ("op", _STR),  # the aten op that produced it (a module's output: the last op it ran)
    ("phase", _STR),  # forward | backward | optimizer
    ("source", _STR),  # the user's source line ("model.py:57")
    ("call", "i8"),  # the module's n-th call in the step (micro-batches, shared modules)
    ("event", "i8"),  # index of that op in the step's trace
    ("shape", _STR),  # "[6, 8, 8]"
    ("dtype", _STR),  # the tensor's torch dtype ("bfloat16" is stored as float32)
    ("bytes", "i8"),  # its size, uncompressed
    ("written", "?"),  # false: left out (over the byte budget)
    ("nonfinite", "i8"),  # NaN/Inf elements; -1: not counted (never captured)
    ("first_nonfinite", _STR),  # the first non-finite elements' coordinates, row-major
    ("note", _STR),
)
ROLES = ("origin_input", "origin_output", "batch", "forward_output", "grad_output", "param_grad")


@dataclass
class DumpEntry:
    """One tensor for the dump (data None: it was not even captured: over the budget)."""

    path: str
    role: str
    data: np.ndarray | None
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    module: str | None = None
    op: str | None = None
    phase: str | None = None
    source: str | None = None
    call: int | None = None
    event: int | None = None
    nonfinite: int | None = None
    first_nonfinite: list[list[int]] = field(default_factory=list)
    note: str = ""
    attrs: dict[str, Any] = field(default_factory=dict)  # more attributes for its dataset


@dataclass
class Written:
    path: str
    data_bytes: int  # the written tensors' bytes, uncompressed
    file_bytes: int
    datasets: int
    omitted: list[tuple[str, int]]  # (path, bytes) of each tensor left out


def write_dump(
    path: str | os.PathLike,
    entries: list[DumpEntry],
    *,
    attrs: dict[str, Any],
    max_bytes: int,
    texts: dict[str, list[str]] | None = None,
    force: bool = False,
) -> Written:
    """Write `entries` in their order of priority, each while the total stays within
    `max_bytes`; the rest is listed in /index as left out. `texts`: small datasets of lines
    (e.g. "origin/came_from"), always written. The file appears under its name only when
    complete (a temp file in the same folder, fsynced, then renamed)."""
    path = Path(path)
    check_target(path, force)
    taken, omitted, total = [], [], 0
    for e in entries:
        if e.data is not None and total + e.nbytes <= max_bytes:
            taken.append(e)
            total += e.nbytes
        else:
            omitted.append((e.path, e.nbytes))
    with atomic_file(path) as tmp, h5py.File(tmp, "w") as f:
        for k, v in {
            **attrs,
            "format": FORMAT,
            "version": VERSION,
            "max_bytes": max_bytes,
            "data_bytes": total,
            "omitted_bytes": sum(b for _, b in omitted),
        }.items():
            f.attrs[k] = _attr(v)
        for e in taken:
            _write_dataset(f, e)
        for name, lines in (texts or {}).items():
            f.create_dataset(name, data=np.array(lines, dtype=object), dtype=_STR)
        f.create_dataset("index", data=_index(entries, {id(e) for e in taken}))
    return Written(str(path), total, path.stat().st_size, len(taken), omitted)


def check_target(path: Path, force: bool) -> None:
    """Refuse to replace an existing file (unless `force`) or anything that is not a file."""
    if path.is_dir():
        raise CkptlabError("is a folder; the dump is one file", path=path)
    if path.exists() and not force:
        raise CkptlabError("already exists; refusing to overwrite it", path=path, hint="pass --force to replace it")
    if not path.parent.is_dir():
        raise CkptlabError("no such folder to write the dump in", path=path.parent)


def _write_dataset(f: h5py.File, e: DumpEntry) -> None:
    data = e.data
    assert data is not None, "write_dump takes only entries with data"
    opts: dict[str, Any] = {}
    if data.ndim and data.size and data.dtype != np.bool_:
        # Chunks along the first dimension (rows), each about CHUNK_BYTES.
        row = max(1, data.nbytes // max(1, data.shape[0]))
        opts = dict(
            chunks=(max(1, min(data.shape[0], CHUNK_BYTES // row)), *data.shape[1:]),
            compression="gzip",
            compression_opts=GZIP_LEVEL,
            shuffle=True,
        )
    ds = f.create_dataset(e.path, data=data, **opts)
    for k, v in {**_row(e), **e.attrs}.items():
        if k not in ("path", "written", "bytes"):
            ds.attrs[k] = _attr(v)
    if e.first_nonfinite:
        ds.attrs["first_nonfinite"] = np.asarray(e.first_nonfinite, dtype=np.int64)


def _row(e: DumpEntry) -> dict[str, Any]:
    return {
        "path": e.path,
        "role": e.role,
        "module": e.module or "",
        "op": e.op or "",
        "phase": e.phase or "",
        "source": e.source or "",
        "call": -1 if e.call is None else e.call,
        "event": -1 if e.event is None else e.event,
        "shape": json.dumps(list(e.shape)),
        "dtype": e.dtype,
        "bytes": e.nbytes,
        "nonfinite": -1 if e.nonfinite is None else e.nonfinite,
        "first_nonfinite": "; ".join(json.dumps(c) for c in e.first_nonfinite),
        "note": e.note,
    }


def _index(entries: list[DumpEntry], taken: set[int]) -> np.ndarray:
    dtype = np.dtype(list(INDEX_FIELDS))
    rows = [{**_row(e), "written": id(e) in taken} for e in entries]
    return np.array([tuple(r[name] for name, _ in INDEX_FIELDS) for r in rows], dtype=dtype)


def _attr(v: Any) -> Any:
    """An attribute value h5py stores as is: str, int, float, bool; anything else as JSON."""
    if v is None:
        return ""
    if isinstance(v, (str, bool, int, float, np.integer, np.floating)):
        return v
    return json.dumps(v)


# --- reading: the file is untrusted input ----------------------------------------------------


@dataclass
class DumpFile:
    """What `ckptlab show` prints: the file's attributes and its index, validated."""

    path: str
    file_bytes: int
    attrs: dict[str, Any]
    index: list[dict[str, Any]]  # one dict per /index row (INDEX_FIELDS)
    came_from: list[str]  # for the origin's first non-finite outputs: the input elements behind them

    @property
    def written(self) -> list[dict[str, Any]]:
        return [r for r in self.index if r["written"]]

    @property
    def omitted(self) -> list[dict[str, Any]]:
        return [r for r in self.index if not r["written"]]


# The root attributes `read_dump` returns, with the types they must have.
_ATTR_TYPES = {
    "version": int,
    "run": str,
    "root_step": int,
    "requested_step": int,
    "select": str,
    "max_bytes": int,
    "data_bytes": int,
    "omitted_bytes": int,
    "origin_kind": str,
    "origin_module": str,
    "origin_op": str,
    "origin_phase": str,
    "origin_source": str,
    "verdict": str,
    "ckptlab_version": str,
}


def read_dump(path: str | os.PathLike) -> DumpFile:
    """Open a dump and check that it is one: any other file, or a damaged one, raises a
    CkptlabError naming the file and the problem."""
    path = Path(path)
    if not path.is_file():
        raise CkptlabError("no such file" if not path.exists() else "not a file", path=path)
    try:
        with _open(path) as f:
            return _read(path, f)
    except CkptlabError:
        raise
    except Exception as e:  # noqa: BLE001 - h5py raises OSError, KeyError, ValueError, TypeError... on damage
        raise CorruptFileError(f"damaged dump file ({type(e).__name__}: {_first_line(e)})", path=path) from None


@contextlib.contextmanager
def _open(path: Path):
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise CorruptFileError(
            f"not a readable HDF5 file (truncated, damaged or another format: {_first_line(e)})", path=path
        ) from None
    try:
        yield f
    finally:
        f.close()


def _read(path: Path, f: h5py.File) -> DumpFile:
    fmt = f.attrs.get("format")
    if isinstance(fmt, bytes):
        fmt = fmt.decode("utf-8", "replace")
    if fmt != FORMAT:
        raise CorruptFileError(
            "an HDF5 file, but not a ckptlab dump (no format attribute 'ckptlab-dump')",
            path=path,
            hint="write one with ckptlab replay --step N --dump FILE.h5",
        )
    attrs: dict[str, Any] = {"format": FORMAT}  # (checked above; `show --json` lists every root attribute)
    for k, kind in _ATTR_TYPES.items():
        if k not in f.attrs:
            continue
        v = f.attrs[k]
        v = v.decode("utf-8", "replace") if isinstance(v, bytes) else v
        v = v.item() if isinstance(v, np.generic) else v
        if not isinstance(v, kind) or isinstance(v, bool) and kind is int:
            raise CorruptFileError(f"attribute {k!r} is not {kind.__name__}", path=path)
        attrs[k] = v
    version = attrs.get("version")
    if version is None:
        raise CorruptFileError("the dump has no format version", path=path)
    if version > VERSION:
        raise FormatVersionError(
            f"dump format version {version} is newer than this ckptlab reads ({VERSION})", path=path
        )
    index = _read_index(path, f)
    for row in index:
        if row["written"]:
            _check_dataset(path, f, row)
    return DumpFile(str(path), path.stat().st_size, attrs, index, _came_from(path, f))


def _read_index(path: Path, f: h5py.File) -> list[dict[str, Any]]:
    ds = _dataset(f, "index")
    if ds is None:
        raise CorruptFileError("the dump has no /index table", path=path)
    names = ds.dtype.names or ()
    missing = [name for name, _ in INDEX_FIELDS if name not in names]
    if ds.ndim != 1 or missing:
        raise CorruptFileError(
            "/index is not the dump's table" + (f" (no column {missing[0]!r})" if missing else ""), path=path
        )
    if ds.shape[0] > MAX_INDEX_ROWS:
        raise CorruptFileError(f"/index has {ds.shape[0]} rows, more than a dump holds ({MAX_INDEX_ROWS})", path=path)
    rows = []
    for rec in ds[()]:
        row = {}
        for name, kind in INDEX_FIELDS:
            v = rec[name]
            if kind is _STR:
                if not isinstance(v, (bytes, str)):
                    raise CorruptFileError(f"/index column {name!r} is not text", path=path)
                v = v.decode("utf-8", "replace") if isinstance(v, bytes) else v
            else:
                v = bool(v) if kind == "?" else int(v)
            row[name] = v
        if row["role"] not in ROLES:
            raise CorruptFileError(f"/index row {row['path']!r} has an unknown role {row['role']!r}", path=path)
        rows.append(row)
    return rows


def _dataset(f: h5py.File, name: str) -> h5py.Dataset | None:
    """The dataset `name`, reached through hard links only: a soft or external link (to
    another file on this machine) in a file someone sent is not followed."""
    parts = [p for p in name.split("/") if p]
    for i in range(1, len(parts) + 1):
        if not isinstance(f.get("/".join(parts[:i]), getlink=True), h5py.HardLink):
            return None
    ds = f.get(name)
    return ds if isinstance(ds, h5py.Dataset) else None


def _check_dataset(path: Path, f: h5py.File, row: dict[str, Any]) -> None:
    """A row marked written names a dataset of the shape it says (a file cut short or edited
    fails here, not in the user's analysis later)."""
    ds = _dataset(f, row["path"])
    if not isinstance(ds, h5py.Dataset):
        raise CorruptFileError(
            f"/index lists {row['path']!r}, but the file holds no such dataset (or only a link to one)", path=path
        )
    try:
        shape = json.loads(row["shape"])
    except ValueError:
        shape = None
    if shape != list(ds.shape):
        raise CorruptFileError(f"{row['path']!r} has shape {list(ds.shape)}, but /index says {row['shape']}", path=path)


def _came_from(path: Path, f: h5py.File) -> list[str]:
    if "origin/came_from" not in f:
        return []
    ds = _dataset(f, "origin/came_from")
    if ds is None or ds.ndim != 1 or ds.shape[0] > 10_000 or ds.dtype.kind not in "OSU":
        raise CorruptFileError("origin/came_from is not a list of lines", path=path)
    return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in ds[()]]


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__
