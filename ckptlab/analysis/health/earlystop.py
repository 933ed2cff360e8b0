"""Early stopping over a validation series: report's overfitting detector and rollback's
`--metric` target both start from it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckptlab.run.reader import Run


@dataclass
class EarlyStop:
    metric: str
    mode: str
    patience: int
    best_step: int
    best_value: float
    stop_step: int | None  # the evaluation at which patience ran out; None: never
    last_step: int
    last_value: float
    global_best_step: int  # the best over all evaluations (may come after stop_step)
    global_best_value: float


def validation_series(run: Run, metric: str) -> list[tuple[int, float]]:
    """(step, value) of every finite validation point of `metric`, in step order."""
    out = []
    for p in run.validation():
        v = p.get("metrics", {}).get(metric)
        if isinstance(v, (int, float)) and math.isfinite(v):
            out.append((int(p["step"]), float(v)))
    return sorted(out)


def early_stopping(
    points: list[tuple[int, float]],
    metric: str = "val_loss",
    mode: str = "min",
    patience: int = 3,
    min_delta: float = 0.0,
) -> EarlyStop | None:
    """Keras-style early stopping over (step, value) points: the best value seen before
    `patience` evaluations in a row failed to improve on it by more than `min_delta`."""
    if not points:
        return None
    sign = 1.0 if mode == "min" else -1.0
    best, since, stop = points[0], 0, None
    for step, value in points[1:]:
        if sign * (best[1] - value) > min_delta:
            best, since = (step, value), 0
            continue
        since += 1
        if since >= patience:
            stop = step
            break
    glob = min(points, key=lambda sv: sign * sv[1])
    return EarlyStop(metric, mode, patience, best[0], best[1], stop, points[-1][0], points[-1][1], glob[0], glob[1])
