"""Tensor statistics: the one place diff, report and trace compute "what does this tensor look like".

    s = tensor_stats(weight)        # TensorStats: counts, moments, extremes, norm, histogram
    s.nonfinite, s.absmax, s.l2, s.hist, s.quantiles
    p = pair_stats(a, b)            # PairStats: A, B and the change B - A
    p.rel_change, p.cosine, p.delta.unchanged, p.delta.max_index, p.w1

Big tensors stream: `StatsAccumulator` and `PairAccumulator` take a tensor piece by piece
(pieces of any size, in any order, each with its element offset) and `merge`, so a checkpoint
is never in memory whole and its pieces can be counted on several threads at once
(`ckptlab.io.stream` does that for `ckptlab diff`).

Only numpy, so that a diff of safetensors files never imports torch: pieces are numpy arrays
in their dtype's storage type (`ckptlab.dtypes`: bfloat16 and float8 as their raw bits), and a
torch tensor given instead is viewed as one without a copy. numpy releases the GIL inside each
op, so pieces counted on several threads run on several cores.

One pass, fused: each piece is walked in cache-sized chunks (`CHUNK` elements); per chunk a
handful of vectorised numpy ops produce every number (sum and sum of squares in float64, min,
max, and for pairs ||B-A||^2, max |B-A| and how many elements did not change). NaN and Inf are
counted in a slow exact pass only for a chunk whose float64 sum of squares is not finite.

Value patterns. Every element is also counted by its top 16 bits (8 for float8): the whole
value for bfloat16/float16/float8, a bfloat16 prefix (2^-8 relative resolution) for float32.
From these counts come, exactly for 16/8-bit dtypes, all the moments, NaN/Inf/zero counts and
extremes (so those dtypes need no float pass at all), and for every dtype the histogram, the
quantiles and the Wasserstein-1 distance between A and B.

Histograms use fixed signed log-scale bins (`HIST_EDGES`), so distributions from different
checkpoints (and different dtypes) are comparable bin for bin: a value v is placed at
symlog(v) = sign(v) * max(0, log10|v| + 10), i.e. 4 bins per decade from 1e-10 to 1e10, with
|v| < 1e-10 (zeros included) in the middle bin and magnitudes beyond 1e10 in the outermost.
A float32 value is binned by its bfloat16 prefix (truncated toward zero), so one within 0.4%
above a bin edge may count in the bin below. Non-finite values are counted, not binned.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
from dataclasses import dataclass

import numpy as np

from ckptlab import dtypes

DECADES = 10  # magnitudes 1e-10 .. 1e10
BINS_PER_DECADE = 4
HIST_EDGES = np.linspace(-2 * DECADES, 2 * DECADES, 4 * DECADES * BINS_PER_DECADE + 1)
QUANTILES = (0.001, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 0.999)

# 128K elements: two float64 copies (1 MiB each) stay in a 2 MiB L2 while ~12 ops run over
# them; 32K costs ~25% more in per-op overhead, 512K spills to L3 (scripts/bench_diff.py).
CHUNK = 1 << 17
# Patterns are counted per block: one bincount of 1M codes amortises zeroing its 65536 bins;
# blocks under SMALL codes are counted with np.unique instead.
BLOCK = 1 << 20
SMALL = 1 << 14


@dataclass
class TensorStats:
    numel: int
    nan: int
    posinf: int
    neginf: int
    zeros: int
    mean: float  # over finite elements
    std: float
    min: float
    max: float
    absmax: float
    l2: float  # over finite elements
    hist: np.ndarray  # int64[len(HIST_EDGES) - 1], finite elements
    quantiles: tuple[float, ...] = ()  # at QUANTILES, finite elements (float32: bfloat16 prefix)

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf


@dataclass
class DeltaStats:
    """The change B - A, over elements finite in both."""

    compared: int  # element pairs with A and B both finite
    unchanged: int  # elements with B == A (bit-for-bit equal values; NaN never counts)
    l2: float  # ||B - A||
    max_abs: float  # the largest |B - A| ...
    max_index: int  # ... its flat index (-1 when nothing was compared) ...
    max_a: float  # ... and the values there
    max_b: float


@dataclass
class PairStats:
    a: TensorStats
    b: TensorStats
    delta: DeltaStats
    w1: float  # Wasserstein-1 distance between the value distributions of A and B

    @property
    def rel_change(self) -> float:
        """||B - A|| / ||A||: the update ratio."""
        return _ratio(self.delta.l2, self.a.l2)

    @property
    def norm_ratio(self) -> float:
        return _ratio(self.b.l2, self.a.l2)

    @property
    def absmax_ratio(self) -> float:
        return _ratio(self.b.absmax, self.a.absmax)

    @property
    def cosine(self) -> float:
        """cos(A, B) from the three norms, written as 1 - (|d|^2 - (|A|-|B|)^2) / (2|A||B|) so
        that it keeps its precision when B is a tiny step away from A (A.B/(|A||B|) rounds to 1)."""
        na, nb, nd = self.a.l2, self.b.l2, self.delta.l2
        if not (na > 0 and nb > 0) or self.a.nonfinite or self.b.nonfinite:
            return math.nan
        gap = na - nb
        return max(-1.0, min(1.0, 1.0 - (nd - gap) * (nd + gap) / (2.0 * na * nb)))


def _ratio(x: float, y: float) -> float:
    if y > 0:
        return x / y
    return math.nan if x == 0 or math.isnan(x) else math.inf


def symlog(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return np.sign(x) * np.maximum(np.log10(np.maximum(np.abs(x), 1e-30)) + DECADES, 0.0)


_MID = 2 * DECADES * BINS_PER_DECADE  # 80: the bin of 0 and of |v| < 1e-10
# Magnitude edges 10**(k/4 - 10), k = 0..80: the HIST_EDGES mapped back through symlog.
_THRESHOLDS = 10.0 ** (np.arange(_MID + 1) / BINS_PER_DECADE - DECADES)


def hist_bins(values: np.ndarray) -> np.ndarray:
    """The HIST_EDGES bin of each finite value, by exact comparison with 10**(k/4 - 10).

    As symlog + histc places them: v >= 0 counts up from the middle bin 80 (an edge belongs to
    the bin above it), v < 0 counts down from it (an edge belongs to the bin nearer zero).
    """
    v = np.asarray(values, dtype=np.float64)
    up = _MID + np.searchsorted(_THRESHOLDS[1:_MID], v, side="right")
    down = np.maximum(_MID - np.searchsorted(_THRESHOLDS[:_MID], -v, side="left"), 0)
    return np.where(v >= 0, up, down)


# --- value patterns -------------------------------------------------------------------------


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


class _Workspace:
    """Per-thread scratch buffers, reused across pieces (no allocation in the hot loop)."""

    def __init__(self):
        self.f64 = [np.empty(CHUNK, dtype=np.float64) for _ in range(2)]
        self.f32 = [np.empty(CHUNK, dtype=np.float32) for _ in range(3)]
        self.same = np.empty(CHUNK, dtype=np.bool_)
        self.codes = np.empty(BLOCK, dtype=np.intp)


_local = threading.local()


def _workspace() -> _Workspace:
    ws = getattr(_local, "ws", None)
    if ws is None:
        ws = _local.ws = _Workspace()
    return ws


def _codes(x: np.ndarray, codec: Codec) -> np.ndarray:
    """The pattern code (0 .. codec.size-1) of each element of the 1-D piece x, as a view
    where it can be one: the raw bits of a 16/8-bit float, the high half of a float32 word."""
    if codec.exact:
        return x.view(np.uint8 if codec.size == 256 else np.uint16)
    if x.dtype != np.float32:  # float64 (integers are float32 by now): rounded to float32 first
        x = x.astype(np.float32)
    return x.view(np.uint16)[dtypes.HIGH_HALF :: 2]


def _bincount(codes: np.ndarray, size: int) -> np.ndarray:
    """Elements per pattern code (int64[size]). numpy's bincount holds the GIL while it counts,
    so the other workers queue behind it: the conversion to intp, half its work, is done here
    without the GIL, and where torch is imported anyway (.pt inputs, a training process)
    torch's bincount, which releases it, counts. Never imports torch for this."""
    wide = _workspace().codes[: codes.size]
    np.copyto(wide, codes)
    torch = _loaded_torch()
    if torch is not None:
        return torch.bincount(torch.from_numpy(wide), minlength=size).numpy()
    return np.bincount(wide, minlength=size)


def _loaded_torch():
    """torch when something else imported it (never imported here), else None."""
    if not _torch_counts:
        return None
    torch = sys.modules.get("torch")
    return torch if torch is not None and hasattr(torch, "bincount") else None


_torch_counts = True


def count_without_torch() -> None:
    """For a forked worker process (`ckptlab.io.stream`): count with numpy even where torch
    is loaded. torch's count is there to release the GIL, which a one-thread process does not
    need, and its thread pool is not to be used after a fork."""
    global _torch_counts
    _torch_counts = False


_ROW = 8192  # OpenBLAS runs a dot product of more than 10000 elements on all its threads:
# threads that spin against our own workers on a busy machine made `@` ~100x slower.
_vecdot = getattr(np, "vecdot", None) or (lambda x, y: np.einsum("ij,ij->i", x, y))  # numpy < 2


def _sumsq(x: np.ndarray) -> float:
    """sum(x * x) of a float64 1-D array, with BLAS kept to one thread (rows of _ROW)."""
    n = x.size - x.size % _ROW
    head = float(_vecdot(x[:n].reshape(-1, _ROW), x[:n].reshape(-1, _ROW)).sum()) if n else 0.0
    return head + float(np.dot(x[n:], x[n:]))


# --- one tensor -----------------------------------------------------------------------------


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
            state["counts"] = np.zeros(size, dtype=np.int64)
            state["counts"][present] = counts
        self.__dict__.update(state)
        self.codec = codec_for(self.dtype)

    def add(self, x) -> None:
        """Count the 1-D piece x (any length): a numpy array in the dtype's storage type
        (`dtypes.storage`), or a torch tensor."""
        x = _as_counted(self.dtype, _array(x))
        ws = _workspace()
        with np.errstate(all="ignore"):  # NaN and Inf are counted, not warned about
            self._add(x, ws)

    def _add(self, x: np.ndarray, ws: _Workspace) -> None:
        for start in range(0, x.size, BLOCK):
            block = x[start : start + BLOCK]
            if not self.codec.exact:  # float32, float64 (and integers, as float32)
                for i in range(0, block.size, CHUNK):
                    chunk = block[i : i + CHUNK]
                    self._add_moments(chunk, chunk if chunk.dtype == np.float64 else ws.f64[0][: chunk.size])
            self._count(block, _codes(block, self.codec))

    def _count(self, block: np.ndarray, codes: np.ndarray) -> None:
        if codes.size < SMALL:  # a bias or a gain: a 65536-bin bincount would cost more than it
            present, counts = np.unique(codes, return_counts=True)
            self.counts[present] += counts
            suspect = not self.codec.exact and bool(((present == 0) | (present == 0x8000)).any())
        else:
            counts = _bincount(codes, self.codec.size)
            self.counts += counts
            suspect = not self.codec.exact and int(counts[0]) + int(counts[0x8000]) > 0
        self.numel += block.size
        if suspect:  # the bfloat16 prefix of zeros (and of denormals): count exact zeros
            self.zeros += block.size - int(np.count_nonzero(block))

    def _add_moments(self, chunk: np.ndarray, x64: np.ndarray, copied: bool = False) -> None:
        """chunk: float32/float64 values; x64: float64, where they are (copied=True) or are
        to be copied."""
        if x64 is not chunk and not copied:
            np.copyto(x64, chunk)
        s2 = _sumsq(x64)
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
            self.s2 += _sumsq(fin)
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


def _array(x) -> np.ndarray:
    """A 1-D numpy piece, from a numpy array or a torch tensor (converted without a copy)."""
    return x.reshape(-1) if isinstance(x, np.ndarray) else dtypes.to_numpy(x)[1]


def _as_counted(name: str, x: np.ndarray) -> np.ndarray:
    """Integers and bools are counted as float32 (their patterns and sums are then exact
    enough; float64 keeps its own float64 sums)."""
    return x if name in dtypes.FLOATS else x.astype(np.float32)


def _counted(name: str) -> str:
    """The dtype of a piece after `_as_counted`."""
    return name if name in dtypes.FLOATS else "float32"


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


# --- a pair of tensors: A, B and B - A ----------------------------------------------------------


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
        a, b = _as_counted(self.a.dtype, _array(a)), _as_counted(self.b.dtype, _array(b))
        if a.size != b.size:
            raise ValueError(f"pieces differ in length: {a.size} != {b.size}")
        ws = _workspace()
        with np.errstate(all="ignore"):  # NaN and Inf are counted, not warned about
            self._add(a, b, offset, ws)

    def _add(self, a: np.ndarray, b: np.ndarray, offset: int, ws: _Workspace) -> None:
        for start in range(0, a.size, BLOCK):
            xa, xb = a[start : start + BLOCK], b[start : start + BLOCK]
            for i in range(0, xa.size, CHUNK):
                self._add_chunk(xa[i : i + CHUNK], xb[i : i + CHUNK], offset + start + i, ws)
            self.a._count(xa, _codes(xa, self.a.codec))
            self.b._count(xb, _codes(xb, self.b.codec))

    def _add_chunk(self, x: np.ndarray, y: np.ndarray, offset: int, ws: _Workspace) -> None:
        n = x.size
        ta, tb = _counted(self.a.dtype), _counted(self.b.dtype)
        if self.narrow:  # float32 values; the moments of A and B come from their pattern counts
            xa, xb = dtypes.widen(ta, x, ws.f32[0]), dtypes.widen(tb, y, ws.f32[1])
        else:  # float64: exact differences and sums for float32 and wider
            xa, xb = dtypes.widen(ta, x, ws.f64[0]), dtypes.widen(tb, y, ws.f64[1])
            for side, src, wide in ((self.a, x, xa), (self.b, y, xb)):
                if not side.codec.exact:
                    side._add_moments(src, wide, copied=True)
        same = int(np.count_nonzero(np.equal(xa, xb, out=ws.same[:n])))  # (NaN != NaN)
        d = np.subtract(xb, xa, out=xb)  # (n,) B - A, in place: xb is not needed any more
        # ||B - A||^2 accumulates in float64 (a float32 dot drifts ~1e-5 relative over a chunk)
        d64 = d
        if d.dtype != np.float64:
            d64 = ws.f64[0][:n]
            np.copyto(d64, d)
        dd = _sumsq(d64)
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
        self.dd += _sumsq(d)
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


# --- whole tensors ------------------------------------------------------------------------------


def tensor_stats(t) -> TensorStats:
    """Statistics of any float/int tensor, torch or numpy (sums in float64: exact-enough moments)."""
    name, flat = dtypes.to_numpy(t)
    acc = StatsAccumulator(name)
    acc.add(np.ascontiguousarray(flat))
    return acc.result()


def pair_stats(a, b) -> PairStats:
    """Statistics of A, B and B - A for two tensors (torch or numpy) with the same number of elements."""
    (name_a, flat_a), (name_b, flat_b) = dtypes.to_numpy(a), dtypes.to_numpy(b)
    acc = PairAccumulator(name_a, name_b)
    acc.add(np.ascontiguousarray(flat_a), np.ascontiguousarray(flat_b))
    return acc.result()
