"""Statistics of one tensor, streamed: `StatsAccumulator` takes it piece by piece and merges
with the accumulators of other pieces; `tensor_stats` does a whole tensor at once."""

from __future__ import annotations

import math

import numpy as np

from ckptlab import dtypes
from ckptlab.stats.histogram import QUANTILES
from ckptlab.stats.kernels import BLOCK, CHUNK, SMALL, Workspace, as_array, as_counted, bincount, sumsq, workspace
from ckptlab.stats.patterns import Sketch, codec_for, pattern_codes
from ckptlab.stats.results import TensorStats


class StatsAccumulator:
    """Statistics of one tensor, fed piece by piece (`add`) and combinable (`merge`)."""

    def __init__(self, dtype):
        self.dtype = dtypes.name_of(dtype)  # a name ("bfloat16"), or a torch or numpy dtype
        self.codec = codec_for(self.dtype)
        self.counts = np.zeros(self.codec.size, dtype=np.int64)  # elements per pattern
        self.numel = 0
        # Only when the patterns are not the values (float32 and wider, ints): exact sums.
        self.finite = 0
        self.s1 = self.s2 = 0.0
        self.lo, self.hi = math.inf, -math.inf
        self.nan = self.posinf = self.neginf = self.zeros = 0

    def __getstate__(self) -> dict:
        """As sent between processes (`ckptlab.io.stream`): without the codec's tables, and the
        pattern counts as (pattern, count) pairs when few patterns occur (a piece of a weight
        matrix holds a few thousand of the 65536): ~40 KB instead of 512 KB."""
        state = {k: v for k, v in self.__dict__.items() if k != "codec"}
        present = np.flatnonzero(self.counts)
        if present.size * 3 < self.counts.size:
            state["counts"] = (self.counts.size, present.astype(np.uint32), self.counts[present])
        return state

    def __setstate__(self, state: dict) -> None:
        if isinstance(state["counts"], tuple):
            size, present, counts = state["counts"]
            dense = np.zeros(size, dtype=np.int64)
            dense[present] = counts
            state["counts"] = dense
        self.__dict__.update(state)
        self.codec = codec_for(self.dtype)

    def add(self, x) -> None:
        """Count the 1-D piece x (any length): a numpy array in the dtype's storage type
        (`dtypes.storage`), or a torch tensor."""
        x = as_counted(self.dtype, as_array(x))
        ws = workspace()
        with np.errstate(all="ignore"):  # NaN and Inf are counted, not warned about
            self._add(x, ws)

    def _add(self, x: np.ndarray, ws: Workspace) -> None:
        for start in range(0, x.size, BLOCK):
            block = x[start : start + BLOCK]
            if not self.codec.exact:  # float32, float64 (and integers, as float32)
                for i in range(0, block.size, CHUNK):
                    chunk = block[i : i + CHUNK]
                    self.add_moments(chunk, chunk if chunk.dtype == np.float64 else ws.f64[0][: chunk.size])
            self.count_patterns(block, pattern_codes(block, self.codec))

    def count_patterns(self, block: np.ndarray, codes: np.ndarray) -> None:
        if codes.size < SMALL:  # a bias or a gain: a 65536-bin bincount would cost more than it
            present, counts = np.unique(codes, return_counts=True)
            self.counts[present] += counts
            suspect = not self.codec.exact and bool(((present == 0) | (present == 0x8000)).any())
        else:
            counts = bincount(codes, self.codec.size)
            self.counts += counts
            suspect = not self.codec.exact and int(counts[0]) + int(counts[0x8000]) > 0
        self.numel += block.size
        if suspect:  # the bfloat16 prefix of zeros (and of denormals): count exact zeros
            self.zeros += block.size - int(np.count_nonzero(block))

    def add_moments(self, chunk: np.ndarray, x64: np.ndarray, copied: bool = False) -> None:
        """chunk: float32/float64 values; x64: float64, where they are (copied=True) or are
        to be copied."""
        if x64 is not chunk and not copied:
            np.copyto(x64, chunk)
        s2 = sumsq(x64)
        if math.isfinite(s2):
            self.finite += chunk.size
            self.s1 += float(np.add.reduce(x64))
            self.s2 += s2
            self.lo, self.hi = min(self.lo, float(chunk.min())), max(self.hi, float(chunk.max()))
            return
        # The slow, exact pass: only for a chunk that holds a NaN or an Inf.
        self.nan += int(np.count_nonzero(np.isnan(x64)))
        self.posinf += int(np.count_nonzero(np.isposinf(x64)))
        self.neginf += int(np.count_nonzero(np.isneginf(x64)))
        fin = x64[np.isfinite(x64)]
        if fin.size:
            self.finite += fin.size
            self.s1 += float(np.add.reduce(fin))
            self.s2 += sumsq(fin)
            self.lo, self.hi = min(self.lo, float(fin.min())), max(self.hi, float(fin.max()))

    def merge(self, other: StatsAccumulator) -> StatsAccumulator:
        self.counts += other.counts
        self.numel += other.numel
        self.finite += other.finite
        self.s1 += other.s1
        self.s2 += other.s2
        self.lo, self.hi = min(self.lo, other.lo), max(self.hi, other.hi)
        self.nan += other.nan
        self.posinf += other.posinf
        self.neginf += other.neginf
        self.zeros += other.zeros
        return self

    def sketch(self) -> Sketch:
        return Sketch.of(self.codec, self.counts)

    def result(self) -> TensorStats:
        c = self.codec
        sk = self.sketch()
        if c.exact:  # everything follows from the pattern counts
            v, counts = sk.finite
            n = int(counts.sum())
            # (np.sum of products, not `@`: numpy's threaded BLAS is 100x slower on a busy machine)
            s1, s2 = float(np.sum(counts * v)), float(np.sum(counts * (v * v)))
            lo, hi = (float(v[0]), float(v[-1])) if n else (math.nan, math.nan)
            nan, posinf, neginf = (sk.where(m) for m in (np.isnan(c.values), c.values == np.inf, c.values == -np.inf))
            zeros = sk.where(c.values == 0)
        else:
            n, s1, s2 = self.finite, self.s1, self.s2
            lo, hi = (self.lo, self.hi) if n else (math.nan, math.nan)
            nan, posinf, neginf, zeros = self.nan, self.posinf, self.neginf, self.zeros
        mean = s1 / n if n else math.nan
        var = max(s2 / n - mean * mean, 0.0) if n else math.nan
        return TensorStats(
            numel=self.numel,
            nan=nan,
            posinf=posinf,
            neginf=neginf,
            zeros=zeros,
            mean=mean,
            std=math.sqrt(var) if n else math.nan,
            min=lo,
            max=hi,
            absmax=max(abs(lo), abs(hi)) if n else math.nan,
            l2=math.sqrt(s2) if n else math.nan,
            hist=sk.hist(),
            # a truncated prefix may lie below the exact minimum: keep quantiles inside the extremes
            quantiles=tuple(min(max(q, lo), hi) for q in sk.quantiles(QUANTILES)) if n else sk.quantiles(QUANTILES),
        )


def tensor_stats(t) -> TensorStats:
    """Statistics of any float/int tensor, torch or numpy (sums in float64: exact-enough moments)."""
    name, flat = dtypes.to_numpy(t)
    acc = StatsAccumulator(name)
    acc.add(np.ascontiguousarray(flat))
    return acc.result()
