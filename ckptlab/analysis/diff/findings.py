"""What `ckptlab diff` finds: one `TensorFinding` per compared tensor (the statistics of A, B and
B - A, its flags and why), gathered in `DiffFindings` with the verdict; `finding_of` builds a
finding from the streamed statistics. Their fields are the JSON of `ckptlab diff --json`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ckptlab import dtypes
from ckptlab.io.base import TensorRef
from ckptlab.jsonable import NOT_IN_JSON
from ckptlab.stats.histogram import QUANTILES
from ckptlab.stats.results import PairStats, TensorStats

UNFLAGGED = 9  # the tier of a tensor no flag applies to (flags rank 0..5: ranking.TIERS)
QUANTILE_KEYS = tuple(f"p{q * 100:g}" for q in QUANTILES)  # p0.1, p1, ..., p99.9


@dataclass
class Verdict:
    """The headline: a tensor whose shape changed between A and B (`kind` "shape_changed": it
    is in `mismatched`, not compared), else the top flagged tensor (`kind` "flagged")."""

    parameter: str
    module: str
    reason: str
    kind: str = "flagged"


@dataclass
class Side:
    """One tensor's statistics in one checkpoint (finite elements for moments and extremes)."""

    numel: int
    nan: int
    posinf: int
    neginf: int
    zeros: int
    mean: float
    std: float
    min: float
    max: float
    absmax: float
    l2: float
    quantiles: dict[str, float]

    @classmethod
    def of(cls, s: TensorStats) -> Side:
        return cls(
            s.numel,
            s.nan,
            s.posinf,
            s.neginf,
            s.zeros,
            s.mean,
            s.std,
            s.min,
            s.max,
            s.absmax,
            s.l2,
            dict(zip(QUANTILE_KEYS, s.quantiles)),
        )

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf


@dataclass
class Delta:
    """How B differs from A (element pairs finite on both sides)."""

    l2: float  # ||B - A||
    rel_change: float  # ||B - A|| / ||A||: the update ratio
    norm_ratio: float  # ||B|| / ||A||
    absmax_ratio: float  # max|B| / max|A|
    cosine: float
    unchanged: float  # share of elements with B == A
    max_change: float  # the largest |B - A| ...
    max_index: list[int] | None  # ... where (an index into the tensor) ...
    max_a: float  # ... and what it was and became
    max_b: float
    w1: float  # Wasserstein-1 distance between the value distributions of A and B
    update_z: float | None = None  # robust z-score of log10(rel_change) among peers
    peers: str | None = None  # the role whose tensors were the peers, e.g. "blocks.*.attn.weight"


@dataclass
class TensorFinding:
    name: str
    module: str
    flags: list[str]
    reason: str | None
    shape: list[int]
    dtype_a: str
    dtype_b: str | None
    tied: list[str]  # other names for the same tensor (tied weights)
    a: Side
    b: Side | None
    delta: Delta | None
    # Working values for ranking and the terminal/plot renderers, not part of the JSON:
    hist_a: np.ndarray | None = field(default=None, repr=False, metadata=NOT_IN_JSON)  # HIST_EDGES counts
    hist_b: np.ndarray | None = field(default=None, repr=False, metadata=NOT_IN_JSON)
    tier: int = field(default=UNFLAGGED, metadata=NOT_IN_JSON)
    score: float = field(default=0.0, metadata=NOT_IN_JSON)
    order: int = field(default=0, metadata=NOT_IN_JSON)  # position in checkpoint A (tables list tensors in model order)


@dataclass
class Mismatch:
    """A tensor in both checkpoints whose shape differs: B is not the same model there."""

    name: str
    shape_a: list[int]
    shape_b: list[int]
    dtype_a: str
    dtype_b: str


@dataclass
class DiffFindings:
    a: str
    b: str | None
    verdict: Verdict | None  # before the ranking: a shape change (in `mismatched`) comes first
    ranked: list[TensorFinding]
    missing: list[str]  # in A, not in B
    unexpected: list[str]  # in B, not in A
    mismatched: list[Mismatch]  # in both, shapes differ: not compared
    skipped: list[dict]  # tensors that could not be read (unsupported dtype...)
    notes: list[str]
    summary: dict

    def finding(self, name: str) -> TensorFinding | None:
        for f in self.ranked:
            if f.name == name or name in f.tied:
                return f
        return None


def finding_of(
    name: str, tied: list[str], r: TensorStats | PairStats, ra: TensorRef, rb: TensorRef | None
) -> TensorFinding:
    """The finding of tensor `name` (stored as `ra` in A, `rb` in B; rb None: A alone) from its
    statistics `r`, not yet ranked."""
    if isinstance(r, PairStats):
        if rb is None:
            raise ValueError(f"{name}: statistics of a pair without B's tensor")
        a, b, delta, hist_a, hist_b = Side.of(r.a), Side.of(r.b), _delta(r, ra.shape), r.a.hist, r.b.hist
    else:
        a, b, delta, hist_a, hist_b = Side.of(r), None, None, r.hist, None
    return TensorFinding(
        name=name,
        module=name.rpartition(".")[0],
        flags=["dtype_changed"] if rb is not None and ra.dtype != rb.dtype else [],
        reason=None,
        shape=list(ra.shape),
        dtype_a=dtypes.name_of(ra.dtype),
        dtype_b=dtypes.name_of(rb.dtype) if rb is not None else None,
        tied=tied,
        a=a,
        b=b,
        delta=delta,
        hist_a=hist_a,
        hist_b=hist_b,
    )


def _delta(r: PairStats, shape: tuple[int, ...]) -> Delta:
    d = r.delta
    return Delta(
        l2=d.l2,
        rel_change=r.rel_change,
        norm_ratio=r.norm_ratio,
        absmax_ratio=r.absmax_ratio,
        cosine=r.cosine,
        unchanged=d.unchanged / r.a.numel if r.a.numel else math.nan,
        max_change=d.max_abs,
        max_index=[int(i) for i in np.unravel_index(d.max_index, shape)] if d.max_index >= 0 and shape else None,
        max_a=d.max_a,
        max_b=d.max_b,
        w1=r.w1,
    )
