"""What one frame holds: a batch record or a step's health, as safetensors bytes.

Every frame payload with tensors is a complete safetensors file (after zlib when compressed):
its tensors are the record's arrays, and `__metadata__["ckptlab"]` is the record's JSON. So a
frame can be opened by any safetensors reader; `docs/run-format.md` shows how.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import safetensors.torch
import torch

from ckptlab import dtypes
from ckptlab.errors import CorruptFileError
from ckptlab.jsonable import is_int, is_number, json_restore, json_safe
from ckptlab.run import batch_fast, codec
from ckptlab.run.codec import META_KEY
from ckptlab.run.framelog import FLAG_SAFETENSORS, FLAG_ZLIB, MAX_INFLATED

# A step record's param_grad_norm for a parameter that got no gradient that step.
NO_GRAD = -1.0


# Events that are no anomaly of a step: what the Recorder warns of about its own record
# (analysis/anomalies.py says what each means). Readers skip them where they look for faults.
IDLE_OPTIMIZER = "idle_optimizer"
OUTSIDE_OPTIMIZER = "outside_optimizer"
RECORD_WARNINGS = (IDLE_OPTIMIZER, OUTSIDE_OPTIMIZER)


def pack(meta: dict, tensors: dict[str, torch.Tensor | np.ndarray]) -> bytes:
    """The record as safetensors bytes: the same bytes `safetensors.torch.save` writes
    (tests/run/test_records.py compares them), built here because the library's Python side
    costs ~0.1 ms a call and a recorded step packs two records. A value may also be a numpy
    array (a step record's health arrays): stored as the tensor `torch.from_numpy` makes of it."""
    return pack_json(_JSON(meta), tensors)


def pack_json(meta_json: str, tensors: dict[str, torch.Tensor | np.ndarray]) -> bytes:
    """`pack` of a record whose JSON is already encoded (`meta_json`)."""
    metadata = {META_KEY: meta_json}
    laid = layout(tensors, metadata)
    if laid is None:
        return safetensors.torch.save(_as_torch(tensors), metadata=metadata)
    head, chunks = laid
    return b"".join([head, *chunks])  # type: ignore[list-item]  # ndarray has the buffer protocol; numpy's stubs lack __buffer__


def layout(tensors: dict, metadata: dict[str, str]) -> tuple[bytes, list[np.ndarray]] | None:
    """What `safetensors.torch.save(tensors, metadata)` writes, as (the 8-byte length and the
    header, then the data of each tensor in file order: numpy views of the tensors' own memory
    where they are contiguous); None when a tensor is of a kind this does not lay out itself."""
    entries = []  # (rank of the dtype, name, safetensors dtype, shape, a C-contiguous array of the data)
    for name, t in tensors.items():
        entry = _entry(t)
        if entry is None:
            return None
        entries.append((-entry[0], name, *entry[1:]))
    # safetensors' order: dtype by its rank (descending), then name; data back to back.
    entries.sort(key=lambda e: (e[0], e[1]))
    header: dict[str, Any] = {"__metadata__": metadata}
    chunks, offset = [], 0
    for _, name, dtype, shape, data in entries:
        n = data.nbytes
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        chunks.append(data)
        offset += n
    head = _JSON_HEADER(header).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head, chunks


_JSON, _JSON_HEADER = codec.JSON_COMPACT, codec.JSON_HEADER
# The compact encoder, refusing a non-finite float (ValueError) instead of writing NaN: a record whose
# numbers are all finite needs no `json_safe` copy first (the same text either way).
_JSON_FINITE = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def _entry(t) -> tuple[int, str, list[int], np.ndarray] | None:
    """(rank, safetensors dtype, shape, data as a C-contiguous numpy array) of a dense CPU
    tensor or numpy array that `pack` writes itself; None for anything else."""
    if isinstance(t, np.ndarray):
        spec = _NUMPY_DTYPES.get(t.dtype.str)
        if spec is None:
            return None
        return spec[1], spec[0], list(t.shape), np.ascontiguousarray(t)
    spec = _SAFETENSORS_DTYPES.get(t.dtype)
    if spec is None or t.is_sparse or t.device.type != "cpu":
        return None
    t = t.detach()
    if t.dtype in _VIA_NUMPY:
        return spec[1], spec[0], list(t.shape), np.ascontiguousarray(t.numpy())
    return spec[1], spec[0], list(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _as_torch(tensors: dict) -> dict[str, torch.Tensor]:
    return {
        k: torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v for k, v in tensors.items()
    }


# Copied through numpy's own dtype (the same bytes, fewer calls); the others are viewed as bytes.
_VIA_NUMPY = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.float16, torch.int32, torch.float32}
_VIA_NUMPY |= {torch.float64, torch.int64, torch.uint16, torch.uint32, torch.uint64}
# torch dtype -> (safetensors code, its rank: dtypes.SAFETENSORS) of the dtypes laid out here
# (float8 is left to the library).
_SAFETENSORS_DTYPES = {
    getattr(torch, name): (code, rank)
    for code, (name, rank) in dtypes.SAFETENSORS.items()
    if getattr(torch, name, None) in _VIA_NUMPY | {torch.bfloat16}
}
# numpy dtype (native byte order) -> the torch dtype's entry above
_NUMPY_DTYPES = {
    np.dtype(d).str: _SAFETENSORS_DTYPES[t]
    for d, t in [
        (np.bool_, torch.bool), (np.uint8, torch.uint8), (np.int8, torch.int8), (np.int16, torch.int16),
        (np.float16, torch.float16), (np.int32, torch.int32), (np.float32, torch.float32),
        (np.float64, torch.float64), (np.int64, torch.int64),
    ]
}  # fmt: skip


def unpack(data: bytes, *, where: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """Parse safetensors bytes written by `pack`; `where` names the source in errors."""
    try:
        (n,) = struct.unpack_from("<Q", data, 0)
        if n > len(data) - 8:
            raise ValueError("header longer than the payload")
        header = json.loads(bytes(data[8 : 8 + n]))
        meta = json.loads(header["__metadata__"][META_KEY])
        tensors = safetensors.torch.load(bytes(data)) if len(header) > 1 else {}
    except Exception as e:  # noqa: BLE001 - any parse failure of stored bytes is corruption
        raise CorruptFileError(f"unreadable record ({type(e).__name__}: {e})", path=where) from None
    return meta, tensors


# A payload under this many bytes is stored as is: deflating 1-4 KiB costs 30-100 us of the
# training thread right after a step (zlib's set-up and its deflate), to save at most about a
# kilobyte: a large share of a fast step's bookkeeping (scripts/profile_record_step.py).
MIN_COMPRESS = 4096


class Compressor:
    """Decides per stream whether zlib pays off: it re-tests every `every` frames and keeps
    compressing only while it saves >= 10% (token ids often do; float activations do not).
    A payload larger than framelog.MAX_INFLATED is stored as is: readers refuse to inflate
    more; so is one under MIN_COMPRESS bytes."""

    def __init__(self, every: int = 64, level: int = 1):
        self.every, self.level = every, level
        self._n = 0
        self._on = True

    def __call__(self, payload: bytes) -> tuple[bytes, int]:
        if len(payload) < MIN_COMPRESS:
            return payload, FLAG_SAFETENSORS
        test = self._n % self.every == 0
        self._n += 1
        if (test or self._on) and len(payload) <= MAX_INFLATED:
            packed = _deflate(payload, self.level)
            if test:
                self._on = len(packed) <= 0.9 * len(payload)
            if self._on:
                return packed, FLAG_SAFETENSORS | FLAG_ZLIB
        return payload, FLAG_SAFETENSORS


def _deflate(payload: bytes, level: int) -> bytes:
    """zlib.compress(payload, level), with a window no larger than the payload: zlib's default
    state (~256 KiB, allocated and freed per call) costs more than a small payload's deflate.
    Any zlib reader inflates it (the window size is in the stream's header)."""
    if len(payload) >= 1 << 15:
        return zlib.compress(payload, level)
    wbits = max(9, (len(payload) - 1).bit_length())
    c = zlib.compressobj(level, zlib.DEFLATED, wbits, wbits - 7)
    return c.compress(payload) + c.flush()


# --- batch records -------------------------------------------------------------------------


@dataclass
class BatchRecord:
    step: int
    batch: Any  # None when stored by reference (`ref`): replay rebuilds it with batch_fn
    sample_ids: list | None
    rng: dict | None  # None: the RNG states were those at the end of the previous step
    ref: dict | None = None  # {"sha256": digest of the batch, "bytes": its size}, by reference


def batch_nbytes(batch: Any) -> int:
    """The bytes of the batch's tensors and arrays (what storing it whole would cost)."""
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    if isinstance(batch, np.ndarray):
        return int(batch.nbytes)
    if isinstance(batch, dict):
        return sum(batch_nbytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(batch_nbytes(v) for v in batch)
    return 0


def batch_digest(batch: Any) -> str:
    """sha256 of a batch's content: its structure, dtypes, shapes and every tensor's bytes.
    Two batches with the same digest are the same batch, bit for bit."""
    spec, tensors = codec.encode(batch, prefix="batch")
    h = hashlib.sha256(json.dumps(spec, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(name.encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")  # type: ignore[arg-type]  # ndarray has the buffer protocol; numpy's stubs lack __buffer__
    return h.hexdigest()


def encode_batch_ref(step: int, digest: str, nbytes: int, sample_ids: list | None, rng: dict | None) -> bytes:
    """A batch stored by reference: its sample ids, digest and size; replay rebuilds it."""
    return _encode_batch_meta({"step": step, "batch": None, "sample_ids": sample_ids}, rng, digest, nbytes)


def encode_batch(step: int, batch: Any, sample_ids: list | None, rng: dict | None) -> bytes:
    if rng is None:  # the common batch, the same bytes with fewer calls (run/batch_fast.py)
        payload = batch_fast.encode_batch(step, batch, sample_ids)
        if payload is not None:
            return payload
    spec, tensors = codec.encode(batch, prefix="batch", compact_ints=True)
    return _encode_batch_meta({"step": step, "batch": spec, "sample_ids": sample_ids}, rng, tensors=tensors)


def _encode_batch_meta(meta: dict, rng: dict | None, digest=None, nbytes=0, tensors=None) -> bytes:
    tensors = dict(tensors or {})
    if digest is not None:
        meta["ref"] = {"sha256": digest, "bytes": int(nbytes)}
    if rng is not None:
        meta["rng"], rng_tensors = codec.encode(rng, prefix="rng")
        tensors.update(rng_tensors)
    return pack(meta, tensors)


def decode_batch(payload: bytes, *, where: str) -> BatchRecord:
    meta, tensors = unpack(payload, where=where)
    try:
        ref = meta.get("ref")
        if ref is not None and not (isinstance(ref, dict) and isinstance(ref.get("sha256"), str)):
            raise ValueError(f"malformed batch reference {str(ref)[:80]}")
        batch = codec.decode(meta["batch"], tensors) if ref is None else None
        rng = codec.decode(meta["rng"], tensors) if meta.get("rng") is not None else None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptFileError(f"malformed batch record for step {meta.get('step')}: {e}", path=where) from None
    try:
        return BatchRecord(int(meta["step"]), batch, meta.get("sample_ids"), rng, ref)
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptFileError(f"malformed batch record ({type(e).__name__}: {e})", path=where) from None


# --- step health records -------------------------------------------------------------------


def encode_step(scalars: dict, arrays: dict[str, np.ndarray]) -> bytes:
    """A step record: its scalars as JSON (non-finite floats as strings: `json_safe`) and its
    arrays. Most steps' numbers are all finite, and are encoded as they are, without the copy
    `json_safe` makes (a step record a step, on the training thread)."""
    try:
        meta_json = _JSON_FINITE(scalars)
    except ValueError:  # a NaN or an infinity among them
        meta_json = _JSON(json_safe(scalars))
    return pack_json(meta_json, {k: v for k, v in arrays.items() if v is not None})


def encode_step_floats(scalars: dict, arrays: dict[str, list[float]]) -> bytes:
    """`encode_step(scalars, arrays as float32 arrays)`, the same bytes, for the usual step
    (training/health.py `CommonHealth`: float32 vectors only) in fewer, plainer calls than the
    general layout: right after a step each numpy call costs tens of microseconds. The arrays
    hold float32 values (as Python floats)."""
    meta_json = _plain_json(scalars)
    if meta_json is None:
        try:
            meta_json = _JSON_FINITE(scalars)
        except ValueError:  # a NaN or an infinity among them
            return encode_step(scalars, {k: np.array(v, dtype=np.float32) for k, v in arrays.items()})
    # What `layout` writes for F32 vectors (one dtype: in the order of their names): the
    # metadata (its JSON as a JSON string: only quotes to escape in a record of numbers), then
    # each tensor's entry, padded to 8 bytes.
    escaped = meta_json.replace('"', '\\"')
    entries, offset, names = [], 0, sorted(arrays)
    for name in names:
        n = len(arrays[name])
        entries.append(f'"{name}":{{"dtype":"F32","shape":[{n}],"data_offsets":[{offset},{offset + 4 * n}]}}')
        offset += 4 * n
    head = f'{{"__metadata__":{{"{META_KEY}":"{escaped}"}},{",".join(entries)}}}'.encode()
    head += b" " * (-len(head) % 8)
    data = [struct.pack(f"<{len(arrays[name])}f", *arrays[name]) for name in names]
    return b"".join([struct.pack("<Q", len(head)), head, *data])


def _plain_json(record: dict) -> str | None:
    """`_JSON_FINITE(record)`, the same text, for a record of plain names whose values are
    finite floats, ints, bools or lists of finite floats (a step record's scalars) -- else
    None. Python's JSON encoder writes a float as its repr and an int as its str; formatted
    here without the encoder, which costs ~40 us right after a step."""
    items = []
    for key, v in record.items():
        kind = type(v)
        if kind is float:
            if v - v != 0.0:  # NaN or an infinity
                return None
            items.append(f'"{key}":{v!r}')
        elif kind is bool:
            items.append(f'"{key}":{"true" if v else "false"}')
        elif kind is int:
            items.append(f'"{key}":{v}')
        elif kind is list and all(type(x) is float and x - x == 0.0 for x in v):
            items.append(f'"{key}":[{",".join(map(repr, v))}]')
        else:
            return None
    return "{" + ",".join(items) + "}"


def decode_step(payload: bytes, *, where: str) -> tuple[dict, dict[str, np.ndarray]]:
    meta, tensors = unpack(payload, where=where)
    if not isinstance(meta, dict):
        raise CorruptFileError("unreadable record (not a JSON object)", path=where)
    try:
        scalars, arrays = json_restore(meta), {k: v.numpy() for k, v in tensors.items()}
    except (RecursionError, TypeError) as e:
        raise CorruptFileError(f"unreadable record ({type(e).__name__})", path=where) from None
    _check_fields(scalars, STEP_FIELDS, "step record", where)
    if not all(is_number(x) for x in scalars.get("lr", [])):
        raise CorruptFileError("malformed step record: 'lr' holds something that is not a number", path=where)
    return scalars, arrays


# The types a reader relies on, per field (a field may be absent). A record whose field has
# another type is corruption, reported with the file, not an error deep in an analysis.
STEP_FIELDS = {
    "loss": "number",
    "grad_norm": "number",
    "step_time": "number",
    "time": "number",
    "ckpt_wait": "number",
    "data_wait": "number",
    "wall_time": "number",
    "ckpt_time": "number",
    "gc_time": "number",
    "samples": "int",
    "tokens": "int",
    "mem_peak": "int",
    "mem_limit": "int",
    "swap": "int",
    "recompiles": "int",
    "nonfinite_grads": "int",
    "nonfinite_weights": "int",
    "update_ratio_global": "number",
    "grad_scale": "number",
    "stepped": "bool",
    "scaler_skipped": "bool",
    "lr": "list",
    "rank_loss": "list",
    "rank_grad_norm": "list",
}
_KINDS = {
    "number": (is_number, "a number"),
    "int": (is_int, "an integer"),
    "bool": (lambda x: isinstance(x, bool), "true or false"),
    "list": (lambda x: isinstance(x, list), "a list"),
}


def _check_fields(record: dict, fields: dict[str, str], what: str, where) -> None:
    for key, kind in fields.items():
        if key in record and record[key] is not None:
            ok, name = _KINDS[kind]
            if not ok(record[key]):
                raise CorruptFileError(f"malformed {what}: {key!r} is not {name}", path=where)


def check_json_record(kind: str, record: dict, where) -> dict:
    """A validation or event record with the types readers rely on (CorruptFileError naming
    `where` otherwise). Its step is the frame's: a `step` inside the payload is dropped."""
    record = {k: v for k, v in record.items() if k != "step"}
    if kind == "validation":
        metrics = record.get("metrics")
        if not isinstance(metrics, dict) or not all(is_number(v) for v in metrics.values()):
            raise CorruptFileError("malformed validation record: 'metrics' is not an object of numbers", path=where)
    else:
        if not isinstance(record.get("kind"), str):
            raise CorruptFileError(f"malformed {kind} record: 'kind' is not a string", path=where)
        _check_fields(record, {"rank": "int"}, f"{kind} record", where)
    return record


def encode_json(meta: dict) -> bytes:
    return _JSON(json_safe(meta)).encode()


def decode_json(payload: bytes, *, where: str) -> dict:
    try:
        record = json_restore(json.loads(payload))
    except ValueError as e:
        raise CorruptFileError(f"unreadable record ({e})", path=where) from None
    except RecursionError:
        raise CorruptFileError("unreadable record (JSON nested too deeply)", path=where) from None
    if not isinstance(record, dict):
        raise CorruptFileError("unreadable record (not a JSON object)", path=where)
    return record
