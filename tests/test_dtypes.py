"""ckptlab.dtypes: numpy decodes every 16- and 8-bit float exactly as torch does, and tensors
cross between torch and numpy bit for bit."""

import numpy as np
import pytest
import torch

from ckptlab import dtypes

SMALL_FLOATS = ["float16", "bfloat16", *sorted(n for n in dtypes.BITS if n.startswith("float8"))]


@pytest.mark.parametrize("name", SMALL_FLOATS)
def test_pattern_values_are_torchs(name):
    dtype = getattr(torch, name)
    size = 1 << (8 * dtype.itemsize)
    bits = torch.arange(size, dtype=torch.int32).to(torch.uint8 if size == 256 else torch.uint16)
    expected = bits.view(dtype).to(torch.float64).numpy()
    got = dtypes.pattern_values(name)
    assert np.array_equal(got, expected, equal_nan=True)
    real = ~np.isnan(expected)
    assert np.array_equal(np.signbit(got[real]), np.signbit(expected[real]))  # -0 and -Inf too
    assert dtypes.largest(name) == float(torch.finfo(dtype).max)


@pytest.mark.parametrize("name", [*SMALL_FLOATS, "float32", "float64", "int64", "int8", "uint8", "bool"])
def test_tensors_cross_to_numpy_and_back_bit_for_bit(name):
    dtype = getattr(torch, name)
    t = (torch.randn(6, 5) * 4).to(dtype)
    got_name, flat = dtypes.to_numpy(t)
    assert got_name == name and flat.dtype == dtypes.storage(name) and flat.shape == (30,)
    back = dtypes.to_torch(name, flat).view(t.shape)
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8))
    if name in SMALL_FLOATS or name.startswith("float"):
        for out in (np.empty(30, np.float32), np.empty(30, np.float64)):
            assert np.array_equal(dtypes.widen(name, flat, out), t.reshape(-1).double().numpy().astype(out.dtype))
    assert dtypes.value(name, flat, 7) == float(t.reshape(-1)[7])
    assert dtypes.itemsize(name) == t.element_size() and dtypes.name_of(dtype) == name
