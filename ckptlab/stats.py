"""Tensor statistics: the one place diff, report and trace compute "what does this tensor look like".

    s = tensor_stats(weight)        # TensorStats: counts, moments, extremes, norm, histogram
    s.nonfinite, s.absmax, s.l2, s.hist

Histograms use fixed signed log-scale bins (`HIST_EDGES`), so distributions from different
checkpoints (and different dtypes) are comparable bin for bin: a value v is placed at
symlog(v) = sign(v) * max(0, log10|v| + 10), i.e. 4 bins per decade from 1e-10 to 1e10, with
|v| < 1e-10 (zeros included) in the middle bins. Non-finite values are counted, not binned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

DECADES = 10  # magnitudes 1e-10 .. 1e10
BINS_PER_DECADE = 4
HIST_EDGES = np.linspace(-2 * DECADES, 2 * DECADES, 4 * DECADES * BINS_PER_DECADE + 1)


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

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf


def symlog(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.clamp(torch.log10(x.abs().clamp_min(1e-30)) + DECADES, min=0.0)


def tensor_stats(t: torch.Tensor) -> TensorStats:
    """Statistics of any float/int tensor (computed in float64 for exact-enough moments)."""
    x = t.detach().reshape(-1)
    if not x.is_floating_point():
        x = x.to(torch.float64)
    nan = int(torch.isnan(x).sum())
    posinf = int(torch.isposinf(x).sum())
    neginf = int(torch.isneginf(x).sum())
    finite = x[torch.isfinite(x)].to(torch.float64) if nan + posinf + neginf else x.to(torch.float64)
    n = finite.numel()
    if n:
        mean = float(finite.mean())
        std = float(finite.std(unbiased=False))
        lo, hi = float(finite.min()), float(finite.max())
        l2 = float(torch.linalg.vector_norm(finite))
        edge = float(HIST_EDGES[-1])  # values beyond 1e10 land in the outermost bins
        hist = torch.histc(symlog(finite).clamp(-edge, edge), bins=len(HIST_EDGES) - 1, min=float(HIST_EDGES[0]), max=float(HIST_EDGES[-1]))
        hist = hist.to(torch.int64).cpu().numpy()
    else:
        mean = std = lo = hi = l2 = math.nan
        hist = np.zeros(len(HIST_EDGES) - 1, dtype=np.int64)
    return TensorStats(
        numel=x.numel(),
        nan=nan,
        posinf=posinf,
        neginf=neginf,
        zeros=int((x == 0).sum()),
        mean=mean,
        std=std,
        min=lo,
        max=hi,
        absmax=max(abs(lo), abs(hi)) if n else math.nan,
        l2=l2,
        hist=hist,
    )
