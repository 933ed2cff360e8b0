"""Statistics of two tensors and of their difference B - A, streamed: `PairAccumulator` takes
aligned pieces of both (for `ckptlab diff`); `pair_stats` does two whole tensors at once."""

from __future__ import annotations

import math

import numpy as np

from ckptlab import dtypes
from ckptlab.stats.kernels import BLOCK, CHUNK, Workspace, as_array, as_counted, counted_dtype, sumsq, workspace
from ckptlab.stats.patterns import pattern_codes, wasserstein1
from ckptlab.stats.results import DeltaStats, PairStats
from ckptlab.stats.tensor import StatsAccumulator


class PairAccumulator:
    """Statistics of A, B and B - A, fed aligned pieces of both (`add`), combinable (`merge`)."""

    def __init__(self, dtype_a, dtype_b):
        self.a = StatsAccumulator(dtype_a)
        self.b = StatsAccumulator(dtype_b)
        # Two 16/8-bit tensors: their difference is exact in float32 (8/11-bit significands).
        self.narrow = self.a.codec.exact and self.b.codec.exact
        self.compared = self.unchanged = 0
        self.dd = 0.0
        self.max_abs = -1.0
        self.max_index = -1
        self.max_a = self.max_b = math.nan

    def add(self, a, b, offset: int = 0) -> None:
        """Count the aligned 1-D pieces a, b (same length; numpy arrays in their dtypes' storage
        types, or torch tensors), which start at flat index `offset`."""
        a, b = as_counted(self.a.dtype, as_array(a)), as_counted(self.b.dtype, as_array(b))
        if a.size != b.size:
            raise ValueError(f"pieces differ in length: {a.size} != {b.size}")
        ws = workspace()
        with np.errstate(all="ignore"):  # NaN and Inf are counted, not warned about
            self._add(a, b, offset, ws)

    def _add(self, a: np.ndarray, b: np.ndarray, offset: int, ws: Workspace) -> None:
        for start in range(0, a.size, BLOCK):
            xa, xb = a[start : start + BLOCK], b[start : start + BLOCK]
            for i in range(0, xa.size, CHUNK):
                self._add_chunk(xa[i : i + CHUNK], xb[i : i + CHUNK], offset + start + i, ws)
            self.a.count_patterns(xa, pattern_codes(xa, self.a.codec))
            self.b.count_patterns(xb, pattern_codes(xb, self.b.codec))

    def _add_chunk(self, x: np.ndarray, y: np.ndarray, offset: int, ws: Workspace) -> None:
        n = x.size
        ta, tb = counted_dtype(self.a.dtype), counted_dtype(self.b.dtype)
        if self.narrow:  # float32 values; the moments of A and B come from their pattern counts
            xa, xb = dtypes.widen(ta, x, ws.f32[0]), dtypes.widen(tb, y, ws.f32[1])
        else:  # float64: exact differences and sums for float32 and wider
            xa, xb = dtypes.widen(ta, x, ws.f64[0]), dtypes.widen(tb, y, ws.f64[1])
            for side, src, wide in ((self.a, x, xa), (self.b, y, xb)):
                if not side.codec.exact:
                    side.add_moments(src, wide, copied=True)
        same = int(np.count_nonzero(np.equal(xa, xb, out=ws.same[:n])))  # (NaN != NaN)
        d = np.subtract(xb, xa, out=xb)  # (n,) B - A, in place: xb is not needed any more
        # ||B - A||^2 accumulates in float64 (a float32 dot drifts ~1e-5 relative over a chunk)
        d64 = d
        if d.dtype != np.float64:
            d64 = ws.f64[0][:n]
            np.copyto(d64, d)
        dd = sumsq(d64)
        if not math.isfinite(dd):  # a NaN or Inf in A or B: compare only where both are finite
            self._add_nonfinite_chunk(x, y, offset, ta, tb)
            return
        np.abs(d, out=d)
        dmax = float(d.max())
        self.compared += n
        self.dd += dd
        self.unchanged += same
        if dmax > self.max_abs:
            i = int(np.argmax(d))
            self.max_abs, self.max_index = dmax, offset + i
            self.max_a, self.max_b = dtypes.value(ta, x, i), dtypes.value(tb, y, i)

    def _add_nonfinite_chunk(self, x: np.ndarray, y: np.ndarray, offset: int, ta: str, tb: str) -> None:
        x64 = dtypes.widen(ta, x, np.empty(x.size))
        y64 = dtypes.widen(tb, y, np.empty(y.size))
        both = np.isfinite(x64) & np.isfinite(y64)
        self.unchanged += int(np.count_nonzero(x64 == y64))
        d = np.where(both, y64 - x64, 0.0)
        self.compared += int(np.count_nonzero(both))
        self.dd += sumsq(d)
        d = np.where(both, np.abs(d), -1.0)
        i = int(np.argmax(d))
        if bool(both[i]) and float(d[i]) > self.max_abs:
            self.max_abs, self.max_index = float(d[i]), offset + i
            self.max_a, self.max_b = float(x64[i]), float(y64[i])

    def merge(self, other: PairAccumulator) -> PairAccumulator:
        self.a.merge(other.a)
        self.b.merge(other.b)
        self.compared += other.compared
        self.unchanged += other.unchanged
        self.dd += other.dd
        if (other.max_abs, -other.max_index) > (self.max_abs, -self.max_index):  # ties: lowest index
            self.max_abs, self.max_index, self.max_a, self.max_b = (
                other.max_abs,
                other.max_index,
                other.max_a,
                other.max_b,
            )
        return self

    def result(self) -> PairStats:
        found = self.max_index >= 0
        delta = DeltaStats(
            compared=self.compared,
            unchanged=self.unchanged,
            l2=math.sqrt(self.dd) if self.compared else math.nan,
            max_abs=self.max_abs if found else math.nan,
            max_index=self.max_index,
            max_a=self.max_a,
            max_b=self.max_b,
        )
        return PairStats(self.a.result(), self.b.result(), delta, wasserstein1(self.a.sketch(), self.b.sketch()))


def pair_stats(a, b) -> PairStats:
    """Statistics of A, B and B - A for two tensors (torch or numpy) with the same number of elements."""
    (name_a, flat_a), (name_b, flat_b) = dtypes.to_numpy(a), dtypes.to_numpy(b)
    acc = PairAccumulator(name_a, name_b)
    acc.add(np.ascontiguousarray(flat_a), np.ascontiguousarray(flat_b))
    return acc.result()
