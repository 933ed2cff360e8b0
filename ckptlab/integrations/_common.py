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
from typing import Any, TypeVar

from ckptlab import trackers
from ckptlab.analysis.batches import MICRO_BATCHES, MICRO_ROWS, batch_rows
from ckptlab.errors import NonFiniteLoss, ReplayError
from ckptlab.training.state import capture_rng, restore_rng, rng_equal

_REPLAY: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()
MICRO_RNG = "rng"  # a micro-batch's own RNG states (see MicroBatches)


def register(optimizer, **objects) -> None:
    """Remember what `training_step` needs beside (model, optimizer, batch) for `optimizer`."""
    _REPLAY[optimizer] = objects


def remember(optimizer, name: str, obj) -> None:
    """Add `obj` under `name` to what is registered for `optimizer` (made during replay)."""
    _REPLAY.setdefault(optimizer, {})[name] = obj


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


class MicroBatches:
    """One optimizer step's micro-batches under gradient accumulation, gathered as the framework
    runs them: recorded together as the step's batch (`{"micro_batches": [...], "micro_rows":
    [...], ...}`, analysis/batches.py) with their sample ids in order; the step's loss is the
    sum of what the framework returned for each (already divided for the accumulation), added
    in order, as the replayed step function adds them.

    The step's RNG states are recorded when it begins. Code that runs between two micro-batches
    (a validation run, which draws a DataLoader seed; a random transform loading the next
    batch) can move them: then the micro-batch records the states it starts in under "rng",
    and the replayed step function restores them before it (`restore_micro_rng`)."""

    def __init__(self) -> None:
        self.parts: list = []
        self.rows: list[int] = []
        self.ids: list | None = []
        self.loss: Any = None  # the losses so far, summed (add_losses); None before the first
        self.recorded = False
        self._rng_after: dict | None = None  # the RNG states as the previous micro-batch left them

    def add(self, part: dict, ids) -> None:
        """A micro-batch about to run (its RNG states kept if they moved since the last one)."""
        if self._rng_after is not None:
            now = capture_rng()
            if not rng_equal(now, self._rng_after):
                part[MICRO_RNG] = now
        if ids is not None and self.ids is not None:
            ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
            self.ids.extend(ids)
        else:
            self.ids = None
        self.parts.append(part)
        self.rows.append(len(ids) if ids is not None else batch_rows(part, None) or 0)

    def add_loss(self, loss) -> None:
        """The micro-batch ran and returned `loss` (None: no loss)."""
        if loss is not None:
            self.loss = add_losses(self.loss, loss.detach())
        self._rng_after = capture_rng()

    def record(self, rec, extra: dict, *, alone: bool = False) -> None:
        """`rec.record_batch` with the micro-batches so far and `extra` (how the step ends).
        `alone`: the step is one batch, without accumulation: recorded as `{"batch": ...,
        **extra}`, the layout of a framework's step without micro-batches."""
        if alone:
            rec.record_batch({**self.parts[0], **extra}, self.ids)
        else:
            rec.record_batch({MICRO_BATCHES: self.parts, MICRO_ROWS: self.rows, **extra}, self.ids)
        self.recorded = True


def restore_micro_rng(part: dict) -> None:
    """Replay: the RNG states a micro-batch started in, when they were recorded (MicroBatches)."""
    if MICRO_RNG in part:
        restore_rng(part[MICRO_RNG])


def add_losses(total, loss):
    """The running sum of an accumulated step's micro-batch losses (None: none yet)."""
    return loss if total is None else total + loss


_Loop = TypeVar("_Loop", bound="PassedOn")


class PassedOn:
    """What a loop's recorder (accelerate's, Fabric's) passes on to its Recorder `rec` as it
    is, and its use as a context manager (closing the Recorder on the way out)."""

    rec: Any  # the Recorder

    @property
    def next_step(self) -> int:
        return self.rec.next_step

    def log_validation(self, **metrics: float) -> None:
        self.rec.log_validation(**metrics)

    def close(self) -> None:
        self.rec.close()

    def __enter__(self: _Loop) -> _Loop:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
