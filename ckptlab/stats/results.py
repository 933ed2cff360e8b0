"""What the statistics say about a tensor (`TensorStats`) and a pair of them (`PairStats`): the
numbers the accumulators in `tensor` and `pair` hand back, and the ratios diff ranks by."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


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
