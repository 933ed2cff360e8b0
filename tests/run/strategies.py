"""Hypothesis strategies for batches: any nesting of the things a DataLoader yields.

Tensor and array values are drawn as raw bytes, so they cover every bit pattern: NaN payloads,
signed zeros, infinities, subnormals. Layouts cover contiguous, transposed (dense, permuted
strides), sliced (gappy) and empty tensors, and C- and Fortran-ordered arrays.
"""

from __future__ import annotations

import math
from collections import namedtuple

import numpy as np
import torch
from hypothesis import strategies as st

Pair = namedtuple("Pair", "first second")  # importable: it must come back as this very class

TORCH_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.bool,
    torch.float64,
    torch.int32,
    torch.uint8,
]
NUMPY_DTYPES = ["<f4", "<f8", "<f2", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "|b1", ">i4", ">f8"]

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3)


def _nbytes(shape, itemsize) -> int:
    return math.prod(shape) * itemsize


@st.composite
def int64_values(draw, n: int) -> list[int]:
    """Values from one range, so that some tensors compact (token ids in uint16) and some not."""
    lo, hi = draw(st.sampled_from([(0, 255), (-128, 127), (0, 50_000), (-(2**31), 2**31 - 1), (-(2**63), 2**63 - 1)]))
    return draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))


@st.composite
def tensors(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = draw(shapes)
    n = math.prod(shape)
    if dtype == torch.bool:
        t = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=torch.bool)
    elif dtype == torch.int64:
        t = torch.tensor(draw(int64_values(n)), dtype=torch.int64)
    else:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        raw = draw(st.binary(min_size=n * itemsize, max_size=n * itemsize))
        t = torch.frombuffer(bytearray(raw), dtype=dtype) if n else torch.empty(0, dtype=dtype)
    t = t.reshape(shape)
    layout = draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
    if layout == "transposed" and t.dim() >= 2:
        t = t.transpose(0, t.dim() - 1)
    elif layout == "sliced" and t.dim() >= 1:
        t = t[..., ::2]
    return t


@st.composite
def arrays(draw) -> np.ndarray:
    kind = draw(st.sampled_from(["numeric", "numeric", "unicode"]))
    shape = draw(shapes)
    n = math.prod(shape)
    if kind == "unicode":
        texts = draw(st.lists(st.text(max_size=5), min_size=n, max_size=n))
        a = np.array(texts, dtype="<U5").reshape(shape)
    else:
        dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
        if dtype.kind == "b":
            a = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool).reshape(shape)
        else:
            raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
            a = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    if a.ndim >= 2 and draw(st.booleans()):
        a = np.asfortranarray(a)
    return a


python_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
leaves = st.one_of(tensors(), arrays(), python_leaves)
keys = st.one_of(st.text(max_size=6), st.integers(-3, 3))

batches = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=3),
        st.builds(Pair, children, children),
    ),
    max_leaves=8,
)

sample_ids = st.one_of(
    st.none(),
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4),
    st.lists(st.text(max_size=6), max_size=4),
)
