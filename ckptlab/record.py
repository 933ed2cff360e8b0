"""Recorder: the sampler that drives one training step and records what replay needs.

    model, opt = build()
    rec = ckptlab.Recorder("runs/exp1", model, opt, step_fn=step, build_fn=build, ckpt_every=500)
    for ids, batch in loader:                    # loader over ckptlab.with_sample_ids(dataset)
        loss = rec.step(batch, sample_ids=ids)   # records, runs step(), returns the loss
        if rec.next_step % 1000 == 0:
            rec.log_validation(val_loss=evaluate(model))
    rec.close()                                  # or: with ckptlab.Recorder(...) as rec:

One `rec.step(batch)` for step n:
  1. at a checkpoint step (n % ckpt_every == 0, and the first step of every session): copy the
     training state off the device and commit it in the background (see run/checkpoint.py);
  2. append the batch, its sample ids and the RNG states the step starts in (only when they
     changed since the end of the previous step: a DataLoader reseeding or augmentation in the
     loop moves them; otherwise "unchanged" costs nothing) -- before running the step, so a
     step that crashes the process still has its batch;
  3. run `step_fn(model, optimizer, batch)` measured, then `scheduler.step()`: the same
     sequence replay runs (training/step.py);
  4. append the step's health (loss, grad norms, lr, update ratios, ...) and any anomaly;
  5. on a non-finite loss, raise NonFiniteLoss (after recording), unless on_nonfinite="record".

Where the health is read (`health_read`): "immediate" reads it as the step ends (a device
sync on a GPU); "deferred" reads step n's health when step n+1 ends, so nothing in a recorded
step waits for the GPU: the health of step n is appended (and NonFiniteLoss raised) at the end
of step n+1, before a checkpoint, at `log_validation`, `flush`, `close` and at interpreter
exit. "auto" (default) defers on a CUDA model and reads at once on the CPU (where reading a
tensor costs no sync). When `rec.step()` returns, the step's batch and (immediate) health, or
the previous step's health (deferred), are in the kernel's hands: a SIGKILL from then on
cannot lose them.

From its start until `close()` the Recorder holds the run's lock (RUN/.lock, run/lock.py; in a
distributed run, rank 0's Recorder): a second Recorder on the run, or a rollback, is refused
with RunLockedError naming this process.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import socket
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from ckptlab import trackers
from ckptlab.analysis.anomalies import detectors, step_anomalies
from ckptlab.errors import CkptlabError, NonFiniteLoss, RecordError
from ckptlab.run import codec, framelog, records
from ckptlab.run.archive import unfinished_rollback
from ckptlab.run.checkpoint import CapturedState, clean_stale, list_checkpoints
from ckptlab.run.layout import FORMAT_VERSION, MANIFEST, is_first_leftover
from ckptlab.run.lock import RunLock, RunLockedError, acquire
from ckptlab.run.manifest import new_manifest, read_manifest, write_manifest
from ckptlab.run.reader import read_progress
from ckptlab.run.retention import apply_retention
from ckptlab.run.writer import Retention, RunWriter, io_error
from ckptlab.trackers.live import live_log
from ckptlab.trackers.points import ALERT_GAP, alert_text
from ckptlab.training import userfns
from ckptlab.training.crash import describe, is_step_error
from ckptlab.training.probe import UPDATE_MODES, PendingHealth, StepHealth, named_parameters
from ckptlab.training.sharded import save_sharded, start_sharded_save
from ckptlab.training.state import (
    AwaitLiveBytes,
    capture_env,
    capture_rng,
    capture_train_state,
    is_compiled,
    per_tensor_updates,
    restore_checkpoint,
    rng_fingerprint,
    snapshot,
)
from ckptlab.training.step import Trainee, scaler_argument
from ckptlab.training.world import World


@dataclass(frozen=True)
class RecordConfig:
    """How a Recorder records: the options `Recorder(...)` and both framework callbacks take
    (as keywords, or as one `config=RecordConfig(...)`).

    Args:
        ckpt_every: steps between checkpoints (a checkpoint also starts every session).
        health_every: steps between update-ratio / weight-norm measurements; grad norms, loss
            and lr are recorded every step.
        update_ratio: "sampled" (default: ||dw|| estimated from a fixed sample of at most
            4096 elements per tensor, extra memory <= 1% of the parameter bytes) or "exact"
            (a copy of every parameter on the measured steps).
        health_read: "auto" (default: "deferred" on a CUDA model, "immediate" otherwise),
            "deferred" (step n's health is read and written when step n+1 ends: no device
            sync in a step; NonFiniteLoss comes one step late) or "immediate" (read as the
            step ends; NonFiniteLoss at the faulty step).
        keep_last: checkpoints kept by retention (plus best-validation and last-healthy).
        on_nonfinite: "raise" (NonFiniteLoss after recording; with the deferred read, at the
            end of the next step) or "record" (keep going).
        resume: continue an existing run (numbering continues; nothing is overwritten).
        restore: with `resume`, load the latest checkpoint (or a rollback's target) into
            model/optimizer/scheduler/scaler/RNG. Pass False if you restored them yourself.
        val_metric, val_mode: the validation metric that defines "best" ("min" or "max").
        keep_best: checkpoint the state whenever `val_metric` improves, so rollback can
            return to exactly the best-validation weights.
        data_info: facts about the data for `ckptlab dirty`, e.g. {"pad_id": 0, "vocab_size": 50257}.
        step_scheduler: call `scheduler.step()` after each step (False when step_fn, or the
            framework driving the loop, steps it itself; the scheduler is still checkpointed).
        batch_ref_bytes: with a `batch_fn`, batches of at least this many bytes are stored by
            reference (sample ids, sha256 of the content, size) instead of whole; replay
            rebuilds them with `batch_fn` and checks the digest. Smaller ones are stored whole.
        ckpt_snapshot: "live" (default): on a CPU model, a checkpoint is written from the
            parameters and the optimizer's state themselves, in the background, and the
            optimizer's next `step()` waits for each tensor's bytes as it updates it (for all
            of them with `foreach` or `fused`); the forward and backward passes come first,
            and the files are hashed, read back, at the lowest CPU priority over the next
            steps; no copy of the state is made.
            A tensor changed in place before it is written (outside the optimizer's step)
            is detected, the checkpoint is taken again at the next step by copy, and copies
            are used from then on. "copy": copy the state when checkpointing (always, on a
            GPU: it is staged to host memory).
        async_sharded: FSDP2: stage each rank's shards to host memory and write them in the
            background (`torch.distributed.checkpoint.async_save`), committed at the start of
            the next step; False writes them on the training thread.
        on_anomaly: `callback(step, events)` after a step with an anomaly (non-finite loss,
            gradient or weight; loss or grad-norm spike: see analysis/spikes.py); "warn"
            (default) prints one warning line per anomaly episode naming the replay command;
            None is silent. Events are recorded either way.
        trackers: MLflow / W&B runs that receive the health as it is recorded, batched off
            the training thread, with an alert per anomaly episode: a list of
            `ckptlab.trackers.MLflow(...)` / `WandB(...)` (or wandb runs), or "auto" (the
            W&B / MLflow run already active in this process; the callbacks add the trainer's
            loggers). See docs/integrations.md.
    """

    ckpt_every: int = 500
    health_every: int = 10
    keep_last: int = 3
    on_nonfinite: str = "raise"
    resume: bool = False
    restore: bool = True
    val_metric: str = "val_loss"
    val_mode: str = "min"
    keep_best: bool = True
    data_info: dict | None = None
    step_scheduler: bool = True
    on_anomaly: Callable[[int, list[dict]], None] | str | None = "warn"
    batch_ref_bytes: int = 1 << 20
    async_sharded: bool = True
    ckpt_snapshot: str = "live"
    trackers: Any = ()
    update_ratio: str = "sampled"
    health_read: str = "auto"

    def __post_init__(self) -> None:
        if self.ckpt_every < 1 or self.health_every < 1:
            raise RecordError("ckpt_every and health_every must be >= 1")
        if self.update_ratio not in UPDATE_MODES:
            raise RecordError(f"update_ratio must be 'sampled' or 'exact', not {self.update_ratio!r}")
        if self.health_read not in ("auto", "deferred", "immediate"):
            raise RecordError(f"health_read must be 'auto', 'deferred' or 'immediate', not {self.health_read!r}")
        if self.ckpt_snapshot not in ("live", "copy"):
            raise RecordError(f"ckpt_snapshot must be 'live' or 'copy', not {self.ckpt_snapshot!r}")
        if self.on_nonfinite not in ("raise", "record"):
            raise RecordError(f"on_nonfinite must be 'raise' or 'record', not {self.on_nonfinite!r}")
        if self.val_mode not in ("min", "max"):
            raise RecordError(f"val_mode must be 'min' or 'max', not {self.val_mode!r}")

    @classmethod
    def of(cls, config: RecordConfig | None = None, **options) -> RecordConfig:
        """`config` (default: the defaults) with `options` replaced; RecordError naming an
        option that does not exist."""
        unknown = sorted(set(options) - {f.name for f in fields(cls)})
        if unknown:
            raise RecordError(f"unknown Recorder option(s) {', '.join(unknown)} (see ckptlab.RecordConfig)")
        return replace(config or cls(), **options)


class Recorder:
    """Records a training run into `run_dir`. See the module docstring and docs/run-format.md.

    Args:
        run_dir: the run directory (created; must not already hold a run unless `resume`).
        model, optimizer: what `step_fn` trains.
        step_fn: module-level `step_fn(model, optimizer, batch) -> loss`, one whole step.
        build_fn: module-level `build_fn() -> (model, optimizer[, scheduler])`, fresh and seeded.
        scheduler: an LR scheduler; ckptlab calls `scheduler.step()` after each step.
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
        optimizer: torch.optim.Optimizer,
        *,
        step_fn: Callable,
        build_fn: Callable,
        scheduler=None,
        scaler=None,
        batch_fn: Callable | None = None,
        config: RecordConfig | None = None,
        **options,
    ):
        self.config = RecordConfig.of(config, **options)
        scaler_argument(step_fn, scaler)  # a step_fn that needs a GradScaler, and none given: now
        self.batch_fn = batch_fn
        self.run_dir = Path(run_dir)
        self._trackers = trackers.resolve(self.config.trackers)  # a bad store fails here, before any work
        self.model, self.optimizer = model, optimizer
        self.step_fn, self.build_fn = step_fn, build_fn
        self.scheduler, self.scaler = scheduler, scaler
        self._in_step = False
        self._ckpt_wait = 0.0
        self._spikes = detectors()
        self._first_anomaly: int | None = None
        self._best: tuple[int, float] | None = None
        self._ckpt_steps: list[int] = []
        self._rng_after_prev: tuple | None = None  # rng_fingerprint() when the previous step ended
        self._force_rng = True
        self._pending_rng: Any = _WRITTEN  # the RNG states of a step whose batch is not yet written
        # The RNG states the running step began in, when changed or when its batch comes later
        # (begin_step without one: a checkpoint before record_batch gives them to the batch).
        self._step_rng: dict | None = None
        self._closed = False
        self._pending = None  # a sharded checkpoint being written in the background
        self._live_snap: CapturedState | None = None  # a checkpoint written from live tensors
        self._bytes_mode: AwaitLiveBytes | None = None  # on during an optimizer step that follows it
        self._retake = False  # a live checkpoint was torn: take one at the next step
        self._snap_hook = None
        self._health_queue: list[tuple[int, PendingHealth, float, float]] = []  # (step, health, ckpt_wait, time)
        self.restored_step: int | None = None

        # Inside torch.distributed every rank builds its Recorder: rank 0 writes the manifest,
        # the journal and checkpoints; every rank writes its own batches (see training/world.py).
        # Checks read the same disk on every rank, so every rank raises the same error.
        self.world = World.detect(model)
        on_cuda = any(p.device.type == "cuda" for _, p in named_parameters(model)[:1])
        mode = self.config.health_read
        self.deferred = mode == "deferred" or (mode == "auto" and on_cuda)
        self._exit_hook = None
        exists = (self.run_dir / MANIFEST).exists()
        if exists and not self.config.resume:
            raise RecordError(
                "already holds a run",
                path=self.run_dir,
                hint="pass resume=True to continue it, or choose a new directory",
            )
        if not exists and self.run_dir.exists() and any(not is_first_leftover(p.name) for p in self.run_dir.iterdir()):
            raise RecordError("exists and is not a ckptlab run; refusing to write into it", path=self.run_dir)
        self.world.barrier()  # nobody writes before every rank has checked
        # One process records a run at a time: rank 0 holds RUN/.lock (run/lock.py) until
        # close(), taken before anything is written; every rank raises if it was refused.
        self._lock: RunLock | None = None
        self._lock_run()
        try:
            self._start(exists)
        except BaseException:
            self._release_lock()
            raise

    def _lock_run(self) -> None:
        refused = None
        if self.world.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            try:
                self._lock = acquire(self.run_dir, "recorder")
            except RunLockedError as e:
                refused = ("locked", e.holder)
            except CkptlabError as e:
                refused = ("error", e.problem)
        refused = self.world.broadcast(refused)
        if refused is not None:
            self._release_lock()
            kind, detail = refused
            if kind == "locked":
                raise RunLockedError(self.run_dir, detail)
            raise RecordError(detail, path=self.run_dir)

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()

    def _start(self, exists: bool) -> None:
        if self.world.is_main:
            if exists:
                clean_stale(self.run_dir)
            else:
                self._write_manifest(self._new_manifest())
        self.world.barrier()
        self.manifest = read_manifest(self.run_dir)
        if exists:
            self._check_same_model()
            self.next_step = self._resume(self.config.restore)
        else:
            self.next_step = 0
        if exists and self.batch_fn is not None:  # (a resumed run may add or change it)
            self.manifest.setdefault("functions", {})["batch_fn"] = userfns.describe(
                self.batch_fn, "batch_fn", self.run_dir
            )
        # This session writes segments of the current layout (an old run's manifest says so from now).
        self.manifest["format_version"] = max(self.manifest["format_version"], FORMAT_VERSION)
        self.session = len(self.manifest["sessions"])
        self.manifest["sessions"].append(
            {
                "session": self.session,
                "start_step": self.next_step,
                "started": time.time(),
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "restored_from": self.restored_step,
            }
        )
        self.world.barrier()  # every rank has read the manifest before rank 0 rewrites it
        if self.world.is_main:
            self._write_manifest(self.manifest)
        self.session_start = self.next_step
        self.trainee = Trainee(
            self.model,
            self.optimizer,
            self.scheduler,
            self.scaler,
            step_scheduler=self.config.step_scheduler,
            world=self.world,
            update_ratio=self.config.update_ratio,
        )
        warn = self.config.on_anomaly == "warn"
        self.on_anomaly = (
            (_warn_anomaly(str(self.run_dir)) if self.world.is_main else None) if warn else self.config.on_anomaly
        )
        self.writer = RunWriter(self.run_dir, self.session, rank=self.world.rank, journal=self.world.is_main)
        # Live checkpoints need the optimizer's step to wait for them (it is what changes the
        # tensors they are written from). Sharded ones go through DCP (staged copies).
        self._live_ok = (
            self.config.ckpt_snapshot == "live"
            and not self.world.sharded
            and self.world.is_main
            and hasattr(self.optimizer, "register_step_pre_hook")
        )
        if self._live_ok:
            self._snap_hook = (
                self.optimizer.register_step_pre_hook(lambda *_: self._before_update()),
                self.optimizer.register_step_post_hook(lambda *_: self._after_update()),
            )
        self.live = live_log(self._trackers, str(self.run_dir), self.manifest) if self.world.is_main else None
        if self.deferred and not self.world.distributed:  # (a collective at exit could hang)
            self._exit_hook = _settle_at_exit(self)
            atexit.register(self._exit_hook)

    def _write_manifest(self, manifest: dict) -> None:
        try:
            write_manifest(self.run_dir, manifest)
        except OSError as e:  # e.g. a full disk: one clear line, like every other failed write
            raise (io_error(e, "writing manifest.json", self.run_dir) or e) from None

    # --- set-up ---------------------------------------------------------------------------

    def _new_manifest(self) -> dict:
        params = named_parameters(self.model)
        first = params[0][1] if params else None
        return new_manifest(
            device=str(first.device) if first is not None else "cpu",
            config={
                "ckpt_every": self.config.ckpt_every,
                "health_every": self.config.health_every,
                "keep_last": self.config.keep_last,
                "on_nonfinite": self.config.on_nonfinite,
                "val_metric": self.config.val_metric,
                "val_mode": self.config.val_mode,
                "has_scheduler": self.scheduler is not None,
                "step_scheduler": self.config.step_scheduler,
                "has_scaler": self.scaler is not None,
                "update_ratio": self.config.update_ratio,
                "health_read": "deferred" if self.deferred else "immediate",
                "ckpt_snapshot": self.config.ckpt_snapshot,
                "compiled": is_compiled(self.model) or is_compiled(self.step_fn),
            },
            functions={
                "build_fn": userfns.describe(self.build_fn, "build_fn", self.run_dir),
                "step_fn": userfns.describe(self.step_fn, "step_fn", self.run_dir),
                **(
                    {"batch_fn": userfns.describe(self.batch_fn, "batch_fn", self.run_dir)}
                    if self.batch_fn is not None
                    else {}
                ),
            },
            parameters=[
                {
                    "name": n,
                    "shape": list(p.shape),
                    "dtype": codec.dtype_name(p.dtype),
                    "requires_grad": p.requires_grad,
                }
                for n, p in params
            ],
            param_groups=len(self.optimizer.param_groups),
            data_info=self.config.data_info or {},
            env=capture_env(),
            world_size=self.world.size,
            layout="sharded" if self.world.sharded else "replicated",
            backend=self.world.backend,
        )

    def _check_same_model(self) -> None:
        recorded = [(p["name"], list(p["shape"])) for p in self.manifest.get("parameters", [])]
        current = [(n, list(p.shape)) for n, p in named_parameters(self.model)]
        if recorded != current:
            diff = next(((a, b) for a, b in zip(recorded, current) if a != b), (len(recorded), len(current)))
            raise RecordError(f"the model differs from the recorded one ({diff[0]} vs {diff[1]})", path=self.run_dir)

    def _resume(self, restore: bool) -> int:
        """Next step number for a resumed session; restores the state when asked."""
        pending = unfinished_rollback(self.run_dir)
        if pending is not None:  # half the later steps moved: resuming now would mix timelines
            raise RecordError(
                f"a rollback into {pending.name} was interrupted",
                path=self.run_dir,
                hint=f"run `ckptlab rollback --run {self.run_dir}` again to finish it, then resume",
            )
        found, _ = list_checkpoints(self.run_dir)
        progress = read_progress(self.run_dir)
        # Committed checkpoints are never written again, and retention keeps protecting the
        # best-validation and last-healthy checkpoints of earlier sessions.
        self._ckpt_steps = [c.step for c in found]
        self._first_anomaly = progress.first_anomaly
        for loss, grad in progress.recent:  # spikes are judged against the run so far, not a blank
            self._spikes["loss"].check(loss)
            self._spikes["grad"].check(grad)
        if not found:
            warnings.warn(
                f"{self.run_dir}: resuming a run that has no checkpoint; the model as given becomes the "
                "state of the first resumed step",
                stacklevel=3,
            )
        for step, metrics in progress.validation:
            value = metrics.get(self.config.val_metric)
            if value is not None and math.isfinite(value) and self._improves(value):
                self._best = (step, float(value))
        rollback = self.manifest.get("rollback")
        # The next step follows the last one recorded. A checkpoint can be one past it (taken at
        # a validation after the last step, or committed just before a kill hit its step).
        next_step, target = max(progress.last_step + 1, max(self._ckpt_steps, default=0)), None
        if rollback is not None:
            target = next((c for c in found if c.step == rollback["step"]), None)
            if target is None:
                raise RecordError(f"the rollback target checkpoint {rollback['step']} is missing", path=self.run_dir)
            next_step = target.step
            self.manifest["rollback"] = None
            restore = True  # the rewound steps' state exists only in that checkpoint
        elif restore:
            target = found[-1] if found else None
        if restore and target is not None:
            target.verify()
            restore_checkpoint(target, self.model, self.optimizer, self.scheduler, self.scaler, self.world)
            self.restored_step = target.step
        return next_step

    # --- recording ------------------------------------------------------------------------------

    def step(self, batch: Any, sample_ids=None):
        """Record and run one training step; returns what `step_fn` returned (the loss)."""
        measure = self._record_batch(batch, sample_ids)
        self._in_step = True
        try:  # the same measured step that replay runs (training/step.py)
            loss, pending = self.trainee.run_step(self.step_fn, batch, measure_update=measure, deferred=True)
        except BaseException as e:
            self._in_step = False  # on a crash the batch stays recorded: the step can be replayed
            self._await_snapshot()
            self._settle_quietly()
            self._record_error(e)
            raise
        self._in_step = False
        self._after_step(pending)
        return loss

    # A framework that runs the step itself (Lightning, HF Trainer) calls these two around it.

    def begin_step(self, batch: Any = None, sample_ids=None) -> int:
        """Record the batch of the step about to run (checkpointing first when one is due);
        returns its step number. The step's gradients and update are measured until
        `end_step(loss)`.

        With no batch (gradient accumulation: the micro-batches arrive one by one), the step
        starts all the same (its checkpoint, its RNG states, the measuring) and
        `record_batch(batch, sample_ids)` records its batch once it is known (before its last
        micro-batch runs, so that a step that crashes there can be replayed)."""
        measure = self._open_step(keep_start=batch is None)
        if batch is not None:
            self._append_batch(batch, sample_ids)
        self.trainee.begin(measure_update=measure)
        self._in_step = True
        return self.next_step

    def record_batch(self, batch: Any, sample_ids=None) -> None:
        """The batch of the step `begin_step()` began without one (once per step)."""
        if not self._in_step or self._pending_rng is _WRITTEN:
            raise RecordError("record_batch needs a step begun by begin_step() without a batch", path=self.run_dir)
        self._append_batch(batch, sample_ids)

    def abort_step(self, error: BaseException | None = None) -> None:
        """The step begun by `begin_step` failed: stop measuring; its batch stays recorded
        (a batch not yet given to `record_batch` is not recorded). `error`: the exception
        (default: the one being handled), recorded as an `exception` event when the step's
        own code raised it."""
        written = self._pending_rng is _WRITTEN
        self.trainee.abort()
        self._in_step = False
        self._pending_rng = _WRITTEN
        self._await_snapshot()
        self._settle_quietly()
        error = error if error is not None else sys.exc_info()[1]
        if error is not None and written:
            self._record_error(error)

    def end_step(self, loss) -> StepHealth | None:
        """Finish the step begun by `begin_step`: record its health (and any anomaly), step
        the scheduler (unless step_scheduler=False), raise NonFiniteLoss if asked to.
        Returns the step's health, or None when it is read later (`health_read`)."""
        if not self._in_step:
            raise RecordError("end_step called without begin_step", path=self.run_dir)
        if self._pending_rng is not _WRITTEN:
            raise RecordError("end_step called before record_batch: the step has no batch", path=self.run_dir)
        try:
            pending = self.trainee.finish(loss)
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

    def _record_batch(self, batch: Any, sample_ids) -> bool:
        """Before step `next_step` runs: a checkpoint when one is due, then its batch, sample
        ids and (when changed) RNG states. Returns whether this step measures its update."""
        measure = self._open_step()
        self._append_batch(batch, sample_ids)
        return measure

    def _open_step(self, keep_start: bool = False) -> bool:
        """Before step `next_step` runs: a checkpoint when one is due, and the RNG states it
        starts in (kept for its batch record when they changed; `keep_start`: kept anyway, for
        a checkpoint taken before the batch is recorded). Returns whether this step measures
        its update."""
        if self._closed:
            raise RecordError("the Recorder is closed", path=self.run_dir)
        if self._in_step:
            raise RecordError("begin_step called twice without end_step", path=self.run_dir)
        self.writer.check()  # a failed write (e.g. a full disk) stops the recording here
        self._await_snapshot()
        n = self.next_step
        due = n == self.session_start or n % self.config.ckpt_every == 0
        retake, self._retake = self._retake, False  # a live checkpoint that was torn: again, here
        retake = retake and not due and n not in self._ckpt_steps
        # A segment (and a replay) can start at a checkpoint: its first batch carries its RNG
        # states whatever they are. Otherwise they are recorded when the loop drew random
        # numbers since the last step ended: two fingerprints compared (~10 us), the states
        # themselves captured only when they are recorded (or kept, `keep_start`).
        forced = due or retake or self._force_rng or self._rng_after_prev is None
        changed = forced or rng_fingerprint() != self._rng_after_prev
        rng = capture_rng() if changed or keep_start else None
        self._pending_rng = rng if changed else None
        self._step_rng = rng
        # A sharded checkpoint started at the previous step commits now: its write had a step.
        self._ckpt_wait = self._finish_sharded()
        if due:
            self._settle()  # the segment and the checkpoint's "healthy" flag need every step before
            self.writer.roll(n)
            if n not in self._ckpt_steps:
                self._ckpt_wait += self._checkpoint(n, "start" if n == self.session_start else "periodic")
        elif retake:
            self._settle()
            self._ckpt_wait += self._checkpoint(n, "retake")
        self._force_rng = False
        return n % self.config.health_every == 0

    def _append_batch(self, batch: Any, sample_ids) -> None:
        """Step `next_step`'s batch, sample ids and the RNG states `_open_step` kept."""
        if sample_ids is not None:
            sample_ids = _plain_ids(sample_ids)
        n = self.next_step
        nbytes = records.batch_nbytes(batch) if self.batch_fn is not None else 0
        if self.batch_fn is not None and nbytes >= self.config.batch_ref_bytes:
            if sample_ids is None:
                raise RecordError(
                    f"step {n}: a batch stored by reference needs its sample_ids (batch_fn rebuilds it from them)",
                    path=self.run_dir,
                )
            digest = records.batch_digest(batch)
            payload = records.encode_batch_ref(n, digest, nbytes, sample_ids, self._pending_rng)
        else:
            payload = records.encode_batch(n, batch, sample_ids, self._pending_rng)
        self.writer.append_batch(n, payload)
        self._pending_rng = _WRITTEN

    def _after_step(self, pending: PendingHealth) -> StepHealth | None:
        """Step `next_step` ran: queue its health; record what is due (all of it when read at
        once, all but this step's when deferred). Returns this step's health when read."""
        n = self.next_step
        self._await_snapshot()
        self._rng_after_prev = rng_fingerprint()
        self._health_queue.append((n, pending, self._ckpt_wait, time.time()))
        self.next_step = n + 1
        return self._settle(keep=1 if self.deferred else 0)

    def _settle(self, keep: int = 0, *, raise_nonfinite: bool = True) -> StepHealth | None:
        """Read and record the health of the steps that ran, leaving the last `keep` pending;
        then NonFiniteLoss for the first non-finite loss among them (if asked to), once the
        steps after it are recorded too. Returns the last health recorded."""
        health, bad = None, None
        while len(self._health_queue) > keep:
            n, pending, wait, t = self._health_queue.pop(0)
            health = self._record_health(n, pending.result(grads_live=not self.deferred), wait, t)
            if bad is None and not health.loss_finite:
                bad = (n, health.loss)
        if bad is not None and raise_nonfinite and self.config.on_nonfinite == "raise":
            self._settle(0, raise_nonfinite=False)
            raise NonFiniteLoss(bad[0], bad[1], str(self.run_dir))
        return health

    def _settle_quietly(self) -> None:
        """On the way out of a failed step: record the health still pending, without raising
        over the error that is already on its way. Not when distributed: reading combines the
        ranks (a collective), and the other ranks are not failing with this one."""
        if self.world.distributed:
            return
        with contextlib.suppress(Exception):
            self._settle(0, raise_nonfinite=False)

    def _record_health(self, n: int, health: StepHealth, ckpt_wait: float, t: float) -> StepHealth:
        """Step n's health and anomalies, appended to the journal."""
        events = self._anomalies(n, health)
        scalars = {"step": n, "time": t, **health.scalars()}
        if ckpt_wait:
            scalars["ckpt_wait"] = ckpt_wait
        arrays = health.arrays()
        if self.world.is_main:
            self.writer.append_step(n, records.encode_step(scalars, arrays))
            for event in events:
                self.writer.append_json(framelog.EVENT, n, event)
        if self.live is not None:  # queued: the trackers are sent to off this thread
            self.live.step(n, scalars, arrays, events)
        if events and self.on_anomaly is not None:
            self.on_anomaly(n, events)
        return health

    def _record_error(self, error: BaseException) -> None:
        """Step `next_step` raised: an `exception` event (what, and where in the user's code),
        when its own code raised it (not ckptlab, not a KeyboardInterrupt). Never raises over
        the error on its way."""
        if not is_step_error(error):
            return
        n = self.next_step
        event = {"kind": "exception", **describe(error, self.model)}
        if self.world.distributed:
            event["rank"] = self.world.rank
        with contextlib.suppress(Exception):
            if self._first_anomaly is None:
                self._first_anomaly = n
            if self.world.is_main:
                self.writer.append_json(framelog.EVENT, n, event)
            else:  # (a peer's collective then fails too: rank 0 records that error, not this one)
                self.writer.append_rank_event(n, event)
            if self.on_anomaly is not None:
                self.on_anomaly(n, [event])

    def _anomalies(self, n: int, h: StepHealth) -> list[dict]:
        events = step_anomalies(h, self._spikes)
        if events and self._first_anomaly is None:
            self._first_anomaly = n
        return events

    def log_validation(self, **metrics: float) -> None:
        """Record validation metrics measured on the current state (the state in which step
        `next_step` starts, i.e. after `next_step` steps). Checkpoints a new best (keep_best).
        Distributed: call it on every rank; rank 0's values are the ones recorded."""
        self._settle()
        step = self.next_step
        clean = self.world.broadcast({k: float(v) for k, v in metrics.items()})
        if self.world.is_main:
            self.writer.append_json(framelog.VALIDATION, step, {"metrics": clean})
            if self.live is not None:
                self.live.validation(step, clean)
        value = clean.get(self.config.val_metric)
        if value is None or not math.isfinite(value):
            return
        if self._improves(value):
            self._best = (step, value)
            if self.config.keep_best and step not in self._ckpt_steps:
                self._checkpoint(step, "best")
                self._force_rng = True

    def _improves(self, value: float) -> bool:
        return self._best is None or (value < self._best[1] if self.config.val_mode == "min" else value > self._best[1])

    def checkpoint(self, reason: str = "manual") -> int:
        """Checkpoint the current state now (it becomes the state at `next_step`)."""
        self._settle()
        if self.next_step not in self._ckpt_steps:
            self._checkpoint(self.next_step, reason)
            self._force_rng = True
        return self.next_step

    def _checkpoint(self, step: int, reason: str) -> float:
        if self._in_step and self._pending_rng is None:
            # Mid-step (a validation between two micro-batches): the weights are those the step
            # began with, the RNG states are not. A replay can start here, so the step's batch,
            # not yet written, carries the states it began in.
            self._pending_rng = self._step_rng
        info = {
            "session": self.session,
            "reason": reason,
            "healthy": self._first_anomaly is None,
            "first_anomaly": self._first_anomaly,
        }
        if self._best is not None and self._best[0] == step:
            info["validation"] = {self.config.val_metric: self._best[1]}
        self._ckpt_steps.append(step)
        if self.world.sharded:  # FSDP: every rank writes its shards (DCP)
            t0 = time.perf_counter()
            self._finish_sharded()  # the previous one first (its commit is collective)
            state = capture_train_state(self.optimizer, self.scheduler, self.scaler)
            state.pop("optimizer")  # its tensors go into DCP; param_groups with them
            if self.config.async_sharded:  # staged to host memory now, written in the background
                self._pending = start_sharded_save(
                    self.run_dir, step, self.world, self.model, self.optimizer, state, info
                )
            else:
                save_sharded(self.run_dir, step, self.world, self.model, self.optimizer, state, info)
                if self.world.is_main:
                    apply_retention(self.run_dir, self.config.keep_last, *self._protected())
            return time.perf_counter() - t0
        if not self.world.is_main:  # replicated: rank 0's copy is everyone's (RNGs are per rank, in the batch log)
            return 0.0
        self._await_snapshot()
        captured = snapshot(step, self.model, self.optimizer, self.scheduler, self.scaler, info, live=self._live_ok)
        waited = self.writer.submit_checkpoint(captured, Retention(self.config.keep_last, self._protected))
        if captured.live:
            self._live_snap = captured
        return waited

    def _before_update(self) -> None:
        """The optimizer's step is about to change the tensors a live checkpoint is written
        from: it waits for each tensor's bytes as it comes to it (AwaitLiveBytes), or, when it
        updates them all at once, for the whole checkpoint."""
        self._drop_mode()  # (an optimizer's step that raised, called again)
        snap = self._live_snap
        if (
            snap is None
            or snap.released.is_set()
            or torch.compiler.is_compiling()
            or not per_tensor_updates(self.optimizer)
        ):
            return self._await_snapshot()
        snap.begin_update()
        self._bytes_mode = AwaitLiveBytes(snap)
        self._bytes_mode.__enter__()

    def _after_update(self) -> None:
        """The optimizer's step is over: the rest of the step may change tensors it did not
        touch (an EMA copy of the weights, another hook), so the whole write comes first. By
        now the optimizer has followed the writer to about its end."""
        if self._bytes_mode is not None:
            self._drop_mode()
            self._await_snapshot()

    def _drop_mode(self) -> None:
        """AwaitLiveBytes off, its wait counted. A mode the optimizer's step pushed and left
        above it (raising inside `with mode:` pops the top one, ours) keeps its place: ours
        then lets everything through where it is."""
        mode, self._bytes_mode = self._bytes_mode, None
        if mode is None:
            return
        mode.close()
        if torch.overrides._get_current_function_mode() is mode:
            mode.__exit__(None, None, None)
        self._ckpt_wait += mode.waited

    def _await_snapshot(self) -> None:
        """Before anything may change the tensors a live checkpoint is written from (the
        optimizer's step, the end of the step, the next checkpoint): wait for their bytes to
        be written. Usually long done; the wait counts in the step's `ckpt_wait`.

        A checkpoint whose tensors changed before they were written (in place, outside the
        optimizer's step) is not committed: it is taken again at the next step, and by copy
        from then on."""
        self._drop_mode()  # (an optimizer's step that raised left it on)
        snap, self._live_snap = self._live_snap, None
        if snap is None:
            return
        if not snap.released.is_set():
            t0 = time.perf_counter()
            snap.released.wait()
            self._ckpt_wait += time.perf_counter() - t0
        if snap.intact is False:
            if snap.step in self._ckpt_steps:
                self._ckpt_steps.remove(snap.step)
            self._retake, self._live_ok = True, False
            warnings.warn(
                f"{self.run_dir}: the checkpoint of step {snap.step} was not committed: a parameter or optimizer "
                "state changed in place while it was written (outside optimizer.step); it is taken again at the "
                "next step, and checkpoints copy the state from now on (ckpt_snapshot='copy')",
                stacklevel=2,
            )

    def _finish_sharded(self) -> float:
        """Commit the sharded checkpoint being written in the background, if any (every rank,
        at the same step: the commit is collective); the seconds waited for its write."""
        pending, self._pending = self._pending, None
        if pending is None:
            return 0.0
        waited = pending.finish()
        if self.world.is_main:
            apply_retention(self.run_dir, self.config.keep_last, *self._protected())
        return waited

    def _protected(self) -> tuple[set[int], tuple[int, int] | None]:
        keep = {self._best[0]} if self._best else set()
        a = self._first_anomaly
        if a is None:
            return keep, None
        healthy = max((s for s in self._ckpt_steps if s < a), default=None)
        if healthy is None:
            return keep, None
        return keep | {healthy}, (healthy, a)

    # --- end --------------------------------------------------------------------------------

    def flush(self) -> None:
        """Record the health still pending, and wait until every checkpoint handed to the
        background writer is committed."""
        self._settle()
        self.writer.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._exit_hook is not None:
            atexit.unregister(self._exit_hook)
        try:
            try:  # the last step's health (a non-finite loss there is recorded and warned of, not raised)
                self._settle(0, raise_nonfinite=False)
            finally:
                for hook in self._snap_hook or ():
                    hook.remove()
                self._await_snapshot()
                self.trainee.close()
                self._finish_sharded()
                self.writer.close()
                if self.live is not None:
                    self.live.close()
            if self.world.is_main and self.writer.failed is None:  # every frame is whole on disk:
                self.manifest["sessions"][-1]["closed"] = time.time()  # a torn tail now is damage
                self._write_manifest(self.manifest)
        finally:
            self._release_lock()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_WRITTEN = object()  # `_pending_rng` when the running step's batch is written (or none runs)


def _warn_anomaly(run_dir: str) -> Callable[[int, list[dict]], None]:
    """The default alert: one line on stderr per anomaly episode (steps more than 16 apart start
    a new one), naming what happened and the command that explains it."""
    last = [-(10**9)]

    def warn(step: int, events: list[dict]) -> None:
        quiet = step - last[0] <= ALERT_GAP
        last[0] = step
        if quiet:
            return
        from rich.console import Console
        from rich.markup import escape

        Console(stderr=True, highlight=False, soft_wrap=True).print(
            f"[yellow]ckptlab:[/yellow] {escape(alert_text(run_dir, step, events))}"
        )

    return warn


def _settle_at_exit(rec: Recorder) -> Callable[[], None]:
    """At interpreter exit (an uncaught exception, Ctrl-C between steps, sys.exit): record the
    health a deferred read still holds. Holds the Recorder weakly."""
    ref = weakref.ref(rec)

    def settle() -> None:
        r = ref()
        if r is not None and not r.closed:
            r._settle_quietly()

    return settle


def _plain_ids(ids) -> list:
    """Sample ids as a JSON list of ints/strings (a tensor or array of ids is accepted)."""
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    elif hasattr(ids, "tolist"):
        ids = ids.tolist()
    out = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, (int, str)):
            if hasattr(i, "item"):
                i = i.item()
            elif isinstance(i, bytes):
                i = i.decode("utf-8", "replace")
            else:
                i = str(i)
        out.append(i)
    return out
