"""Tensor dtypes by name, read with numpy alone (no torch needed).

    dtypes.storage("bfloat16")          # uint16: numpy has no bfloat16, so its raw bits
    dtypes.itemsize("float8_e4m3fn")    # 1
    dtypes.pattern_values("float16")    # float64[65536]: the value of every bit pattern
    name, flat = dtypes.to_numpy(t)     # a torch tensor (or numpy array) as ("bfloat16", uint16[n])

A dtype is named as torch names it without the "torch." prefix ("float32", "bfloat16",
"float8_e5m2"): the names findings carry and JSON shows. Readers hand tensors around as 1-D
numpy arrays in the dtype's *storage* type: the values themselves for the dtypes numpy has
(float64/32/16, integers, bool), the raw bits for the ones it lacks (bfloat16 as uint16,
float8 as uint8), decoded by `pattern_values` or `widen`. So a safetensors file is read and
measured without importing torch (~1-2 s of start-up), and a torch tensor converts at no cost.
"""

from __future__ import annotations

import functools
import sys

import numpy as np

# numpy storage type of each dtype ckptlab can measure.
STORAGE: dict[str, type] = {
    "float64": np.float64,
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,  # raw bits
    "float8_e4m3fn": np.uint8,  # raw bits, as every float8 below
    "float8_e4m3fnuz": np.uint8,
    "float8_e5m2": np.uint8,
    "float8_e5m2fnuz": np.uint8,
    "float8_e8m0fnu": np.uint8,
    "int64": np.int64,
    "int32": np.int32,
    "int16": np.int16,
    "int8": np.int8,
    "uint64": np.uint64,
    "uint32": np.uint32,
    "uint16": np.uint16,
    "uint8": np.uint8,
    "bool": np.bool_,
}
FLOATS = frozenset(n for n in STORAGE if n.startswith(("float", "bfloat")))
# Stored as raw bits: values come from `pattern_values` (every pattern is a value: exact).
BITS = frozenset({"bfloat16"} | {n for n in FLOATS if n.startswith("float8")})
# The safetensors format's dtype codes -> (name, rank in the format's Dtype enum, which orders
# a file's data: `safetensors.torch.save_file` lays tensors out by descending rank).
SAFETENSORS: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 0),
    "U8": ("uint8", 4),
    "I8": ("int8", 5),
    "F8_E5M2": ("float8_e5m2", 6),
    "F8_E4M3": ("float8_e4m3fn", 7),
    "F8_E8M0": ("float8_e8m0fnu", 8),
    "I16": ("int16", 9),
    "U16": ("uint16", 10),
    "F16": ("float16", 11),
    "BF16": ("bfloat16", 12),
    "I32": ("int32", 13),
    "U32": ("uint32", 14),
    "F32": ("float32", 15),
    "F64": ("float64", 17),
    "I64": ("int64", 18),
    "U64": ("uint64", 19),
}
SAFETENSORS_NAMES = {code: name for code, (name, _) in SAFETENSORS.items()}
# dtypes of the safetensors format that ckptlab cannot hold: a file with one is refused, not
# read without it (a diff would call that tensor "only in B", or "identical").
SAFETENSORS_UNREADABLE = frozenset({"C64", "F4", "F6_E2M3", "F6_E3M2"})
# In a float32 word, the index of the uint16 that holds its top 16 bits (the bfloat16 prefix).
HIGH_HALF = 1 if sys.byteorder == "little" else 0


def name_of(dtype) -> str:
    """The name of a torch dtype, a numpy dtype, or a name already."""
    if isinstance(dtype, str):
        return dtype.removeprefix("torch.")
    if isinstance(dtype, (np.dtype, type)):
        return "bool" if np.dtype(dtype) == np.bool_ else np.dtype(dtype).name
    return str(dtype).removeprefix("torch.")  # a torch.dtype (torch is not imported here)


def storage(name: str) -> np.dtype:
    return np.dtype(STORAGE[name])


def itemsize(name: str) -> int:
    return storage(name).itemsize


def is_float(name: str) -> bool:
    """A floating-point (or complex) dtype, by name."""
    return name in FLOATS or name.startswith("complex")


# float8 formats: (exponent bits, mantissa bits, bias, how NaN/Inf are encoded).
_FLOAT8 = {
    "float8_e4m3fn": (4, 3, 7, "fn"),  # no Inf; NaN = S.1111.111
    "float8_e4m3fnuz": (4, 3, 8, "fnuz"),  # no Inf, no -0; NaN = 0x80
    "float8_e5m2": (5, 2, 15, "ieee"),  # IEEE: exponent 11111 is Inf (mantissa 0) or NaN
    "float8_e5m2fnuz": (5, 2, 16, "fnuz"),
    "float8_e8m0fnu": (8, 0, 127, "e8m0"),  # unsigned powers of two 2^(e-127); 0xFF = NaN
}


@functools.cache
def pattern_values(name: str) -> np.ndarray:
    """float64[2^bits]: the value of every bit pattern of a 16- or 8-bit float."""
    if name == "float16":
        return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float64)
    if name == "bfloat16":
        with np.errstate(invalid="ignore"):  # (signalling NaN patterns)
            return (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)
    exp_bits, man_bits, bias, kind = _FLOAT8[name]
    bits = np.arange(256, dtype=np.int64)
    if kind == "e8m0":
        values = np.ldexp(1.0, bits - bias)
        values[0xFF] = np.nan
        return values
    e = (bits >> man_bits) & ((1 << exp_bits) - 1)
    m = (bits & ((1 << man_bits) - 1)).astype(np.float64) / (1 << man_bits)
    magnitude = np.where(e == 0, np.ldexp(m, 1 - bias), np.ldexp(1.0 + m, e - bias))
    values = np.where(bits & 0x80, -magnitude, magnitude)
    top = (1 << exp_bits) - 1
    if kind == "ieee":
        values[(e == top) & (m == 0)] = np.copysign(np.inf, values[(e == top) & (m == 0)])
        values[(e == top) & (m > 0)] = np.nan
    elif kind == "fn":
        values[(bits & 0x7F) == 0x7F] = np.nan
    else:  # fnuz: the pattern of -0 is the only NaN
        values[0x80] = np.nan
    return values


@functools.cache
def _values32(name: str) -> np.ndarray:
    return pattern_values(name).astype(np.float32)


def largest(name: str) -> float | None:
    """The largest finite value of a 16- or 8-bit float (None for wider floats and integers)."""
    if name != "float16" and name not in BITS:
        return None
    v = pattern_values(name)
    return float(v[np.isfinite(v)].max())


def widen(name: str, raw: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The values of `raw` (a 1-D array in `name`'s storage type) written into `out` (float32
    or float64, at least as long); returns out[:len(raw)]."""
    out = out[: raw.size]
    if name == "bfloat16" and out.dtype == np.float32:  # the bits are the top half of a float32
        np.left_shift(raw, 16, out=out.view(np.uint32), dtype=np.uint32)
    elif name in BITS:
        np.take(_values32(name) if out.dtype == np.float32 else pattern_values(name), raw, out=out)
    else:
        np.copyto(out, raw, casting="unsafe")
    return out


def value(name: str, raw: np.ndarray, i: int) -> float:
    """The value of element i of a raw 1-D array."""
    return float(pattern_values(name)[int(raw[i])]) if name in BITS else float(raw[i])


def to_numpy(t) -> tuple[str, np.ndarray]:
    """(dtype name, flat array in its storage type) of a numpy array or a CPU/GPU torch tensor,
    without copying a contiguous CPU tensor."""
    if isinstance(t, np.ndarray):
        return name_of(t.dtype), t.reshape(-1)
    name = name_of(t.dtype)
    flat = t.detach().cpu().reshape(-1)
    if name in STORAGE and name not in BITS:
        return name, flat.numpy()
    import torch  # (a torch tensor was given: torch is loaded already)

    # bfloat16 and float8 have no numpy type: their bytes, seen as the storage type
    return name, flat.contiguous().view(torch.uint8).numpy().view(STORAGE.get(name, np.uint8))


def to_torch(name: str, raw: np.ndarray):
    """A torch tensor of dtype `name` sharing the memory of `raw` (its storage-type array)."""
    import torch

    return torch.from_numpy(raw.view(np.uint8)).view(getattr(torch, name))
