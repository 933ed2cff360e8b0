"""Value patterns: every element counted by its top 16 bits (8 for float8). The pattern is the
whole value for bfloat16/float16/float8 and a bfloat16 prefix (2^-8 relative resolution) for
float32; from the counts come the histogram, the quantiles and the Wasserstein-1 distance
(`Sketch`, `wasserstein1`), and for 16/8-bit dtypes every moment exactly."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ckptlab import dtypes
from ckptlab.stats.histogram import HIST_EDGES, hist_bins


@dataclass(frozen=True, eq=False)
class Codec:
    """How elements of one dtype map to patterns: the top 16 (or 8) bits of each value."""

    name: str  # the dtype whose bit patterns these are: "bfloat16", "float16", "float8_e4m3fn"...
    size: int  # number of patterns: 65536 or 256
    exact: bool  # the pattern is the whole value (so counts give exact moments)
    values: np.ndarray  # float64[size]: the value of each pattern
    finite: np.ndarray  # bool[size]
    bins: np.ndarray  # int64[size]: histogram bin of each pattern (0 where not finite)


@functools.cache
def _codec(name: str, exact: bool) -> Codec:
    values = dtypes.pattern_values(name)
    finite = np.isfinite(values)
    bins = np.where(finite, hist_bins(np.where(finite, values, 0.0)), 0)
    return Codec(name, len(values), exact, values, finite, bins)


_EXACT = {"float16"} | dtypes.BITS  # 16- and 8-bit floats


def codec_for(dtype) -> Codec:
    """16- and 8-bit floats are their own patterns; everything else is read as float32 and
    counted by its bfloat16 prefix."""
    name = dtypes.name_of(dtype)
    if name in _EXACT:
        return _codec(name, True)
    return _codec("bfloat16", False)


def supported(dtype) -> bool:
    """Real numbers: floats (not packed sub-byte ones), integers and bool. Not complex or
    quantized tensors."""
    return dtypes.name_of(dtype) in dtypes.STORAGE


def pattern_codes(x: np.ndarray, codec: Codec) -> np.ndarray:
    """The pattern code (0 .. codec.size-1) of each element of the 1-D piece x, as a view
    where it can be one: the raw bits of a 16/8-bit float, the high half of a float32 word."""
    if codec.exact:
        return x.view(np.uint8 if codec.size == 256 else np.uint16)
    if x.dtype != np.float32:  # float64 (integers are float32 by now): rounded to float32 first
        x = x.astype(np.float32)
    return x.view(np.uint16)[dtypes.HIGH_HALF :: 2]


@dataclass
class Sketch:
    """How many elements had each value pattern: a distribution at 16-bit resolution. For
    float32 a pattern stands for its bfloat16 prefix (the value truncated toward zero), which is
    exact for the values people set by hand (0, 1, small integers). Sparse: only the patterns
    present (a few thousand for a typical weight), so summaries cost little per tensor."""

    codec: Codec
    patterns: np.ndarray  # int64[k]: the patterns present
    counts: np.ndarray  # int64[k]: elements with each

    @classmethod
    def of(cls, codec: Codec, dense: np.ndarray) -> Sketch:
        patterns = np.flatnonzero(dense)
        return cls(codec, patterns, dense[patterns])

    def where(self, mask: np.ndarray) -> int:
        """How many elements have a pattern for which `mask` (over all patterns) is true."""
        return int(self.counts[mask[self.patterns]].sum())

    @functools.cached_property
    def finite(self) -> tuple[np.ndarray, np.ndarray]:
        """(values, counts) of the finite patterns present, by increasing value."""
        keep = self.codec.finite[self.patterns]
        values, counts = self.codec.values[self.patterns[keep]], self.counts[keep]
        order = np.argsort(values, kind="stable")
        return values[order], counts[order]

    def hist(self) -> np.ndarray:
        keep = self.codec.finite[self.patterns]
        bins = self.codec.bins[self.patterns[keep]]
        return np.bincount(bins, weights=self.counts[keep], minlength=len(HIST_EDGES) - 1).astype(np.int64)

    def quantiles(self, qs) -> tuple[float, ...]:
        values, counts = self.finite
        if not len(values):
            return tuple(math.nan for _ in qs)
        cum = np.cumsum(counts)
        n = int(cum[-1])
        # "lower" interpolation, as torch.quantile(..., interpolation="lower"): rank floor(q (n-1)).
        ranks = np.floor(np.asarray(qs, dtype=np.float64) * (n - 1))
        return tuple(float(v) for v in values[np.searchsorted(cum, ranks, side="right")])


def wasserstein1(a: Sketch, b: Sketch) -> float:
    """W1 = integral of |F_A(x) - F_B(x)| dx between the two value distributions (finite
    values; exact for 16/8-bit dtypes, at bfloat16 resolution for float32)."""
    va, ca = a.finite
    vb, cb = b.finite
    if not len(va) or not len(vb):
        return math.nan
    xs = np.concatenate((va, vb))  # their union (not np.union1d: it imports numpy.ma, ~40 ms of start-up)
    xs.sort()
    xs = xs[np.concatenate(([True], xs[1:] != xs[:-1]))]
    fa = np.concatenate([[0], np.cumsum(ca)])[np.searchsorted(va, xs, side="right")] / ca.sum()
    fb = np.concatenate([[0], np.cumsum(cb)])[np.searchsorted(vb, xs, side="right")] / cb.sum()
    return float(np.sum(np.abs(fa - fb)[:-1] * np.diff(xs)))
