"""The fixed value grid every distribution is drawn on: signed log-scale histogram bins
(`HIST_EDGES`, 4 per decade from 1e-10 to 1e10, zero and |v| < 1e-10 in the middle bin) and the
quantiles reported (`QUANTILES`). Fixed, so that histograms of different checkpoints and dtypes
compare bin for bin."""

from __future__ import annotations

import numpy as np

DECADES = 10  # magnitudes 1e-10 .. 1e10
BINS_PER_DECADE = 4
HIST_EDGES = np.linspace(-2 * DECADES, 2 * DECADES, 4 * DECADES * BINS_PER_DECADE + 1)
QUANTILES = (0.001, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 0.999)


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
