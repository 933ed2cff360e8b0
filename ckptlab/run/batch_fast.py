"""The common batch record, encoded with few Python and torch calls: the same bytes as the
general path (`records.encode_batch`: the codec's spec, then `records.pack`), cheaper.

A batch record is written before every training step, on the training thread, right after the
previous step's compute (cold caches: each torch op costs ~5-10 us there). Most batches are a
tensor, or a dict / list / tuple of dense CPU tensors (token ids, masks, labels) with the same
structure, dtypes and shapes step after step. So what follows from the structure alone (the
codec's spec, the tensors' names, the safetensors header's entries and data order) is built
once per structure and kept; a step only finds its integer tensors' value range, narrows them
as `codec._compact` does, and joins the header and the data into the payload. Small integer
and bool tensors (at most SMALL_NUMEL elements: a small batch's token ids, masks, labels) are
read as Python ints and packed with `struct`: right after a step, when nothing else has used
numpy, one numpy call costs 20-60 us. Larger ones go through numpy on the tensor's own memory
(one reduction when no value is negative). The join (or the pack) is the copy the codec's
clone makes: the bytes are taken before `encode_batch` returns, so the loop may change its
batch afterwards.

Anything else (a tensor on a GPU, with grad, non-contiguous, of another dtype; numpy arrays,
floats, namedtuples, non-str dict keys; RNG states to record) gets None: the general path.
tests/run/test_batch_fast.py checks the bytes against that path.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import torch

from ckptlab import dtypes
from ckptlab.run import codec

# What `records` encodes with (the codec's: records imports this module, not the reverse).
META_KEY, _JSON, _JSON_HEADER = codec.META_KEY, codec.JSON_COMPACT, codec.JSON_HEADER
# _JSON of the sample ids without the C encoder `JSONEncoder.encode` makes per call (~1 us of a
# ~10 us record); made without the circular-reference check, so a list that holds itself
# recurses to a RecursionError, and then _JSON says what it says of it.
_make_encoder = getattr(json.encoder, "c_make_encoder", None)
_IDS = (
    _make_encoder(
        None, json.JSONEncoder().default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True
    )
    if _make_encoder is not None
    else None
)

# torch dtype -> (safetensors code, its rank: it orders a file's data, whether the codec
# compacts it) of the dtypes encoded here.
_FAST_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.int64}
_FAST_DTYPES |= {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_DTYPES: dict[torch.dtype, tuple[str, int, bool]] = {
    getattr(torch, name): (code, rank, getattr(torch, name) in codec._INT_DTYPES)
    for code, (name, rank) in dtypes.SAFETENSORS.items()
    if getattr(torch, name, None) in _FAST_DTYPES
}
# codec._COMPACT as numpy dtypes: (numpy dtype, codec name, min, max), narrowest first.
_COMPACT = [(torch.empty(0, dtype=d).numpy().dtype, codec.dtype_name(d), lo, hi) for d, lo, hi in codec._COMPACT]

# itemsize of the signed ints the codec compacts -> (the unsigned dtype, the largest signed value)
_UNSIGNED = {d.itemsize: (np.dtype(f"u{d.itemsize}"), 2 ** (8 * d.itemsize - 1) - 1) for d in codec._INT_DTYPES}

# Integer and bool tensors of at most SMALL_NUMEL elements (token ids, masks, labels of a small
# batch) are packed from Python ints (`_small_ints`); dtype -> whether the codec compacts it.
SMALL_NUMEL = 1024
_SMALL = {
    d: d in codec._INT_DTYPES for d in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
}
# The struct code of each dtype packed that way (little-endian, standard sizes).
_STRUCT = {torch.bool: "?", torch.uint8: "B", torch.int8: "b", torch.uint16: "H", torch.int16: "h"}
_STRUCT |= {torch.int32: "i", torch.int64: "q"}

# structure signature -> (`,"batch":SPEC,"sample_ids":`, the header after the metadata, the
# order of the tensors' data in the file, the first as it reads inside the metadata string). Bounded: a batch whose leaves (ints, strings) change
# every step makes a new signature each time.
_CACHE: dict[tuple, tuple[str, str, tuple[int, ...], str]] = {}
_CACHE_MAX = 64
_STRIDED = torch.strided


def encode_batch(step: int, batch: Any, sample_ids: list | None) -> bytes | None:
    """`records.encode_batch(step, batch, sample_ids, rng=None)`, byte for byte, for a batch of
    the common kinds (module docstring); None for any other: the caller takes the general path."""
    if type(step) is not int:
        return None
    sig: list = []
    arrays: list = []
    try:
        if not _walk(batch, sig, arrays):
            return None
    except RecursionError:
        return None
    key = tuple(sig)
    entry = _CACHE.get(key)
    if entry is None:
        entry = _build(batch, sig, arrays)
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.clear()
        _CACHE[key] = entry
    middle, tail, order, escaped = entry
    ids = _int_ids(sample_ids)
    if ids is not None:  # (nothing in it to escape: the metadata string is written as is)
        meta = '"{\\"step\\":' + int.__repr__(step) + escaped + ids + '}"'
    else:
        meta = _JSON_HEADER('{"step":' + int.__repr__(step) + middle + _ids_json(sample_ids) + "}")
    head = ('{"__metadata__":{"' + META_KEY + '":' + meta + tail).encode()
    head += b" " * (-len(head) % 8)
    if len(order) == 1:
        return b"".join((struct.pack("<Q", len(head)), head, arrays[0]))
    return b"".join([struct.pack("<Q", len(head)), head, *[arrays[i] for i in order]])


def _int_ids(sample_ids: list | None) -> str | None:
    """The JSON of sample ids that are None or a list of plain ints (nothing in it a JSON
    string must escape); None for any other."""
    if sample_ids is None:
        return "null"
    if type(sample_ids) is list and all(type(i) is int for i in sample_ids):
        return "[" + ",".join(map(int.__repr__, sample_ids)) + "]"
    return None


def _ids_json(sample_ids: list | None) -> str:
    if type(sample_ids) is list and _IDS is not None:
        try:
            return "".join(_IDS(sample_ids, 0))
        except (RecursionError, TypeError, ValueError):
            pass  # _JSON raises what the general path raises
    return _JSON(sample_ids)


def _walk(obj: Any, sig: list, arrays: list) -> bool:
    """Append what `obj`'s encoding depends on (but its tensors' data) to `sig`, and its tensors'
    data, in the order the codec meets them, to `arrays`; False if the fast path cannot encode it."""
    kind = type(obj)
    if kind is torch.Tensor:
        return _tensor(obj, sig, arrays)
    if kind is dict:
        keys = tuple(obj)
        sig.append(keys)  # strings: every other entry of `sig` starts with a type or a dtype
        for k in keys:
            if type(k) is not str or not _walk(obj[k], sig, arrays):
                return False
        return True
    if kind is list or kind is tuple:
        sig.append((kind, len(obj)))
        for v in obj:
            if not _walk(v, sig, arrays):
                return False
        return True
    if obj is None or kind is int or kind is str or kind is bool:
        sig.append((kind, obj))  # the type too: 1, 1.0 and True are equal keys
        return True
    return False


def _tensor(t: torch.Tensor, sig: list, arrays: list) -> bool:
    if t.requires_grad or not t.is_cpu or t.layout is not _STRIDED or not t.is_contiguous():
        return False
    dtype = t.dtype
    spec = _DTYPES.get(dtype)
    if spec is None:
        return False
    small = _SMALL.get(dtype)
    if small is not None and t.numel() <= SMALL_NUMEL:  # (no numpy: module docstring)
        return _small_ints(t, small, sig, arrays)
    try:
        a = t.view(torch.int16).numpy() if dtype is torch.bfloat16 else t.numpy()
    except RuntimeError:  # a negative or conjugate view bit: numpy() refuses, the codec copes
        return False
    stored = None
    if spec[2] and a.size:
        # One reduction where no value is negative (token ids): the largest as unsigned is the
        # largest, and then the lowest does not matter (every candidate dtype holds 0..hi).
        unsigned, top = _UNSIGNED[a.itemsize]
        lo, hi = 0, int(a.view(unsigned).max())
        if hi > top:  # a negative value
            lo, hi = int(a.min()), int(a.max())
        for np_dtype, name, dmin, dmax in _COMPACT:
            if dmin <= lo and hi <= dmax:
                if np_dtype.itemsize < a.itemsize:  # else kept as is (codec._compact)
                    stored, a = name, a.astype(np_dtype)
                break
    sig.append((dtype, t.shape, stored))
    arrays.append(a)
    return True


def _small_ints(t: torch.Tensor, compacts: bool, sig: list, arrays: list) -> bool:
    """A small integer (or bool) tensor's data, compacted as `codec._compact` does, packed from
    its values as Python ints: right after a step a numpy call costs tens of microseconds,
    `tolist`, `min`, `max` and `struct.pack` a few."""
    values = t.reshape(-1).tolist()
    stored, code = None, _STRUCT[t.dtype]
    if compacts and values:
        lo, hi = min(values), max(values)
        for dtype, dmin, dmax in codec._COMPACT:
            if dmin <= lo and hi <= dmax:
                if dtype.itemsize < t.itemsize:  # else kept as is (codec._compact)
                    stored, code = codec.dtype_name(dtype), _STRUCT[dtype]
                break
    sig.append((t.dtype, t.shape, stored))
    arrays.append(struct.pack(f"<{len(values)}{code}", *values))
    return True


def _build(batch: Any, sig: list, arrays: list) -> tuple[str, str, tuple[int, ...], str]:
    """The parts of the record that depend only on the signature `sig` of `batch`: the JSON
    between the step and the sample ids, the safetensors header after the metadata (as
    `records.layout` writes it) and the order of the tensors' data in the file."""
    tensors = [s for s in sig if len(s) == 3 and isinstance(s[0], torch.dtype)]  # (dtype, shape, stored)
    refs: dict[str, int] = {}  # tensor name -> its index in `arrays`
    spec = _spec(batch, "batch", refs, iter([s[2] for s in tensors]))
    middle = ',"batch":' + _JSON(spec) + ',"sample_ids":'
    entries = []
    for name, i in refs.items():
        dtype, _, stored = tensors[i]
        code, rank = _DTYPES[codec.dtype_from_name(stored) if stored is not None else dtype][:2]
        entries.append((-rank, name, code, i))
    entries.sort(key=lambda e: (e[0], e[1]))  # safetensors' order: dtype rank (descending), name
    header: dict[str, Any] = {}
    offset = 0
    for _, name, code, i in entries:
        n = memoryview(arrays[i]).nbytes
        header[name] = {"dtype": code, "shape": list(tensors[i][1]), "data_offsets": [offset, offset + n]}
        offset += n
    tail = "}" + ("," + _JSON_HEADER(header)[1:-1] if header else "") + "}"
    # `middle` as it reads inside the metadata string (a JSON string of the record's JSON)
    escaped = _JSON_HEADER(middle)[1:-1]
    return middle, tail, tuple(e[3] for e in entries), escaped


def _spec(obj: Any, path: str, refs: dict[str, int], stored) -> Any:
    """The codec's spec of `obj` (codec._Encoder.node, for the kinds `_walk` accepts)."""
    if isinstance(obj, torch.Tensor):
        node: dict[str, Any] = {"t": "tensor", "dtype": codec.dtype_name(obj.dtype), "shape": list(obj.shape)}
        s = next(stored)
        if s is not None:
            node["stored"] = s
        name, n = path, 1
        while name in refs:  # codec._Encoder.ref
            n += 1
            name = f"{path}#{n}"
        refs[name] = len(refs)
        node["ref"] = name
        return node
    if isinstance(obj, dict):
        return {"t": "dict", "k": list(obj), "v": [_spec(v, f"{path}/{k}", refs, stored) for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        tag = "tuple" if isinstance(obj, tuple) else "list"
        return {"t": tag, "v": [_spec(v, f"{path}/{i}", refs, stored) for i, v in enumerate(obj)]}
    return obj
