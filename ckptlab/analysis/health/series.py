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
    out = np.full(len(values), np.nan)
    acc, weight = 0.0, 0.0
    for i, v in enumerate(values):
        if math.isfinite(v):
            acc = (1 - alpha) * acc + alpha * v
            weight = (1 - alpha) * weight + alpha
        if weight > 0:
            out[i] = acc / weight
    return out


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


def nanmedian_cols(a: np.ndarray) -> np.ndarray:
    """The median of each column's finite values (NaN for a column without any)."""
    out = np.full(a.shape[1] if a.ndim == 2 else 0, np.nan)
    for j in range(len(out)):
        col = a[:, j]
        col = col[np.isfinite(col)]
        if len(col):
            out[j] = float(np.median(col))
    return out
