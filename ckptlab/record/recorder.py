"""The Recorder: the coordinator of one recorded training step. What each part records is
its own module's: the run directory and its lock (session.py), the batch records (batches.py),
the health records and alerts (health.py), the checkpoints (snapshots.py); this module says
when each happens within a step, and runs the step itself (training/step.py)."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import math
import os
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckptlab import trackers
from ckptlab.errors import RecordError
from ckptlab.record.batches import BatchLog
from ckptlab.record.config import RecordConfig
from ckptlab.record.health import WATCHED_STEPS, HealthLog
from ckptlab.record.session import Session
from ckptlab.record.snapshots import Snapshots
from ckptlab.record.system import SystemMeter
from ckptlab.run import framelog
from ckptlab.run.writer import RunWriter
from ckptlab.trackers.live import live_log
from ckptlab.training import zero
from ckptlab.training.hand_update import HandUpdate
from ckptlab.training.health import StepHealth
from ckptlab.training.optimizer_set import combined, given_several
from ckptlab.training.probe import named_parameters
from ckptlab.training.step import StepRunner, scaler_argument
from ckptlab.training.world import World
from ckptlab.training.wrappers import torch_module


class Recorder:
    """Records a training run into `run_dir`. See the package docstring and docs/run-format.md.

    Args:
        run_dir: the run directory (created; must not already hold a run unless `resume`).
        model, optimizer: what `step_fn` trains; the model must hold every trained parameter (several
            models, e.g. a GAN's D and G: one container module; a pipeline stage's schedule, docs/distributed.md,
            "Pipeline stages"). Several optimizers as a list or a dict (`[opt_d, opt_g]`, `{"d": opt_d, "g":
            opt_g}`): `step_fn` gets them as given, each one's state is checkpointed (`rec.optimizer` is their
            training/optimizer_set.py OptimizerSet). `optimizer=None`: a loop that updates the weights by hand
            (`p.data.add_(p.grad, alpha=-lr)`): the Recorder makes a `ckptlab.HandUpdate` holding the learning
            rate `lr` (`rec.optimizer`), which `step_fn` gets as its `optimizer` and must read its learning
            rate from (`optimizer.lr`), so that checkpoints carry it and replay uses the recorded one.
        lr: the learning rate of a hand-written update (only with `optimizer=None`); not given,
            it is recorded as unknown (NaN) and `rec.optimizer.lr` raises until it is set.
        step_fn: module-level `step_fn(model, optimizer, batch) -> loss`, one whole step.
        build_fn: module-level `build_fn() -> (model, optimizer[, scheduler])`, fresh and seeded;
            for a hand-written update `build_fn() -> model` (or `(model, None)`); for several
            optimizers `(model, optimizers[, schedulers])`, in the shapes given here.
        scheduler: an LR scheduler; ckptlab calls `scheduler.step()` after each step (unless
            step_scheduler=False; a scheduler that the loop steps too is an error, at once).
            Several optimizers: one per optimizer in their shape, None where one has none.
        scaler: a `torch.amp.GradScaler`, if `step_fn` uses one: its state is checkpointed, a
            `step_fn` with a `scaler` parameter is handed it, steps it skips are recorded as
            `scaler_skipped`; `build_fn` must return it too (after model and optimizer).
        batch_fn: module-level `batch_fn(sample_ids, step) -> batch` that rebuilds a step's
            batch exactly (same data, transforms and seeds). With it, batches of at least
            `batch_ref_bytes` are stored by reference, not whole (large images, video).
        config, **options: how to record (`RecordConfig`: ckpt_every, health_every, keep_last,
            on_nonfinite, resume, restore, val_metric, val_mode, keep_best, data_info,
            step_scheduler, on_anomaly, batch_ref_bytes, async_sharded, ckpt_snapshot, trackers,
            update_ratio, health_read), as one RecordConfig or as keywords (or both: the keywords win).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | list | tuple | dict | None,
        *,
        step_fn: Callable,
        build_fn: Callable,
        scheduler=None,
        scaler=None,
        batch_fn: Callable | None = None,
        lr: float | None = None,
        config: RecordConfig | None = None,
        **options,
    ):
        module = torch_module(model)  # (a pipeline schedule's stage: the part of the model this rank trains)
        optimizer, scheduler = _optimizer(optimizer, scheduler, module, lr, run_dir)  # before anything is written
        self.config = config = _config(RecordConfig.of(config, **options), optimizer)
        scaler_argument(step_fn, scaler)  # a step_fn that needs a GradScaler, and none given: now
        stores = trackers.resolve(config.trackers)  # a bad store fails here, before any work
        self.run_dir, self.batch_fn, self.step_fn, self.build_fn = Path(run_dir), batch_fn, step_fn, build_fn
        self.model, self.optimizer, self.scheduler, self.scaler = module, optimizer, scheduler, scaler
        self._in_step, self._closed, self._exit_hook = False, False, None
        # Inside torch.distributed every rank builds its Recorder: rank 0 writes the manifest,
        # the journal and checkpoints; every rank writes its own batches (see training/world.py).
        self.world = world = World.detect(model, optimizer)
        on_cuda = any(p.device.type == "cuda" for _, p in named_parameters(module)[:1])
        self.deferred = config.health_read == "deferred" or (config.health_read == "auto" and on_cuda)
        training = (module, optimizer, scheduler, scaler)
        fns = {"build_fn": build_fn, "step_fn": step_fn, "batch_fn": batch_fn}
        self._session = session = Session(self.run_dir, world, config, training, fns, deferred=self.deferred)
        try:
            self.next_step, self.restored_step = session.start_step, session.restored_step
            steps: dict[str, Any] = {"step_scheduler": config.step_scheduler, "update_ratio": config.update_ratio}
            self.runner = StepRunner(model, *training[1:], world=world, guard_scheduler=True, **steps)  # (as given)
            self.runner.probe.watch = WATCHED_STEPS  # an optimizer that does not train: health.py
            self.writer = RunWriter(self.run_dir, session.number, rank=world.rank, journal=world.is_main)
            self.live = live_log(stores, str(self.run_dir), session.manifest) if world.is_main else None
            self._health = HealthLog(
                self.writer, world, config, deferred=self.deferred, live=self.live, names=self.runner.probe.all_names
            )
            self._health.resume(session.progress)
            self._batches = BatchLog(self.writer, self.run_dir, batch_fn, config.batch_ref_bytes)
            self._snaps = Snapshots(self.writer, world, config, training, self._health, self.runner.probe)
            self._snaps.steps = list(session.checkpoints)  # committed ones are never written again
            self._system = SystemMeter(on_cuda=on_cuda)  # where each step's time goes
            for step, value in session.validation(config.val_metric):
                self._snaps.new_best(step, value)
        except BaseException:
            writer = getattr(self, "writer", None)
            if writer is not None:
                with contextlib.suppress(Exception):
                    writer.close()
            session.undo()
            raise
        if self.deferred and not world.distributed:  # (a collective at exit could hang)
            self._exit_hook = _settle_at_exit(self)
            atexit.register(self._exit_hook)

    # --- a step -----------------------------------------------------------------------------

    def step(self, batch: Any, sample_ids=None, *, tokens: int | None = None):
        """Record and run one training step; returns what `step_fn` returned (the loss).
        `tokens`: the batch's token count, for tokens/s (default: record/system.py `count`)."""
        self._system.begin()
        measure = self._open_step()
        self._batches.append(self.next_step, batch, sample_ids)
        self._system.batch(batch, sample_ids, tokens)
        self._in_step = True
        try:  # the same measured step that replay runs (training/step.py)
            loss, pending = self.runner.run_step(self.step_fn, batch, measure_update=measure, deferred=True)
            if loss is None and self.world.computes_loss:  # (a framework's step without one: end_step(None))
                raise RecordError("step_fn must return the loss (a scalar tensor), got NoneType", path=self.run_dir)
        except BaseException as e:
            self._in_step = False  # on a crash the batch stays recorded: the step can be replayed
            self._fail(e, written=True)
            raise
        self._in_step = False
        self._after_step(pending, want=False)
        return loss

    # A framework that runs the step itself (Lightning, HF Trainer) calls these two around it.

    def begin_step(self, batch: Any = None, sample_ids=None, *, tokens: int | None = None) -> int:
        """Record the batch of the step about to run (checkpointing first when one is due);
        returns its step number. The step's gradients and update are measured until
        `end_step(loss)`.

        With no batch (gradient accumulation: the micro-batches arrive one by one), the step
        starts all the same (its checkpoint, its RNG states, the measuring) and
        `record_batch(batch, sample_ids)` records its batch once it is known (before its last
        micro-batch runs, so that a step that crashes there can be replayed). `tokens`: as
        for `step`."""
        self._system.begin()
        measure = self._open_step(keep_start=batch is None)
        if batch is not None:
            self._batches.append(self.next_step, batch, sample_ids)
            self._system.batch(batch, sample_ids, tokens)
        self.runner.begin(measure_update=measure)
        self._in_step = True
        return self.next_step

    def record_batch(self, batch: Any, sample_ids=None, *, tokens: int | None = None) -> None:
        """The batch of the step `begin_step()` began without one (once per step)."""
        if not self._in_step or self._batches.written:
            raise RecordError("record_batch needs a step begun by begin_step() without a batch", path=self.run_dir)
        self._batches.append(self.next_step, batch, sample_ids)
        self._system.batch(batch, sample_ids, tokens)

    def abort_step(self, error: BaseException | None = None) -> None:
        """The step begun by `begin_step` failed: stop measuring; its batch stays recorded (a batch not yet
        given to `record_batch` is not: the step begins again). `error`: the exception (default: the one
        being handled), recorded as an `exception` event when the step's own code raised it."""
        written = self._batches.written
        self.runner.abort()
        self._in_step = False
        self._batches.drop()
        self._fail((error if error is not None else sys.exc_info()[1]) if written else None, written=written)

    def end_step(self, loss) -> StepHealth | None:
        """Finish the step begun by `begin_step`: record its health (and any anomaly), step
        the scheduler (unless step_scheduler=False), raise NonFiniteLoss if asked to. `loss`
        None: the step returned none (recorded as not known). Returns the step's health, or
        None when it is read later (`health_read`)."""
        if not self._in_step:
            raise RecordError("end_step called without begin_step", path=self.run_dir)
        if not self._batches.written:
            raise RecordError("end_step called before record_batch: the step has no batch", path=self.run_dir)
        try:
            pending = self.runner.finish(loss)
        finally:
            self._in_step = False
        return self._after_step(pending)

    @property
    def in_step(self) -> bool:
        """Between `begin_step` and `end_step`/`abort_step`."""
        return self._in_step

    @property
    def closed(self) -> bool:
        return self._closed

    def _open_step(self, keep_start: bool = False) -> bool:
        """Before step `next_step` runs: a checkpoint when one is due, and the RNG states it
        starts in (batches.py). Returns whether this step measures its update."""
        if self._closed:
            raise RecordError("the Recorder is closed", path=self.run_dir)
        if self._in_step:
            raise RecordError("begin_step called twice without end_step", path=self.run_dir)
        self._check_scheduler()
        self.writer.check()  # a failed write (e.g. a full disk) stops the recording here
        snaps = self._snaps
        t0 = time.perf_counter()
        snaps.await_write()
        n, start = self.next_step, self._session.start_step
        due = n == start or n % self.config.ckpt_every == 0
        retake = snaps.retake_due() and not due and n not in snaps.steps  # a torn live checkpoint: again
        self._batches.begin_step(forced=due or retake, keep_start=keep_start)
        # A sharded checkpoint started at the previous step commits now: its write had a step.
        snaps.wait = snaps.finish_sharded()
        if due or retake:
            self._health.settle()  # the segment and the checkpoint's "healthy" flag need every step before
            if due:
                self.writer.roll(n)
            if n not in snaps.steps:
                reason = "retake" if retake else "start" if n == start else "periodic"
                snaps.wait += self._checkpoint(n, reason)
        self._system.checkpointed(t0, taken=due or retake, wait=snaps.wait)
        return n % self.config.health_every == 0

    def _after_step(self, pending, want: bool = True) -> StepHealth | None:
        """Step `next_step` ran: its health queued (and what is due recorded); returned when
        `want`ed and read."""
        n = self.next_step
        self._snaps.await_write()
        self._batches.step_ended()
        self.next_step = n + 1
        health = self._health.queue(n, pending, self._system.end(self._snaps.wait), want=want)
        self._system.returned()
        self._check_scheduler()
        return health

    def _check_scheduler(self) -> None:
        _check_scheduler(self.runner, self.next_step, self.run_dir)

    def _fail(self, error: BaseException | None, *, written: bool) -> None:
        """The running step failed: the live checkpoint's write finished, the health still pending recorded, its
        own error (when given) an `exception` event. With its batch `written` it keeps its number (a step that
        never returned, as a resumed session counts it): a loop that goes on records its next step after it."""
        self._snaps.await_write()
        self._system.skip()
        self._health.settle_quietly()
        if error is not None:
            self._health.record_error(self.next_step, error, self.model)
        if written:
            self._batches.step_ended()
            self.next_step += 1

    # --- between steps ----------------------------------------------------------------------

    def log_validation(self, **metrics: float) -> None:
        """Record validation metrics measured on the current state (the state in which step
        `next_step` starts, i.e. after `next_step` steps). Checkpoints a new best (keep_best).
        Distributed: call it on every rank; rank 0's values are the ones recorded."""
        self._health.settle()
        step = self.next_step
        clean = self.world.broadcast({k: float(v) for k, v in metrics.items()})
        if self.world.is_main:
            self.writer.append_json(framelog.VALIDATION, step, {"metrics": clean})
            if self.live is not None:
                self.live.validation(step, clean)
        value = clean.get(self.config.val_metric)
        if value is None or not math.isfinite(value) or not self._snaps.new_best(step, value):
            return
        if self.config.keep_best and step not in self._snaps.steps:
            self._system.aside(self._checkpoint, step, "best")
            self._batches.force_rng()

    def checkpoint(self, reason: str = "manual") -> int:
        """Checkpoint the current state now (it becomes the state at `next_step`)."""
        self._health.settle()
        if self.next_step not in self._snaps.steps:
            self._system.aside(self._checkpoint, self.next_step, reason)
            self._batches.force_rng()
        return self.next_step

    def _checkpoint(self, step: int, reason: str) -> float:
        if self._in_step:
            self._batches.checkpoint_mid_step()
        return self._snaps.take(step, reason, self._session.number)

    # --- end --------------------------------------------------------------------------------

    def flush(self) -> None:
        """Record the health still pending, and wait until every checkpoint handed to the
        background writer is committed."""
        self._health.settle()
        self.writer.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._exit_hook is not None:
            atexit.unregister(self._exit_hook)
        try:
            try:  # the last step's health (a non-finite loss there is recorded and warned of, not raised)
                self._health.settle(0, raise_nonfinite=False)
            finally:
                self._snaps.close()
                self._system.close()
                self.runner.close()
                self.writer.close()
                if self.live is not None:
                    self.live.close()
            if self.world.is_main and self.writer.failed is None:  # every frame is whole on disk
                self._session.mark_closed()
        finally:
            self._session.release()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_scheduler(runner: StepRunner, step: int, run_dir: Path) -> None:
    """A scheduler the Recorder steps after every step, stepped by the loop too (once an
    epoch, say): its learning rate would move faster than the loop means, so the recording
    stops here, at the first step that shows it, with what to change."""
    moved = runner.scheduler_moved()
    if moved is not None:
        raise RecordError(
            f"before step {step}: {moved}",
            path=run_dir,
            hint="pass step_scheduler=False to let the loop step it (replay follows the learning rate "
            "recorded for every step), or stop stepping it in the loop",
        )


def _optimizer(optimizer, scheduler, model, lr, run_dir) -> tuple[Any, Any]:
    """The optimizer and scheduler to record: the ones given, several as one OptimizerSet and
    SchedulerSet (training/optimizer_set.py), or for `None` (a hand-written update) a
    HandUpdate on the model's parameters holding `lr`."""
    if given_several(optimizer) or given_several(scheduler):
        if lr is not None:
            raise RecordError("lr= is for a loop that updates the weights by hand (optimizer=None)", path=run_dir)
        try:
            return combined(optimizer, scheduler)
        except RecordError as e:
            raise RecordError(e.problem, path=run_dir, hint=e.hint) from None
    if optimizer is None:
        if not any(True for _ in model.parameters()):
            raise RecordError("the model has no parameters: there is nothing to update", path=run_dir)
        try:
            return HandUpdate(model.parameters(), lr=lr), scheduler
        except RecordError as e:
            raise RecordError(e.problem, path=run_dir, hint=e.hint) from None
    if lr is not None:
        raise RecordError(
            f"lr= is for a loop that updates the weights by hand (optimizer=None); this one has its "
            f"{type(optimizer).__name__}, which holds its own learning rate",
            path=run_dir,
            hint="drop lr=, or pass optimizer=None if the loop updates the weights itself",
        )
    engine = zero.engine_of(model)
    if engine is not None and (why := zero.optimizer_problem(engine, optimizer)):
        raise RecordError(why, path=run_dir, hint="docs/distributed.md, DeepSpeed")
    if engine is None and zero.is_deepspeed(optimizer):  # (engine.module and the engine's optimizer)
        raise RecordError(
            f"cannot record a DeepSpeed optimizer ({type(optimizer).__name__}) without its engine",
            path=run_dir,
            hint="record the DeepSpeedEngine that deepspeed.initialize returned, with this optimizer "
            "(docs/distributed.md, DeepSpeed)",
        )
    if not hasattr(optimizer, "param_groups"):
        raise RecordError(
            f"optimizer is {type(optimizer).__name__}, not a torch.optim.Optimizer",
            path=run_dir,
            hint="pass the torch optimizer that steps the weights (several as a list or a dict), or "
            "optimizer=None (with lr=) for a loop that updates them by hand",
        )
    return optimizer, scheduler


def _config(config: RecordConfig, optimizer) -> RecordConfig:
    """A hand-written update's checkpoints are copied: a live one needs the optimizer's step to
    wait for its bytes, and knows a change outside it by version counters, which
    `p.data.add_` does not move."""
    if isinstance(optimizer, HandUpdate):
        return dataclasses.replace(config, ckpt_snapshot="copy")
    return config


def _settle_at_exit(rec: Recorder) -> Callable[[], None]:
    """At interpreter exit (an uncaught exception, Ctrl-C between steps, sys.exit): record the
    health a deferred read still holds. Holds the Recorder weakly."""
    ref = weakref.ref(rec)

    def settle() -> None:
        r = ref()
        if r is not None and not r.closed:
            r._health.settle_quietly()

    return settle
