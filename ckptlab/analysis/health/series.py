"""Robust helpers on recorded series: smoothing, rolling and block medians, NaN-safe medians."""

from __future__ import annotations

import math

import numpy as np


def smooth(values: np.ndarray, span: int | None = None) -> np.ndarray:
    """Bias-corrected exponential moving average (TensorBoard-style), span max(5, n/50).
    Non-finite values are skipped (the average carries over them), so one NaN does not blank
    the rest of the curve. A positive series is averaged in log space (a geometric mean), so
    a 10^6x spike shows as a blip rather than dragging the curve up for dozens of steps."""
    values = np.asarray(values, dtype=np.float64)
    finite = values[np.isfinite(values)]
    if len(finite) and finite.min() > 0:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.exp(smooth(np.log(values), span))
    span = span or max(5, len(values) // 50)
    alpha = 2.0 / (span + 1)
    out = []  # (a loop over Python floats: numpy scalars cost 4x as much a value, on 10^6 steps seconds)
    acc, weight, keep, nan = 0.0, 0.0, 1 - alpha, math.nan
    isfinite = math.isfinite
    for v in values.tolist():
        if isfinite(v):
            acc = keep * acc + alpha * v
            weight = keep * weight + alpha
        out.append(acc / weight if weight > 0 else nan)
    return np.array(out, dtype=np.float64)


def rolling_median(x: np.ndarray, w: int) -> np.ndarray:
    h = w // 2
    padded = np.pad(x, h, mode="edge")
    windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * h + 1)
    return np.median(windows, axis=1)


def block_medians(values: np.ndarray, block: int) -> np.ndarray:
    n = len(values) // block
    return np.array([np.nanmedian(values[i * block : (i + 1) * block]) for i in range(n)])


def nanmedian(a: np.ndarray) -> float:
    """np.nanmedian without its "All-NaN slice" RuntimeWarning: NaN for an empty or all-NaN slice."""
    a = np.asarray(a)
    a = a[~np.isnan(a)]
    return float(np.median(a)) if len(a) else math.nan
