"""One training step, measured: the sequence the Recorder and replay both run, so that replayed
numbers compare with recorded ones bit for bit.

    runner = StepRunner(model, optimizer, scheduler, scaler, world=world)
    loss, health = runner.run_step(step_fn, batch, measure_update=True)

    # a framework that runs the step itself (Lightning, the HF Trainer):
    runner.begin(measure_update=True)
    ...                                   # the framework's forward, backward, optimizer step
    health = runner.end(loss)

    # the Recorder on a GPU: nothing waits for the device; read the health a step later
    loss, pending = runner.run_step(step_fn, batch, measure_update=True, deferred=True)
    ...
    health = pending.result()

In order: the probe's hooks go live; `step_fn(model, optimizer, batch)` runs (with `scaler=`
the GradScaler too, when step_fn has a `scaler` parameter); the probe queues what its hooks
measured (loss, pre-clip gradient norms, lr, update) for the host; the hooks go
quiet, also when the step raised; the LR scheduler steps, unless `step_scheduler` is False
(the framework steps it). Read at once or a step later, the numbers are the same: replay
reads at once and compares with what the Recorder read later. RNG states are the caller's
business: the Recorder captures them before the step, replay restores them before the step.

Optimizers given as a list or a dict (training/optimizer_set.py) stay so for `step_fn`; the
probe, the checkpoints and replay hold them as one OptimizerSet (and their schedulers as one
SchedulerSet). With `guard_scheduler` (the Recorder's) a scheduler that something else stepped
too between two of the runner's own steps (a loop that steps it once an epoch) is caught:
`scheduler_moved()` says so, and the runner no longer steps it over the loop's step.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptlab.errors import RecordError
from ckptlab.training.health import StepHealth
from ckptlab.training.optimizer_set import OptimizerSet, combined, key_text, schedulers_of
from ckptlab.training.pending import PendingHealth
from ckptlab.training.probe import StepProbe
from ckptlab.training.world import World
from ckptlab.training.wrappers import torch_module, torch_optimizer


@dataclass
class StepRunner:
    """The live training objects (what `build_fn` returns) and the probe on them. The optimizer
    may be given as a framework's wrapper (accelerate's, Lightning's), or several as a list or
    a dict: `step_fn` receives it as given (`step_optimizer`), while `optimizer` is the torch
    optimizer inside it (training/wrappers.py), or the OptimizerSet of several, the one whose
    hooks, state and parameter groups the probe and replay use. Likewise the model: a pipeline
    stage's schedule, given as the model, goes to `step_fn` (`step_model`), and `model` is the
    stage's module."""

    model: torch.nn.Module  # given: the user's (a pipeline's schedule); then the module it trains
    optimizer: Any  # given: the user's; then a torch.optim.Optimizer, or an OptimizerSet of several
    scheduler: Any = None
    scaler: Any = None
    step_scheduler: bool = True  # call scheduler.step() after each step
    world: World | None = None
    update_ratio: str = "sampled"  # how the probe measures ||dw|| (training/probe.py)
    guard_scheduler: bool = False  # catch a scheduler stepped outside the runner (the Recorder's)
    probe: StepProbe = field(init=False)
    stepped: bool = field(init=False, default=False)  # a step has run on it (replay: DDP's buckets rebuilt)
    step_optimizer: Any = field(init=False)  # the optimizer as given: what step_fn receives
    step_model: Any = field(init=False)  # the model as given: what step_fn receives
    _extra: tuple = field(init=False, default=(None, None, {}))  # (step_fn, scaler, scaler_argument): once
    # The schedulers' step counts after the runner's last own step (guard_scheduler), and what
    # stepped one outside it, once caught (`scheduler_moved`).
    _counts: tuple | None = field(init=False, default=None)
    _moved: str | None = field(init=False, default=None)
    _schedulers: list = field(init=False, default_factory=list)  # (key, torch scheduler) of each

    def __post_init__(self) -> None:
        self.step_model, self.model = self.model, torch_module(self.model)
        given = self.optimizer
        optimizer, self.scheduler = combined(given, self.scheduler)
        self.step_optimizer = optimizer.given if isinstance(optimizer, OptimizerSet) else given
        self.optimizer = torch_optimizer(optimizer)
        self._schedulers = schedulers_of(self.scheduler)
        self.probe = StepProbe(self.model, self.optimizer, self.scaler, self.world, update_ratio=self.update_ratio)

    def begin(self, *, measure_update: bool) -> None:
        """Start measuring. `measure_update` measures update ratios and weight norms (a
        sample of the weights, or with update_ratio="exact" a copy of them)."""
        self.probe.begin(measure_update=measure_update)

    def end(self, loss) -> StepHealth:
        """Finish the step begun by `begin`: its health, read now (waits for the device);
        then the scheduler steps."""
        pending = self._finish(loss)
        health = pending.result(grads_live=True)
        self._step_scheduler()
        return health

    def finish(self, loss) -> PendingHealth:
        """`end` without waiting for the device: the health is read by `.result()`, later."""
        pending = self._finish(loss)
        self._step_scheduler()
        return pending

    def _finish(self, loss) -> PendingHealth:
        try:
            return self.probe.end(loss)
        finally:
            self.probe.abort()

    def _step_scheduler(self) -> None:
        if self.scheduler is None or not self.step_scheduler:
            return
        if self.guard_scheduler:
            if self.scheduler_moved() is not None:
                return  # the loop steps it: stepping it again would change its training
            self.scheduler.step()
            self._counts = _step_counts(self._schedulers)
            return
        self.scheduler.step()

    def scheduler_moved(self) -> str | None:
        """With `guard_scheduler`: what says that a scheduler the runner steps after every step
        was also stepped by something else since the runner's last step of it (its
        `last_epoch` moved: e.g. a loop that steps it once an epoch, or step_fn), else None.
        From then on the runner leaves it to that other stepping."""
        if self._moved is None and self._counts is not None:
            now = _step_counts(self._schedulers)
            if now != self._counts:
                key, sched, before, after = next(
                    (k, s, b, a) for (k, s), b, a in zip(self._schedulers, self._counts, now) if a != b
                )
                which = f" of optimizer {key_text(key)}" if key is not None else ""
                self._moved = (
                    f"the LR scheduler{which} ({type(sched).__name__}) was stepped outside ckptlab (its last_epoch "
                    f"went from {before} to {after} since ckptlab stepped it), while the Recorder steps it after "
                    "every step too (step_scheduler=True): its learning rate would move faster than the loop means"
                )
        return self._moved

    def abort(self) -> None:
        """The step begun by `begin` failed: stop measuring."""
        self.probe.abort()

    def run_step(
        self, step_fn: Callable, batch: Any, *, measure_update: bool, around=None, deferred: bool = False
    ) -> tuple[Any, StepHealth | PendingHealth]:
        """(what step_fn returned, the step's health); with `deferred`, a PendingHealth in its
        place. `around`, a context manager not yet entered, is entered for the duration of
        `step_fn` only (replay's tracer, its redirect of the user's prints)."""
        if self._extra[0] is not step_fn or self._extra[1] is not self.scaler:  # (inspect.signature: ~50 us)
            self._extra = (step_fn, self.scaler, scaler_argument(step_fn, self.scaler))
        extra = self._extra[2]
        self.begin(measure_update=measure_update)
        try:
            with around if around is not None else contextlib.nullcontext():
                loss = step_fn(self.step_model, self.step_optimizer, batch, **extra)
        except BaseException:
            self.abort()
            raise
        return loss, self.finish(loss) if deferred else self.end(loss)

    def close(self) -> None:
        self.probe.close()


def _step_counts(schedulers: list) -> tuple:
    """Each scheduler's `last_epoch` (how often it was stepped): `schedulers` as schedulers_of
    gives them."""
    return tuple(getattr(s, "last_epoch", None) for _, s in schedulers)


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
