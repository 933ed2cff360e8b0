"""One training step, measured: the sequence the Recorder and replay both run, so that replayed
numbers compare with recorded ones bit for bit.

    trainee = Trainee(model, optimizer, scheduler, scaler, world=world)
    health = trainee.run_step(step_fn, batch, measure_update=True)

    # a framework that runs the step itself (Lightning, the HF Trainer):
    trainee.begin(measure_update=True)
    ...                                   # the framework's forward, backward, optimizer step
    health = trainee.end(loss)

In order: the probe's hooks go live; `step_fn(model, optimizer, batch)` runs (with
`scaler=` the GradScaler too, when step_fn has a `scaler` parameter); the probe turns
what its hooks saw into the step's health (loss, pre-clip gradient norms, lr, update); the
hooks go quiet, also when the step raised; the LR scheduler steps, unless `step_scheduler` is
False (the framework steps it). RNG states are the caller's business: the Recorder captures
them before the step, replay restores them before the step.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptlab.errors import RecordError
from ckptlab.training.probe import StepHealth, StepProbe
from ckptlab.training.world import World


@dataclass
class Trainee:
    """The live training objects (what `build_fn` returns) and the probe on them."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    scaler: Any = None
    step_scheduler: bool = True  # call scheduler.step() after each step
    world: World | None = None
    probe: StepProbe = field(init=False)

    def __post_init__(self) -> None:
        self.probe = StepProbe(self.model, self.optimizer, self.scaler, self.world)

    def begin(self, *, measure_update: bool) -> None:
        """Start measuring. `measure_update` costs a copy of the parameters (update ratios,
        weight norms)."""
        self.probe.begin(measure_update=measure_update)

    def end(self, loss) -> StepHealth:
        """Finish the step begun by `begin`: its health; then the scheduler steps."""
        try:
            health = self.probe.end(loss)
        finally:
            self.probe.abort()
        if self.scheduler is not None and self.step_scheduler:
            self.scheduler.step()
        return health

    def abort(self) -> None:
        """The step begun by `begin` failed: stop measuring."""
        self.probe.abort()

    def run_step(self, step_fn: Callable, batch: Any, *, measure_update: bool, around=None) -> tuple[Any, StepHealth]:
        """(what step_fn returned, the step's health); `around`, a context manager not yet
        entered, is entered for the duration of `step_fn` only (replay's tracer, its redirect
        of the user's prints)."""
        extra = scaler_argument(step_fn, self.scaler)
        self.begin(measure_update=measure_update)
        try:
            with around if around is not None else contextlib.nullcontext():
                loss = step_fn(self.model, self.optimizer, batch, **extra)
        except BaseException:
            self.abort()
            raise
        return loss, self.end(loss)

    def close(self) -> None:
        self.probe.close()


def scaler_argument(step_fn: Callable, scaler) -> dict:
    """`{"scaler": scaler}` for a `step_fn(model, optimizer, batch, scaler)`: it is handed the
    GradScaler (the Recorder's `scaler=`, and in replay the one build_fn returns, whose state
    the checkpoint restored); RecordError when it needs one and none was given."""
    try:
        param = inspect.signature(step_fn).parameters.get("scaler")
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        param = None
    if param is None:
        return {}
    if scaler is None and param.default is inspect.Parameter.empty:
        raise RecordError(
            "step_fn takes a `scaler` but no GradScaler was given",
            hint="pass it as Recorder(..., scaler=scaler), and return it from build_fn",
        )
    return {"scaler": scaler} if scaler is not None else {}
