"""The journal as columns: what readers take from it, one array per field.

A long run's journal holds one step record a step (10^6 of them after 10^6 steps, ~1 KB each
with 150 parameter tensors). Decoding them one by one costs ~100 us each: minutes. So:

- `Columns` holds a stretch of the journal's step records as arrays (a number field: its values
  and, per row, what the record held: nothing, an int, a float, a bool or null; a list of
  floats: a padded matrix and its lengths; a per-parameter array: the rows that have it and
  their values), and its validation and event records as they are. Built from a segment's
  frames (`from_frames`), joined (`concat`), put in step order (`by_step`), and turned back
  into the records they came from (`row`) exactly: the same keys, types and values.
- The Recorder writes each journal segment's columns beside it when it closes the segment
  (`write_summary`, in the background): `sNNN-SSSSSSSSS.cols`, a safetensors file (no
  pickle) that names the segment's size. A reader takes a segment's columns from there when
  that size is the segment's (`load_summary`), else from the segment's frames: a summary
  missing (a crash before the close, an older ckptlab), stale or unreadable costs time,
  never a record. docs/run-format.md, "Journal summaries".
"""

from __future__ import annotations

import functools
import json
import math
import zlib
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save as st_save

from ckptlab import dtypes
from ckptlab.errors import CorruptFileError
from ckptlab.io.files import read_bytes
from ckptlab.io.safetensors_file import check_entries
from ckptlab.run import framelog, records
from ckptlab.run.atomic import write_derived

SUFFIX = ".cols"
VERSION = 1
# What a row of a number column held (`Columns.kind`).
ABSENT, FLOAT, INT, BOOL, NULL = 0, 1, 2, 3, 4
_MAX_INT = 2**53  # ints beyond this would not come back exact from float64


@dataclass
class Columns:
    step: np.ndarray  # int64[n], the step records in recording order
    value: dict[str, np.ndarray] = field(default_factory=dict)  # float64[n] per number field
    kind: dict[str, np.ndarray] = field(default_factory=dict)  # uint8[n]: ABSENT/FLOAT/INT/BOOL/NULL
    lists: dict[str, tuple[np.ndarray, np.ndarray]] = field(
        default_factory=dict
    )  # (float64[n, L], int32[n]: -1 absent)
    # (int64 rows[k], values[k, ...]) per per-parameter field (joined parts: `Joined`, read-only)
    arrays: MutableMapping[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # every field, in the order records hold them
    # row -> {field: value} of the values no column holds (a string, a nested value, a list
    # that is not all floats, a field that is a number in one record and a list in another)
    extra: dict[int, dict] = field(default_factory=dict)
    others: list[tuple[int, int, dict]] = field(default_factory=list)  # (kind, step, record): validation, events

    def __len__(self) -> int:
        return len(self.step)

    # --- building ----------------------------------------------------------------------------

    @classmethod
    def from_records(cls, steps: list[tuple[int, dict, dict]], others: list[tuple[int, int, dict]]) -> Columns:
        """From step records (step, scalars, arrays) and the other records."""
        n = len(steps)
        out = cls(step=np.array([s for s, _, _ in steps], dtype=np.int64), others=list(others))
        order: dict[str, None] = {}
        lists: dict[str, list] = {}
        arrays: dict[str, list] = {}
        odd: list[tuple[int, str, Any]] = []
        for i, (_, scalars, arrs) in enumerate(steps):
            for key, v in scalars.items():
                if key == "step":
                    continue
                order[key] = None
                t = type(v)
                if t is list and all(type(x) is float for x in v):
                    lists.setdefault(key, []).append((i, v))
                    continue
                code = FLOAT if t is float else BOOL if t is bool else NULL if v is None else INT if t is int else 0
                if code == INT and not -_MAX_INT <= v <= _MAX_INT:
                    code = 0
                if code == 0:
                    odd.append((i, key, v))
                    continue
                if key not in out.value:
                    out.value[key], out.kind[key] = np.full(n, np.nan), np.zeros(n, dtype=np.uint8)
                out.value[key][i], out.kind[key][i] = (float(v) if code != NULL else np.nan), code
            for key, a in arrs.items():
                arrays.setdefault(key, []).append((i, np.asarray(a)))
        for key in [k for k in lists if k in out.value]:  # a list here, a number there: keep them as they are
            odd += [(i, key, v) for i, v in lists.pop(key)]
        for i, key, v in odd:
            out.extra.setdefault(i, {})[key] = v
        for key, rows in lists.items():
            width = max(len(v) for _, v in rows)
            values, lengths = np.full((n, width), np.nan), np.full(n, -1, dtype=np.int32)
            for i, v in rows:
                values[i, : len(v)], lengths[i] = v, len(v)
            out.lists[key] = (values, lengths)
        for key, rows in arrays.items():
            # Readers use per-parameter arrays of the model's parameter count only: the rows of
            # the most common shape and dtype are kept (all of them, in any run ckptlab wrote).
            kinds = [(a.shape, a.dtype.str) for _, a in rows]
            common = max(set(kinds), key=kinds.count)
            rows = [r for r, k in zip(rows, kinds) if k == common]
            out.arrays[key] = (np.array([i for i, _ in rows], dtype=np.int64), np.stack([a for _, a in rows]))
        out.order = list(order)
        return out

    @classmethod
    def from_frames(cls, frames: Iterable[tuple[framelog.FrameRef, bytes]], where: str) -> Columns:
        """From a segment's frames. A damaged frame raises CorruptFileError with the columns
        of the records before it as `.columns`."""
        steps: list[tuple[int, dict, dict]] = []
        others: list[tuple[int, int, dict]] = []
        try:
            for ref, payload in frames:
                at = f"{where}@{ref.step}"
                if ref.kind == framelog.STEP:
                    scalars, arrays = records.decode_step(payload, where=at)
                    steps.append((ref.step, scalars, arrays))
                elif ref.kind in (framelog.VALIDATION, framelog.EVENT):
                    kind = "validation" if ref.kind == framelog.VALIDATION else "event"
                    record = records.check_json_record(kind, records.decode_json(payload, where=at), at)
                    others.append((ref.kind, ref.step, record))
        except CorruptFileError as e:
            e.columns = cls.from_records(steps, others)  # type: ignore[attr-defined]
            raise
        return cls.from_records(steps, others)

    @classmethod
    def concat(cls, parts: Sequence[Columns]) -> Columns:
        sizes = [len(p) for p in parts]
        n, starts = sum(sizes), np.cumsum([0, *sizes])
        out = cls(step=np.concatenate([p.step for p in parts]) if parts else np.zeros(0, dtype=np.int64))
        order: dict[str, None] = {}
        for p, start in zip(parts, starts):
            order.update(dict.fromkeys(p.order))
            out.others += p.others
            out.extra.update({int(start) + i: v for i, v in p.extra.items()})
        out.order = list(order)
        for key in {k for p in parts for k in p.value}:
            out.value[key] = np.concatenate([p.value.get(key, np.full(len(p), np.nan)) for p in parts])
            out.kind[key] = np.concatenate([p.kind.get(key, np.zeros(len(p), dtype=np.uint8)) for p in parts])
        for key in {k for p in parts for k in p.lists}:
            width = max(p.lists[key][0].shape[1] for p in parts if key in p.lists)
            values, lengths = np.full((n, width), np.nan), np.full(n, -1, dtype=np.int32)
            for p, start in zip(parts, starts):
                if key in p.lists:
                    v, ln = p.lists[key]
                    values[start : start + len(p), : v.shape[1]], lengths[start : start + len(p)] = v, ln
            out.lists[key] = (values, lengths)
        keys = {k for p in parts for k in p.arrays}
        out.arrays = Joined({key: functools.partial(_join_arrays, parts, starts, key) for key in sorted(keys)})
        return out

    def by_step(self) -> Columns:
        """One record a step (a step recorded twice: the later one), in step order."""
        n = len(self)
        if n == 0 or (np.all(np.diff(self.step) > 0)):
            return self
        _, first_pos = np.unique(self.step[::-1], return_index=True)
        take = (n - 1 - first_pos).astype(np.int64)  # each step's last record, by step
        return self.take(take)

    def take(self, idx: np.ndarray) -> Columns:
        out = Columns(step=self.step[idx], order=list(self.order), others=list(self.others))
        if self.extra:
            new_of = {int(old): new for new, old in enumerate(idx)}
            out.extra = {new_of[i]: v for i, v in self.extra.items() if i in new_of}
        out.value = {k: v[idx] for k, v in self.value.items()}
        out.kind = {k: v[idx] for k, v in self.kind.items()}
        out.lists = {k: (v[idx], ln[idx]) for k, (v, ln) in self.lists.items()}
        where = np.full(len(self), -1, dtype=np.int64)
        for key, (rows, values) in self.arrays.items():
            where[:] = -1
            where[rows] = np.arange(len(rows))
            picked = where[idx]
            keep = np.flatnonzero(picked >= 0)
            out.arrays[key] = (keep, values[picked[keep]])
        return out

    # --- reading -----------------------------------------------------------------------------

    def number(self, key: str, fill: float) -> np.ndarray:
        """Field `key` as float64: NaN where null, `fill` where a record does not hold it."""
        if key not in self.value:
            return np.full(len(self), fill)
        return np.where(self.kind[key] == ABSENT, fill, self.value[key])

    def per_param(self, key: str, p: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, values[rows, p]) of per-parameter field `key` (no rows where its arrays are
        not `p` wide: a reader's parameter count is the manifest's)."""
        if key in self.arrays:
            rows, values = self.arrays[key]
            if values.ndim == 2 and values.shape[1] == p:
                return rows, values
        return np.zeros(0, dtype=np.int64), np.zeros((0, p), dtype=np.float32)

    def holds(self, key: str) -> np.ndarray:
        """bool[n]: the record holds field `key` (null included)."""
        if key in self.lists:
            return self.lists[key][1] >= 0
        return self.kind[key] != ABSENT if key in self.kind else np.zeros(len(self), dtype=bool)

    def row(self, i: int) -> dict:
        """Record i's scalars, as recorded."""
        out: dict[str, Any] = {"step": int(self.step[i])}
        for key in self.order:
            if key in self.lists:
                values, lengths = self.lists[key]
                if lengths[i] >= 0:
                    out[key] = [float(x) for x in values[i, : lengths[i]]]
                continue
            kinds = self.kind.get(key)
            if kinds is None or kinds[i] == ABSENT:  # (or in `extra`)
                continue
            k = kinds[i]
            v = self.value[key][i]
            out[key] = None if k == NULL else bool(v) if k == BOOL else int(v) if k == INT else float(v)
        if i in self.extra:
            out.update(self.extra[i])
        return out


class Rows(Sequence):
    """`Metrics.scalars`: the raw step records, each built from the columns when asked."""

    def __init__(self, cols: Columns):
        self._cols = cols

    @property
    def columns(self) -> Columns:
        return self._cols

    def __len__(self) -> int:
        return len(self._cols)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._cols.row(k) for k in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(i)
        return self._cols.row(i % n)

    def __iter__(self) -> Iterator[dict]:
        return (self._cols.row(i) for i in range(len(self)))

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    def __repr__(self) -> str:
        return f"<{len(self)} step records>"


def _join_arrays(parts: Sequence[Columns], starts, key: str) -> tuple[np.ndarray, np.ndarray]:
    have = [(p.arrays[key], start) for p, start in zip(parts, starts) if key in p.arrays]
    kinds = [(a.shape[1:], a.dtype.str) for (_, a), _ in have]
    common = max(set(kinds), key=lambda k: sum(len(h[0][0]) for h, kk in zip(have, kinds) if kk == k))
    have = [h for h, k in zip(have, kinds) if k == common]  # (as in from_records)
    rows = np.concatenate([r + start for (r, _), start in have])
    return rows, np.concatenate([a for (_, a), _ in have])


class Joined(MutableMapping):
    """`Columns.arrays` of joined parts, joined when one is first read (a long run's
    per-parameter arrays are a GB, and `info` reads none of them)."""

    def __init__(self, pending: dict[str, Callable[[], tuple[np.ndarray, np.ndarray]]]):
        self._pending = pending
        self._done: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def __getitem__(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        if key not in self._done:
            # All at once: each waiting field holds every part (and each part the bytes of its
            # summary, ~1 GB on a long run), so the parts go only when none is left waiting.
            for k in self._pending:
                if k not in self._done:
                    self[k] = self._pending[k]()
        return self._done[key]

    def __setitem__(self, key: str, value: tuple[np.ndarray, np.ndarray]) -> None:
        self._pending[key], self._done[key] = lambda: value, value

    def __delitem__(self, key: str) -> None:
        del self._pending[key]
        self._done.pop(key, None)

    def __contains__(self, key) -> bool:  # (Mapping's would join them to answer)
        return key in self._pending

    def __iter__(self) -> Iterator[str]:
        return iter(self._pending)

    def __len__(self) -> int:
        return len(self._pending)


# --- summaries beside the segments ------------------------------------------------------------


def summary_path(segment: Path) -> Path:
    return segment.with_suffix(SUFFIX)


def encode(cols: Columns, segment_bytes: int) -> bytes:
    tensors: dict[str, np.ndarray] = {"step": cols.step}
    for key in cols.value:
        tensors[f"v/{key}"], tensors[f"k/{key}"] = cols.value[key], cols.kind[key]
    for key, (values, lengths) in cols.lists.items():
        tensors[f"l/{key}"], tensors[f"n/{key}"] = values, lengths
    for key, (rows, values) in cols.arrays.items():
        tensors[f"r/{key}"], tensors[f"a/{key}"] = rows, np.ascontiguousarray(values)
    extra = [[i, v] for i, v in cols.extra.items()]
    meta = {"version": VERSION, "bytes": segment_bytes, "order": cols.order, "others": cols.others, "extra": extra}
    # safetensors has no checksum: the metadata holds the CRC of the data that follows the
    # header (the same bytes whatever the metadata; so: laid out once to take it).
    draft = st_save(tensors)
    meta["crc32"] = zlib.crc32(memoryview(draft)[8 + int.from_bytes(draft[:8], "little") :])
    return st_save(tensors, metadata={"ckptlab": json.dumps(records.json_safe(meta), allow_nan=False)})


def decode(data: bytes, where: str) -> tuple[Columns, int]:
    """A summary's columns and the segment size it describes. Raises CorruptFileError."""
    try:
        header_len = int.from_bytes(data[:8], "little")
        if len(data) < 8 or not 2 <= header_len <= len(data) - 8:
            raise ValueError(f"a header of {header_len} bytes in {len(data)}")
        header = json.loads(data[8 : 8 + header_len])
        meta = json.loads(header.pop("__metadata__")["ckptlab"])
        start = 8 + header_len
        tensors = {  # views of `data`, not copies: a long run's summaries are a GB
            name: np.frombuffer(data, dtype=_numpy_dtype(dtype), count=math.prod(shape), offset=start + begin).reshape(
                shape
            )
            for begin, _, name, shape, dtype in check_entries(where, header, len(data) - start)
        }
        if meta.get("version") != VERSION:
            raise ValueError(f"version {meta.get('version')!r}")
        if zlib.crc32(memoryview(data)[8 + header_len :]) != meta["crc32"]:
            raise ValueError("its data does not match its CRC")
        step = tensors.pop("step")
        n = len(step)
        cols = Columns(step=step.astype(np.int64, copy=False), order=[str(k) for k in meta["order"]])
        for kind, step_, record in meta["others"]:
            restored = records.json_restore(record)
            if not isinstance(restored, dict) or kind not in (framelog.VALIDATION, framelog.EVENT):
                raise ValueError("a malformed validation or event record")
            cols.others.append((int(kind), int(step_), restored))
        for i, values in meta["extra"]:
            restored = records.json_restore(values)
            if not isinstance(restored, dict) or not 0 <= int(i) < n:
                raise ValueError("a malformed record")
            cols.extra[int(i)] = restored
        for name, t in tensors.items():
            tag, _, key = name.partition("/")
            if tag == "v":
                cols.value[key], cols.kind[key] = _shaped(t, (n,), "f"), _shaped(tensors[f"k/{key}"], (n,), "u")
            elif tag == "l":
                cols.lists[key] = (_shaped(t, (n, -1), "f"), _shaped(tensors[f"n/{key}"], (n,), "i"))
                if cols.lists[key][1].max(initial=-1) > t.shape[1]:
                    raise ValueError(f"list {key} longer than its columns")
            elif tag == "a":
                rows = _shaped(tensors[f"r/{key}"], (len(t),), "i").astype(np.int64)
                if len(rows) and (rows.min() < 0 or rows.max() >= n or np.any(np.diff(rows) <= 0)):
                    raise ValueError(f"rows of {key} out of order")
                cols.arrays[key] = (rows, t)
            elif tag not in ("k", "n", "r"):
                raise ValueError(f"unknown column {name!r}")
        if not set(cols.value) | set(cols.lists) <= set(cols.order):
            raise ValueError("its fields and columns differ")
        return cols, int(meta["bytes"])
    except (ValueError, KeyError, TypeError, IndexError, RecursionError, AttributeError) as e:
        raise CorruptFileError(f"unreadable journal summary ({type(e).__name__}: {e})", path=where) from None
    except Exception as e:  # safetensors' own errors
        raise CorruptFileError(f"unreadable journal summary ({e})", path=where) from None


def _numpy_dtype(name: str) -> np.dtype:
    """How numpy reads a column of dtype `name` (little-endian, as safetensors stores it)."""
    if name in dtypes.BITS:  # (no numpy type: never written in a summary)
        raise ValueError(f"a column of {name}")
    return dtypes.storage(name).newbyteorder("<")


def _shaped(a: np.ndarray, shape: tuple, kind: str) -> np.ndarray:
    if a.dtype.kind != kind or a.ndim != len(shape) or any(s not in (-1, d) for s, d in zip(shape, a.shape)):
        raise ValueError(f"a column of {a.dtype} {a.shape}, not {kind} {shape}")
    return a


def write_summary(segment: Path, appended: tuple[list, list] | None = None) -> bool:
    """Summarize a closed journal segment into its `.cols` file (written whole: a temporary
    file renamed; no fsync, as it is derived: lost to a power cut, readers decode the
    segment). `appended`: the records as the writer appended them, ([(step, scalars,
    arrays)], [(kind, step, record)]), used when the segment's frame headers are exactly
    theirs and every value is one JSON gives back as it is (~10x cheaper than decoding the
    frames, on the Recorder's writer thread); else the frames are decoded. False when the
    segment cannot be read whole."""
    try:
        size = segment.stat().st_size
        cols = _from_appended(segment, appended) if appended is not None else None
        if cols is None:
            cols = Columns.from_frames(framelog.iter_payloads(segment), str(segment))
    except (CorruptFileError, OSError):
        return False
    write_derived(summary_path(segment), encode(cols, size))
    return True


class _NotPlain(Exception):
    pass


def _from_appended(segment: Path, appended: tuple[list, list]) -> Columns | None:
    steps, others = appended
    scan = framelog.scan(segment)
    if scan.torn_bytes or scan.corrupt:
        return None
    kinds = [(f.kind, f.step) for f in scan.frames]
    written = sorted([(framelog.STEP, s) for s, _, _ in steps] + [(k, s) for k, s, _ in others])
    if sorted(kinds) != written or [s for k, s in kinds if k == framelog.STEP] != [s for s, _, _ in steps]:
        return None
    try:
        plain = [(s, {k: _plain(v) for k, v in sc.items()}, _plain_arrays(a)) for s, sc, a in steps]
    except _NotPlain:
        return None
    # (validation and event records are few: the JSON round trip they took, taken again)
    again = [(k, s, records.decode_json(records.encode_json(r), where=str(segment))) for k, s, r in others]
    return Columns.from_records(plain, again)


def _plain(v):
    """`v` as the step record's JSON gives it back (a float subclass as a float, a tuple of
    floats as a list), or _NotPlain for a value whose round trip is not that simple."""
    if v is None or type(v) is bool or type(v) is int:
        return v
    if isinstance(v, float):
        return float(v)
    if isinstance(v, (list, tuple)) and all(isinstance(x, float) for x in v):
        return [float(x) for x in v]
    raise _NotPlain


def _plain_arrays(arrays: dict) -> dict[str, np.ndarray]:
    out = {}
    for key, a in arrays.items():
        if a is None:  # (not written)
            continue
        if isinstance(a, list):  # encode_step_floats: float32 values as Python floats
            out[key] = np.array(a, dtype=np.float32)
        elif isinstance(a, np.ndarray) and a.dtype.kind in "fiub" and a.dtype.isnative:
            out[key] = np.ascontiguousarray(a)
        else:
            raise _NotPlain
    return out


def load_summary(segment: Path, size: int) -> Columns | None:
    """The columns of `segment` (now `size` bytes) from its summary; None when it has none or
    it describes another size (or cannot be read: the caller decodes the segment instead)."""
    path = summary_path(segment)
    try:
        if path.stat().st_size > 8 * size + (1 << 20):  # far larger than what it summarizes
            return None
        cols, described = decode(read_bytes(path), str(path))
    except (OSError, CorruptFileError):
        return None
    return cols if described == size else None
