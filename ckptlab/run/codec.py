"""Exact, pickle-free encoding of nested Python/torch/numpy objects: `spec` JSON + named tensors.

    spec, tensors = encode({"ids": torch.tensor([[5, 7]]), "lens": [2]}, prefix="batch")
    # spec    -> {"t": "dict", "k": ["ids", "lens"], "v": [{"t": "tensor", "ref": "batch/ids",...}, ...]}
    # tensors -> {"batch/ids": tensor([[5, 7]], dtype=torch.uint8)}   (compacted, see below)
    obj = decode(spec, tensors)        # equal to the input: dtypes, shapes, strides, values

One codec serves the batch log and the checkpoints' training state (optimizer, scheduler,
grad scaler, RNG states), so "what round-trips exactly" is defined in one place.

Spec grammar: JSON null/bool/int/str and finite floats stand for themselves; every JSON object
is a tagged node {"t": TAG, ...}. Tags: dict, list, tuple, namedtuple, tensor, ndarray,
npscalar, float (non-finite), bytes, dtype, device, size. Decoding builds only these types:
nothing from a file is imported or executed (a namedtuple is re-created by field names, or
taken from an already-imported module of the same name and fields).

Tensors are stored under readable path names (`optimizer/state/0/exp_avg`), so a safetensors
viewer shows what is what. With `compact_ints=True` (the batch log), integer tensors are stored
in the narrowest integer dtype that holds their values: token ids in int64 take 2 bytes each
instead of 8; the spec keeps the original dtype.
"""

from __future__ import annotations

import base64
import json
import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ckptlab.errors import RecordError

# A record's JSON (the spec, the step, the ids...) sits in its safetensors header's metadata
# under this key (run/records.py), encoded compactly; the header itself keeps non-ASCII text.
# One encoder each, made once: json.dumps(..., separators=...) builds a new one per call.
META_KEY = "ckptlab"
JSON_COMPACT = json.JSONEncoder(separators=(",", ":")).encode
JSON_HEADER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode

# Narrowest-first; each must be a dtype safetensors stores.
_COMPACT = [
    (torch.uint8, 0, 2**8 - 1),
    (torch.int8, -(2**7), 2**7 - 1),
    (torch.uint16, 0, 2**16 - 1),
    (torch.int16, -(2**15), 2**15 - 1),
    (torch.int32, -(2**31), 2**31 - 1),
]
_INT_DTYPES = {torch.int16, torch.int32, torch.int64}  # (min/max are not implemented for uint32/64)
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
# numpy dtypes that torch can view without copying; everything else is stored as raw bytes.
_NP_VIA_TORCH = set("?bBhHiIlLqQefd")


def dtype_name(dtype: torch.dtype) -> str:
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


_NAMES: dict[torch.dtype, str] = {}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown torch dtype {name!r}") from None


def encode(
    obj: Any, *, prefix: str, compact_ints: bool = False, share: Callable[[str, torch.Tensor], bool] | None = None
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Encode `obj`; tensors come back contiguous, on the CPU, ready for safetensors: copies,
    except a contiguous CPU tensor for which `share(path, tensor)` says to keep the tensor
    itself (it is written before its owner changes it: see training/state.py)."""
    enc = _Encoder(compact_ints, share)
    spec = enc.node(obj, prefix)
    return spec, enc.tensors


def decode(spec: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `encode`. Raises ValueError on a malformed spec (callers name the file)."""
    try:
        return _decode(spec, tensors)
    except ValueError:
        raise
    # what a crafted spec can make the decoding of a node raise: wrong types, missing keys,
    # bad permutations or devices (torch's RuntimeError), nesting deeper than the stack
    except (KeyError, TypeError, IndexError, AttributeError, OverflowError, RuntimeError) as e:
        raise ValueError(f"malformed spec ({type(e).__name__}: {str(e)[:200]})") from None


class _Encoder:
    def __init__(self, compact_ints: bool, share: Callable[[str, torch.Tensor], bool] | None = None):
        self.compact_ints = compact_ints
        self.share = share
        self.tensors: dict[str, torch.Tensor] = {}

    def ref(self, path: str) -> str:
        name, n = path, 1
        while name in self.tensors:
            n += 1
            name = f"{path}#{n}"
        return name

    def node(self, obj: Any, path: str) -> Any:
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int) and type(obj) is int:
            return obj
        if type(obj) is float:
            return obj if math.isfinite(obj) else {"t": "float", "v": repr(obj)}
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if isinstance(obj, np.ndarray):
            return self.ndarray(obj, path)
        if isinstance(obj, np.generic):
            arr = np.asarray(obj)
            if arr.dtype.kind == "O":
                raise RecordError(f"{path}: numpy object scalars cannot be recorded")
            return {"t": "npscalar", "dtype": arr.dtype.str, "b64": base64.b64encode(arr.tobytes()).decode()}
        if isinstance(obj, dict):
            keys = list(obj.keys())
            return {
                "t": "dict",
                "k": [self.node(k, f"{path}/key") for k in keys],
                "v": [self.node(obj[k], f"{path}/{k}") for k in keys],
            }
        if isinstance(obj, torch.Size):
            return {"t": "size", "v": list(obj)}
        if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
            cls = type(obj)
            fields: tuple[str, ...] = cls._fields  # type: ignore[attr-defined]  # a namedtuple class (hasattr above)
            return {
                "t": "namedtuple",
                "name": cls.__qualname__,
                "module": cls.__module__,
                "fields": list(fields),
                "v": [self.node(v, f"{path}/{f}") for f, v in zip(fields, obj)],
            }
        if isinstance(obj, (list, tuple)):
            tag = "tuple" if isinstance(obj, tuple) else "list"
            return {"t": tag, "v": [self.node(v, f"{path}/{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, float):  # float subclasses
            return self.node(float(obj), path)
        if isinstance(obj, int):  # int subclasses (IntEnum...), bool handled above
            return int(obj)
        if isinstance(obj, bytes):
            return {"t": "bytes", "b64": base64.b64encode(obj).decode()}
        if isinstance(obj, torch.dtype):
            return {"t": "dtype", "v": dtype_name(obj)}
        if isinstance(obj, torch.device):
            return {"t": "device", "v": str(obj)}
        raise RecordError(f"{path}: cannot record an object of type {type(obj).__qualname__}")

    def tensor(self, t: torch.Tensor, path: str) -> dict:
        if t.layout != torch.strided:
            raise RecordError(f"{path}: {t.layout} tensors cannot be recorded; pass a dense tensor")
        if t.is_complex():
            raise RecordError(f"{path}: complex tensors cannot be recorded yet")
        node: dict[str, Any] = {"t": "tensor", "dtype": dtype_name(t.dtype), "shape": list(t.shape)}
        device = t.device.type
        if device != "cpu":
            node["device"] = device
        data = t
        if t.requires_grad:
            node["requires_grad"] = True
            data = t.detach()
        perm = _dense_permutation(data)
        if perm is None:
            node["strides_lost"] = True  # overlapping or gappy view: values exact, strides not
            data = data.contiguous()
        elif perm != list(range(data.dim())):
            node["perm"] = perm  # stored as t.permute(perm), contiguous; restored exactly
            data = data.permute(perm)
        if device != "cpu":
            data = data.to("cpu")
        if self.compact_ints and data.dtype in _INT_DTYPES and data.numel():
            data, stored = _compact(data)
            if stored is not None:
                node["stored"] = dtype_name(stored)
        ref = self.ref(path)
        if data.data_ptr() != t.data_ptr():  # already a copy (moved to the CPU, compacted)
            data = data.contiguous()
        elif not (self.share is not None and data.is_contiguous() and self.share(path, data)):
            # clone: the caller (training) goes on to mutate its tensors; we keep a snapshot.
            data = data.clone(memory_format=torch.contiguous_format)
        self.tensors[ref] = data
        node["ref"] = ref
        return node

    def ndarray(self, a: np.ndarray, path: str) -> dict:
        if a.dtype.kind == "O":
            raise RecordError(f"{path}: numpy object arrays cannot be recorded; use numbers or strings")
        node: dict[str, Any] = {"t": "ndarray", "dtype": a.dtype.str, "shape": list(a.shape)}
        if a.flags.f_contiguous and not a.flags.c_contiguous:
            node["order"] = "F"
            a = a.T
        a = np.ascontiguousarray(a)
        if a.dtype.char in _NP_VIA_TORCH and a.dtype.isnative:
            t = torch.from_numpy(a)
            if self.compact_ints and t.dtype in _INT_DTYPES and t.numel():
                t, stored = _compact(t)
                if stored is not None:
                    node["stored"] = dtype_name(stored)
        else:
            node["raw"] = True  # strings, datetimes, complex, non-native byte order: exact bytes
            t = torch.from_numpy(a.reshape(-1).view(np.uint8).copy())
        ref = self.ref(path)
        self.tensors[ref] = t.clone() if t.data_ptr() == a.ctypes.data else t
        node["ref"] = ref
        return node


def _dense_permutation(t: torch.Tensor) -> list[int] | None:
    """The dim order in which `t` is contiguous, or None if it is not dense and non-overlapping."""
    if t.is_contiguous():
        return list(range(t.dim()))
    strides, sizes = t.stride(), t.shape
    order = sorted(range(t.dim()), key=lambda d: (-strides[d], -sizes[d]))
    expected = 1
    for d in reversed(order):
        if t.size(d) != 1 and t.stride(d) != expected:
            return None
        expected *= t.size(d)
    return order


def _compact(t: torch.Tensor) -> tuple[torch.Tensor, torch.dtype | None]:
    lo, hi = (int(v) for v in torch.aminmax(t))
    for dtype, dmin, dmax in _COMPACT:
        if dmin <= lo and hi <= dmax:
            if dtype.itemsize >= t.dtype.itemsize:
                return t, None
            return t.to(dtype), dtype
    return t, None


def _decode(spec: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if spec is None or isinstance(spec, (bool, int, float, str)):
        return spec
    if not isinstance(spec, dict) or "t" not in spec:
        raise ValueError(f"malformed spec node {str(spec)[:60]!r}")
    tag = spec["t"]
    if tag == "dict":
        return {_decode(k, tensors): _decode(v, tensors) for k, v in zip(spec["k"], spec["v"], strict=True)}
    if tag == "list":
        return [_decode(v, tensors) for v in spec["v"]]
    if tag == "tuple":
        return tuple(_decode(v, tensors) for v in spec["v"])
    if tag == "namedtuple":
        cls = _namedtuple_class(spec["module"], spec["name"], spec["fields"])
        return cls(*[_decode(v, tensors) for v in spec["v"]])
    if tag == "tensor":
        return _decode_tensor(spec, tensors)
    if tag == "ndarray":
        return _decode_ndarray(spec, tensors)
    if tag == "npscalar":
        dtype = _np_dtype(spec["dtype"])
        return np.frombuffer(base64.b64decode(spec["b64"]), dtype=dtype)[0]
    if tag == "float":
        if spec["v"] not in ("nan", "inf", "-inf"):
            raise ValueError(f"bad float {spec['v']!r}")
        return float(spec["v"])
    if tag == "bytes":
        return base64.b64decode(spec["b64"])
    if tag == "dtype":
        return dtype_from_name(spec["v"])
    if tag == "device":
        return torch.device(spec["v"])
    if tag == "size":
        return torch.Size(int(v) for v in spec["v"])
    raise ValueError(f"unknown spec tag {tag!r}")


def _tensor_ref(spec: dict, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    try:
        return tensors[spec["ref"]]
    except KeyError:
        raise ValueError(f"spec refers to missing tensor {spec.get('ref')!r}") from None


def _decode_tensor(spec: dict, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    data = _tensor_ref(spec, tensors)
    dtype = dtype_from_name(spec["dtype"])
    if data.dtype != dtype:
        data = data.to(dtype)
    perm = spec.get("perm")
    if perm is not None:
        inverse = [0] * len(perm)
        for i, d in enumerate(perm):
            inverse[d] = i
        data = data.permute(inverse)
    if list(data.shape) != list(spec["shape"]):
        raise ValueError(f"tensor {spec['ref']!r} has shape {list(data.shape)}, spec says {spec['shape']}")
    if spec.get("requires_grad"):
        data = data.requires_grad_(True)
    return data


def _np_dtype(text: str) -> np.dtype:
    dtype = np.dtype(text)
    if dtype.kind == "O" or dtype.hasobject:
        raise ValueError(f"refusing numpy object dtype {text!r}")
    return dtype


def _decode_ndarray(spec: dict, tensors: dict[str, torch.Tensor]) -> np.ndarray:
    data = _tensor_ref(spec, tensors)
    dtype = _np_dtype(spec["dtype"])
    shape = [int(s) for s in spec["shape"]]
    fortran = spec.get("order") == "F"
    stored_shape = shape[::-1] if fortran else shape
    if spec.get("raw"):
        arr = data.numpy().view(dtype).reshape(stored_shape)
    else:
        arr = data.numpy().astype(dtype, copy=False).reshape(stored_shape)
    return arr.T if fortran else arr


def _namedtuple_class(module: str, qualname: str, fields: list[str]):
    """The user's class if its module is already imported (never import from a file), else a
    look-alike with the same name and fields."""
    from collections import namedtuple

    obj = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None) if obj is not None else None
    if isinstance(obj, type) and issubclass(obj, tuple) and list(getattr(obj, "_fields", ())) == list(fields):
        return obj
    name = qualname.rsplit(".", 1)[-1]
    return namedtuple(name if name.isidentifier() else "Record", fields)
