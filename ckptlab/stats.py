"""Tensor statistics: the one place diff, report and trace compute "what does this tensor look like".

    s = tensor_stats(weight)        # TensorStats: counts, moments, extremes, norm, histogram
    s.nonfinite, s.absmax, s.l2, s.hist, s.quantiles
    p = pair_stats(a, b)            # PairStats: A, B and the change B - A
    p.rel_change, p.cosine, p.delta.unchanged, p.delta.max_index, p.w1

Big tensors stream: `StatsAccumulator` and `PairAccumulator` take a tensor piece by piece
(pieces of any size, in any order, each with its element offset) and `merge`, so a checkpoint
is never in memory whole and its pieces can be counted on several threads at once
(`ckptlab.io.stream` does that for `ckptlab diff`).

One pass, fused: each piece is walked in cache-sized chunks (`CHUNK` elements); per chunk a
handful of vectorised torch ops produce every number (sum and sum of squares in float64, min,
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
import threading
from dataclasses import dataclass

import numpy as np
import torch

DECADES = 10  # magnitudes 1e-10 .. 1e10
BINS_PER_DECADE = 4
HIST_EDGES = np.linspace(-2 * DECADES, 2 * DECADES, 4 * DECADES * BINS_PER_DECADE + 1)
QUANTILES = (0.001, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 0.999)

# 128K elements: two float64 copies (1 MiB each) stay in a 2 MiB L2 while ~12 ops run over
# them; 32K costs ~25% more in per-op overhead, 512K spills to L3 (scripts/bench_diff.py).
CHUNK = 1 << 17
# Patterns are counted per block: one bincount of 1M codes amortises zeroing its 65536 bins;
# blocks under SMALL codes are counted with torch.unique instead.
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


def symlog(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.clamp(torch.log10(x.abs().clamp_min(1e-30)) + DECADES, min=0.0)


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
    dtype = getattr(torch, name)
    size = 1 << (8 * torch.empty((), dtype=dtype).element_size())
    bits = torch.arange(size, dtype=torch.int32).to(torch.uint8 if size == 256 else torch.uint16)
    values = bits.view(dtype).to(torch.float64).numpy()
    finite = np.isfinite(values)
    bins = np.where(finite, hist_bins(np.where(finite, values, 0.0)), 0)
    return Codec(name, size, exact, values, finite, bins)


_EXACT = {torch.bfloat16, torch.float16} | {
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, n)
}


def codec_for(dtype: torch.dtype) -> Codec:
    """16- and 8-bit floats are their own patterns; everything else is read as float32 and
    counted by its bfloat16 prefix."""
    if dtype in _EXACT:
        return _codec(str(dtype).removeprefix("torch."), True)
    return _codec("bfloat16", False)


_INTEGERS = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64} | {
    getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)
}


def supported(dtype: torch.dtype) -> bool:
    """Real numbers: floats (not packed sub-byte ones), integers and bool. Not complex or
    quantized tensors."""
    if dtype.is_floating_point:
        return "float4" not in str(dtype) and "_x2" not in str(dtype)
    return dtype in _INTEGERS


class _Workspace:
    """Per-thread scratch buffers, reused across pieces (no allocation in the hot loop)."""

    def __init__(self):
        self.f64 = [torch.empty(CHUNK, dtype=torch.float64) for _ in range(2)]
        self.f32 = [torch.empty(CHUNK, dtype=torch.float32) for _ in range(2)]
        self.codes = [torch.empty(BLOCK, dtype=torch.int32) for _ in range(2)]


_local = threading.local()


def _workspace() -> _Workspace:
    ws = getattr(_local, "ws", None)
    if ws is None:
        ws = _local.ws = _Workspace()
    return ws


def _write_codes(x: torch.Tensor, codec: Codec, out: torch.Tensor) -> None:
    """Pattern codes (0 .. codec.size-1) of the 1-D piece x into out[:len(x)]."""
    if codec.exact:
        out.copy_(x.view(torch.uint8 if codec.size == 256 else torch.uint16))
    else:  # float32: the high half of each word is its bfloat16 prefix
        torch.bitwise_right_shift(x.view(torch.int32), 16, out=out).bitwise_and_(0xFFFF)


# --- one tensor -----------------------------------------------------------------------------


class StatsAccumulator:
    """Statistics of one tensor, fed piece by piece (`add`) and combinable (`merge`)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.codec = codec_for(dtype)
        self.counts = torch.zeros(self.codec.size, dtype=torch.int64)  # elements per pattern
        self.numel = 0
        # Only when the patterns are not the values (float32 and wider, ints): exact sums.
        self.finite = 0
        self.s1 = self.s2 = 0.0
        self.lo, self.hi = math.inf, -math.inf
        self.nan = self.posinf = self.neginf = self.zeros = 0

    def add(self, x: torch.Tensor) -> None:
        """Count the 1-D contiguous piece x (any length)."""
        ws = _workspace()
        for start in range(0, x.numel(), BLOCK):
            block = _as_counted(x[start : start + BLOCK])
            codes = ws.codes[0][: block.numel()]
            if self.codec.exact:
                _write_codes(block, self.codec, codes)
            else:
                for i in range(0, block.numel(), CHUNK):
                    chunk = block[i : i + CHUNK]
                    x64 = ws.f64[0][: chunk.numel()].copy_(chunk)
                    _write_codes(
                        chunk if chunk.dtype == torch.float32 else chunk.float(), self.codec, codes[i : i + CHUNK]
                    )
                    self._add_moments(chunk, x64, _float_scalars(x64))
            self._count(block, codes)

    def _count(self, block: torch.Tensor, codes: torch.Tensor) -> None:
        if codes.numel() < SMALL:  # a bias or a gain: a 65536-bin bincount would cost more than it
            present, counts = torch.unique(codes, return_counts=True)
            self.counts.index_add_(0, present.long(), counts)
            suspect = not self.codec.exact and bool(((present == 0) | (present == 0x8000)).any())
        else:
            counts = torch.bincount(codes, minlength=self.codec.size)
            self.counts += counts
            suspect = not self.codec.exact and int(counts[0]) + int(counts[0x8000]) > 0
        self.numel += block.numel()
        if suspect:  # the bfloat16 prefix of zeros (and of denormals): count exact zeros
            self.zeros += block.numel() - int(torch.count_nonzero(block))

    def _add_moments(
        self,
        chunk: torch.Tensor,
        x64: torch.Tensor | None,
        scalars: list[torch.Tensor],
        values: list[float] | None = None,
    ) -> None:
        s1, s2, lo, hi = values if values is not None else torch.stack(scalars).tolist()
        if math.isfinite(s2):
            self.finite += chunk.numel()
            self.s1 += s1
            self.s2 += s2
            self.lo, self.hi = min(self.lo, lo), max(self.hi, hi)
            return
        # The slow, exact pass: only for a chunk that holds a NaN or an Inf.
        x64 = chunk.double() if x64 is None else x64
        self.nan += int(torch.isnan(x64).sum())
        self.posinf += int(torch.isposinf(x64).sum())
        self.neginf += int(torch.isneginf(x64).sum())
        fin = x64[torch.isfinite(x64)]
        if fin.numel():
            self.finite += fin.numel()
            self.s1 += float(fin.sum())
            self.s2 += float(torch.dot(fin, fin))
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


def _as_counted(x: torch.Tensor) -> torch.Tensor:
    """Integers and bools are counted as float32 (their patterns and sums are then exact
    enough; float64 keeps its own float64 sums)."""
    if x.dtype.is_floating_point:
        return x
    return x.to(torch.float32)


def _float_scalars(x64: torch.Tensor) -> list[torch.Tensor]:
    """Sum, sum of squares, min, max: float64 0-d tensors, read back with one .tolist().
    (Extremes of the float64 copy, not of the float32 original: converting two 0-d results
    costs ~20 us a chunk, more than the wider aminmax.)"""
    return [x64.sum(), torch.dot(x64, x64), *torch.aminmax(x64)]


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
    def of(cls, codec: Codec, dense: torch.Tensor) -> Sketch:
        patterns = torch.nonzero(dense).reshape(-1)
        return cls(codec, patterns.numpy(), dense[patterns].numpy())

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
    xs = np.union1d(va, vb)
    fa = np.concatenate([[0], np.cumsum(ca)])[np.searchsorted(va, xs, side="right")] / ca.sum()
    fb = np.concatenate([[0], np.cumsum(cb)])[np.searchsorted(vb, xs, side="right")] / cb.sum()
    return float(np.sum(np.abs(fa - fb)[:-1] * np.diff(xs)))


# --- a pair of tensors: A, B and B - A ----------------------------------------------------------


class PairAccumulator:
    """Statistics of A, B and B - A, fed aligned pieces of both (`add`), combinable (`merge`)."""

    def __init__(self, dtype_a: torch.dtype, dtype_b: torch.dtype):
        self.a = StatsAccumulator(dtype_a)
        self.b = StatsAccumulator(dtype_b)
        # Two 16/8-bit tensors: their difference is exact in float32 (8/11-bit significands).
        self.narrow = self.a.codec.exact and self.b.codec.exact
        self.compared = self.unchanged = 0
        self.dd = 0.0
        self.max_abs = -1.0
        self.max_index = -1
        self.max_a = self.max_b = math.nan

    def add(self, a: torch.Tensor, b: torch.Tensor, offset: int = 0) -> None:
        """Count the aligned 1-D pieces a, b (same length), which start at flat index `offset`."""
        if a.numel() != b.numel():
            raise ValueError(f"pieces differ in length: {a.numel()} != {b.numel()}")
        ws = _workspace()
        for start in range(0, a.numel(), BLOCK):
            xa, xb = _as_counted(a[start : start + BLOCK]), _as_counted(b[start : start + BLOCK])
            codes_a, codes_b = ws.codes[0][: xa.numel()], ws.codes[1][: xb.numel()]
            if self.a.codec.exact:
                _write_codes(xa, self.a.codec, codes_a)
            if self.b.codec.exact:
                _write_codes(xb, self.b.codec, codes_b)
            for i in range(0, xa.numel(), CHUNK):
                self._add_chunk(
                    xa[i : i + CHUNK],
                    xb[i : i + CHUNK],
                    offset + start + i,
                    codes_a[i : i + CHUNK],
                    codes_b[i : i + CHUNK],
                    ws,
                )
            self.a._count(xa, codes_a)
            self.b._count(xb, codes_b)

    def _add_chunk(self, x, y, offset, codes_x, codes_y, ws) -> None:
        n = x.numel()
        scalars: list[torch.Tensor] = []
        if self.narrow:
            xa, xb = ws.f32[0][:n].copy_(x), ws.f32[1][:n].copy_(y)
        else:  # float64: exact differences and sums for float32 and wider
            xa, xb = ws.f64[0][:n].copy_(x), ws.f64[1][:n].copy_(y)
            for side, src, wide, codes in ((self.a, x, xa, codes_x), (self.b, y, xb, codes_y)):
                if not side.codec.exact:
                    _write_codes(src if src.dtype == torch.float32 else src.float(), side.codec, codes)
                    scalars += _float_scalars(wide)
        d = xb.sub_(xa)  # (n,) B - A, in place: xb is not needed any more
        # ||B - A||^2 accumulates in float64 (a float32 dot drifts ~1e-5 relative over a chunk)
        d64 = d if d.dtype == torch.float64 else ws.f64[0][:n].copy_(d)
        scalars.append(torch.dot(d64, d64))
        d.abs_()
        values = torch.stack(scalars).tolist() + torch.stack(torch.aminmax(d)).tolist()  # (one read-back per dtype)
        k = 0
        for side, src, wide in ((self.a, x, xa), (self.b, y, None)):  # (xb now holds |B - A|)
            if not side.codec.exact:
                side._add_moments(src, wide, [], values[k : k + 4])
                k += 4
        dd, dmin, dmax = values[k:]
        if not math.isfinite(dd):  # a NaN or Inf in A or B: compare only where both are finite
            self._add_nonfinite_chunk(x, y, offset)
            return
        self.compared += n
        self.dd += dd
        if dmax > self.max_abs:
            i = int(torch.argmax(d))
            self.max_abs, self.max_index = dmax, offset + i
            self.max_a, self.max_b = float(x[i]), float(y[i])
        if dmin == 0:  # d = |B - A| >= 0: sign() is 1 where changed (2x faster than count_nonzero)
            self.unchanged += n - int(d.sign_().sum())

    def _add_nonfinite_chunk(self, x, y, offset) -> None:
        x64, y64 = x.double(), y.double()
        both = torch.isfinite(x64) & torch.isfinite(y64)
        self.unchanged += int((x64 == y64).sum())
        d = torch.where(both, y64 - x64, 0.0)
        self.compared += int(both.sum())
        self.dd += float(torch.dot(d, d))
        d = torch.where(both, d.abs(), -1.0)
        i = int(torch.argmax(d))
        if bool(both[i]) and float(d[i]) > self.max_abs:
            self.max_abs, self.max_index = float(d[i]), offset + i
            self.max_a, self.max_b = float(x[i]), float(y[i])

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


def tensor_stats(t: torch.Tensor) -> TensorStats:
    """Statistics of any float/int tensor (sums in float64: exact-enough moments)."""
    acc = StatsAccumulator(t.dtype)
    acc.add(t.detach().cpu().reshape(-1).contiguous())
    return acc.result()


def pair_stats(a: torch.Tensor, b: torch.Tensor) -> PairStats:
    """Statistics of A, B and B - A for two tensors with the same number of elements."""
    acc = PairAccumulator(a.dtype, b.dtype)
    acc.add(a.detach().cpu().reshape(-1).contiguous(), b.detach().cpu().reshape(-1).contiguous())
    return acc.result()
