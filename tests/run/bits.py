"""`assert_same`: two recorded objects are identical down to the bits (NaN payloads included)."""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

# Compare floats as integers of the same width: `==` says NaN != NaN and -0.0 == 0.0.
_AS_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.is_floating_point():
        return t.view(_AS_INT[t.element_size()])
    return t


def assert_same(got, want, path: str = "batch") -> None:
    assert type(got) is type(want) or _same_namedtuple(got, want), f"{path}: {type(got)} != {type(want)}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert got.requires_grad == want.requires_grad, f"{path}: requires_grad"
        if want.numel() and _dense(want):  # strides of an empty tensor or a size-1 dim mean nothing
            assert _strides(got) == _strides(want), f"{path}: strides {got.stride()} != {want.stride()}"
        assert torch.equal(tensor_bits(got), tensor_bits(want)), f"{path}: values differ"
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        if want.size > 1 and want.ndim > 1:
            assert got.flags.f_contiguous == want.flags.f_contiguous, f"{path}: memory order"
        assert got.tobytes() == want.tobytes(), f"{path}: values differ"
    elif isinstance(want, np.generic):
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), f"{path}: {got!r} != {want!r}"
    elif isinstance(want, float):
        assert struct.pack("<d", got) == struct.pack("<d", want) or (math.isnan(got) and math.isnan(want)), (
            f"{path}: {got} != {want}"
        )
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        if hasattr(want, "_fields"):
            assert got._fields == want._fields, f"{path}: fields {got._fields} != {want._fields}"
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{path}/{i}")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def _strides(t: torch.Tensor) -> list[int | None]:
    return [st if sz != 1 else None for sz, st in zip(t.shape, t.stride())]


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and without gaps (the layouts whose strides the codec keeps)."""
    sizes_strides = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1)
    expected = 1
    for st, sz in sizes_strides:
        if st != expected:
            return False
        expected *= sz
    return True


def _same_namedtuple(a, b) -> bool:
    """A namedtuple whose class is not importable comes back as a look-alike of the same name."""
    return (
        hasattr(a, "_fields")
        and hasattr(b, "_fields")
        and type(a).__name__ == type(b).__name__
        and a._fields == b._fields
    )
