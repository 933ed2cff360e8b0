"""What the framework integrations share.

Replay calls `training_step(model, optimizer, batch)`, but a framework's step also needs
objects that are neither: the LR scheduler it steps, the HF Trainer whose `training_step` it
runs. Each integration's `build(...)` helper registers them here, keyed by the optimizer it
returns (weakly: a replayed model that is dropped takes its entry with it).
"""

from __future__ import annotations

import numbers
import weakref
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from ckptlab import trackers
from ckptlab.errors import NonFiniteLoss, ReplayError

_REPLAY: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()


def register(optimizer, **objects) -> None:
    """Remember what `training_step` needs beside (model, optimizer, batch) for `optimizer`."""
    _REPLAY[optimizer] = objects


def registered(optimizer, name: str, *, required: bool, hint: str):
    """The object `build(...)` registered under `name` for `optimizer`."""
    obj = _REPLAY.get(optimizer, {}).get(name)
    if obj is None and required:
        raise ReplayError(f"replaying this step needs the {name} that build(...) provides", hint=hint)
    return obj


def scalar_metrics(metrics: Mapping[str, Any], keep: Callable[[str], bool]) -> dict[str, float]:
    """The finite-or-not scalar entries of `metrics` whose names `keep` accepts, as floats."""
    out = {}
    for name, value in metrics.items():
        if not keep(name):
            continue
        if hasattr(value, "numel") and value.numel() == 1:
            value = value.item()
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def end_step(rec, loss):
    """`rec.end_step(loss)`; on NonFiniteLoss close the Recorder first (the framework may not
    call its end hook after an exception), so everything recorded so far is on disk."""
    try:
        return rec.end_step(loss)
    except NonFiniteLoss:
        rec.close()
        raise


def with_trackers(config, loggers=()):
    """`config` with `trackers="auto"` resolved: the framework's W&B / MLflow loggers (and
    the runs already active in this process), logged into under `ckptlab/` names."""
    if config.trackers != "auto":
        return config
    return replace(config, trackers=tuple(trackers.resolve("auto", loggers)))
