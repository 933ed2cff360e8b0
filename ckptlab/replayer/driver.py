"""The replay driver: rebuild the recorded training, restore a checkpoint, re-run recorded steps.

    r = Replayer(run)                        # imports the recorded build_fn / step_fn
    t = r.build()                            # a StepRunner: model, optimizer, scheduler, scaler
    r.load_checkpoint(t, 500)                # every state that changes bits, env included
    health = r.run_step(t, r.batch(500))     # the recorded step, measured as the Recorder did
    r.close(t)

Knows nothing about faults or verdicts (investigation.py and blame.py judge what it replays).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable
from typing import Any, cast

import torch

from ckptlab.analysis.anomalies import RECORD_WARNINGS, record_warning_note
from ckptlab.errors import CorruptFileError, IntegrityError, RecordError, ReplayError
from ckptlab.run.manifest import OptimizerGroups
from ckptlab.run.reader import Run
from ckptlab.run.records import batch_digest
from ckptlab.training import userfns, zero
from ckptlab.training.hand_update import HandUpdate
from ckptlab.training.health import StepHealth
from ckptlab.training.optimizer_set import given_several
from ckptlab.training.probe import resume_learned
from ckptlab.training.state import (
    apply_env,
    capture_train_state,
    is_compiled,
    is_grad_scaler,
    restore_checkpoint,
    restore_rng,
    restore_snapshot,
    snapshot,
    whole_snapshot,
)
from ckptlab.training.step import StepRunner
from ckptlab.training.world import World
from ckptlab.training.wrappers import torch_module


class Replayer:
    """Rebuilds and drives the recorded training; knows nothing about verdicts.

    Imports the recorded build_fn/step_fn only when they are the user's own code, unchanged
    since recording, or with `trust_code=True` (training/userfns.py: `trusted_file`)."""

    def __init__(
        self,
        run: Run,
        *,
        device: str | None = None,
        log: Callable[[str], None] | None = None,
        rank: int = 0,
        trust_code: bool = False,
    ):
        self.run = run
        self.rank = rank  # whose batches (and RNG states) to replay
        self.world: World | None = None
        self.log = log or (lambda msg: None)
        self.notes: list[str] = []
        self._lr_noted = False  # (follow_lr's note, once)
        manifest = run.manifest
        recorded_device = str(manifest.get("device", "cpu"))
        self.device = torch.device(device) if device else torch.device(recorded_device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise no_cuda(run, self.device, torch.device(recorded_device))
        if self.device.type != torch.device(recorded_device).type:
            self.notes.append(
                f"recorded on {recorded_device}, replaying on {self.device}: losses will not match bit for bit"
            )
        fns = manifest.get("functions", {})
        if "build_fn" not in fns or "step_fn" not in fns:
            raise ReplayError("the manifest does not name build_fn/step_fn", path=run.path)
        loaded = {}
        with user_output():
            for role in ("build_fn", "step_fn"):
                loaded[role], unchanged = userfns.load(fns[role], role, run.path, trust=trust_code)
                if not unchanged:  # only with the opt-in
                    self.notes.append(
                        f"{role} is not the recorded code (source changed since recording, or missing here: "
                        f"{fns[role].get('file')}); replay may not match"
                    )
                elif userfns.layout_only(fns[role], run.path):  # the same tokens: the recorded code
                    note = (
                        f"{fns[role].get('file')} changed since recording only in comments, blank lines or "
                        "formatting: replayed as the recorded code (line numbers are today's)"
                    )
                    if note not in self.notes:  # build_fn and step_fn in one file: said once
                        self.notes.append(note)
        self.build_fn, self.step_fn = loaded["build_fn"], loaded["step_fn"]
        # What the Recorder warned of its own record (an optimizer that did not train): the
        # reason a replay leaves the record, said as a note (replayer/verdict.py reads it).
        self.notes += [record_warning_note(e) for e in run.events() if e.get("kind") in RECORD_WARNINGS]
        self.batch_fn = None  # imported at the first batch stored by reference
        self.trust_code = trust_code
        # A pipeline's rank 0 explaining the root step: what it builds, loads, restores and
        # replays, every stage does with it (replayer/pipeline.py `Mirror`).
        self.mirror: Any = None
        self.fold: Any = None  # replayer/fold.py: every rank's turn at each step, in this process
        config = manifest.get("config", {})
        self.has_scheduler = bool(config.get("has_scheduler"))
        self.step_scheduler = bool(config.get("step_scheduler", True))
        self.has_scaler = bool(config.get("has_scaler"))
        self.compiled: bool | None = None  # the model build_fn returns (or step_fn) is compiled
        # Measured as recorded, so replayed update ratios compare (runs before the option: exact).
        self.update_ratio = str(config.get("update_ratio", "exact"))

    # --- building and restoring ----------------------------------------------------------------

    def build(self) -> StepRunner:
        if self.mirror is not None:
            self.mirror.order("build")
        t = self._build()
        if self.mirror is not None:
            self.mirror.built(t)
        if self.fold is not None:
            self.fold.built(t)
        return t

    def _build(self) -> StepRunner:
        if self.device.type == "cuda":
            apply_env({}, force_deterministic=True)  # before any CUDA work: cuBLAS reads it once
        with user_output():
            built = self.build_fn()
        if isinstance(built, torch.nn.Module):  # a loop that updates the weights by hand
            built = (built, None)
        if not isinstance(built, (tuple, list)) or len(built) < 2:
            raise ReplayError(
                "build_fn must return (model, optimizer[, scheduler]), or the model alone for a loop that "
                "updates the weights by hand",
                path=self.run.path,
            )
        given, optimizer = built[0], built[1]
        model = torch_module(given)  # (a pipeline's schedule: its stage's module; step_fn gets the schedule)
        if optimizer is None:  # its learning rate comes from the checkpoint, then from the record
            optimizer = HandUpdate(model.parameters())
        self._check_optimizers(optimizer)
        # After them, in any order: an LR scheduler and a GradScaler (told apart by type).
        extras = [x for x in built[2:] if x is not None]
        scaler = next((x for x in extras if is_grad_scaler(x)), None)
        scheduler = next((x for x in extras if not is_grad_scaler(x)), None)
        if self.has_scheduler and scheduler is None:
            raise ReplayError(
                "the run was recorded with an LR scheduler, but build_fn returns none",
                path=self.run.path,
                hint="return (model, optimizer, scheduler) from build_fn",
            )
        if self.has_scaler and scaler is None:
            raise ReplayError(
                "the run was recorded with a GradScaler, but build_fn returns none",
                path=self.run.path,
                hint="return (model, optimizer, scheduler or None, scaler) from build_fn; with Lightning's "
                '16-mixed: ckptlab.integrations.lightning.build(module, precision="16-mixed")',
            )
        model.to(self.device)
        if self.world is None:  # once: in a distributed replay, detecting creates a group
            self.world = World.detect(given, optimizer)  # (`--rank R` of an FSDP2 run: a group of one, sharded)
        self.compiled = is_compiled(model) or is_compiled(self.step_fn)
        try:
            return StepRunner(
                given,
                optimizer,
                scheduler,
                scaler,
                step_scheduler=self.step_scheduler,
                world=self.world,
                update_ratio=self.update_ratio,
            )
        except RecordError as e:  # (optimizers and schedulers in shapes that do not match)
            raise ReplayError(f"build_fn returns {e.problem}", path=self.run.path, hint=e.hint) from None

    def _check_optimizers(self, optimizer) -> None:
        """build_fn returns the optimizers the run was recorded with: one alone, or several in
        a list or a dict with the recorded keys (training/optimizer_set.py)."""
        recorded = OptimizerGroups.of(self.run.manifest)
        several = given_several(optimizer)
        keys = list(optimizer) if isinstance(optimizer, dict) else list(range(len(optimizer))) if several else [None]
        if recorded.several == several and (not several or keys == recorded.keys):
            return
        said = f"optimizers {recorded.keys}" if recorded.several else "one optimizer"
        raise ReplayError(
            f"the run was recorded with {said}, but build_fn returns " + (f"optimizers {keys}" if several else "one"),
            path=self.run.path,
            hint="return the optimizers as the Recorder was given them: (model, optimizers[, schedulers])",
        )

    def load_checkpoint(self, t: StepRunner, step: int) -> None:
        if self.mirror is not None:
            self.mirror.order("load", t, step)
        ckpt = self.run.checkpoint(step)
        try:
            ckpt.verify()
        except IntegrityError as e:
            older = [c for c in self.run.checkpoints if c < step]
            hint = (
                f"replay from an older one: --from-step {older[-1]}" if older else "no older checkpoint to start from"
            )
            raise IntegrityError(f"checkpoint {step} is damaged: {e.problem}", path=e.path, hint=hint) from None
        try:
            state = restore_checkpoint(ckpt, t.model, t.optimizer, t.scheduler, t.scaler, self.world)
        except (ValueError, KeyError, RuntimeError) as e:
            raise ReplayError(
                f"checkpoint {step} does not fit the model build_fn returns: {e}",
                path=ckpt.path,
                hint="replay with the code the run was recorded with",
            ) from None
        self.notes.extend(apply_env(state.get("env", {}), force_deterministic=self.device.type == "cuda"))
        if self.fold is not None:
            self.fold.loaded()
        if not t.stepped and self.fold is None and buckets_rebuilt(self.run, self.world, ckpt):
            rebuild_buckets(self, t, step)
        resume_learned(t.probe, ckpt.commit.get("probe"))  # measure as the recording did from here
        self.follow_lr(t.optimizer, step)

    def batch(self, step: int, rank: int | None = None):
        """Step `step`'s batch record (of this replayer's rank, or `rank`), on the replay's device."""
        rec = self.run.batch_record(step, self.rank if rank is None else rank)
        if rec.ref is not None:
            rec.batch = self.rebuild(rec)
        rec.batch = _to_device(rec.batch, self.device)
        return rec

    def rebuild(self, rec):
        """A batch stored by reference: `batch_fn(sample_ids, step)`, the recorded function,
        proven to be the recorded batch by its sha256."""
        if self.batch_fn is None:
            desc = self.run.manifest.get("functions", {}).get("batch_fn")
            if desc is None:
                raise ReplayError(
                    f"step {rec.step}'s batch was stored by reference, but the manifest names no batch_fn",
                    path=self.run.path,
                )
            with user_output():
                self.batch_fn, unchanged = userfns.load(desc, "batch_fn", self.run.path, trust=self.trust_code)
            if not unchanged:
                self.notes.append(f"batch_fn is not the recorded code ({desc.get('file')}); its batches are checked")
        with user_output():
            batch = self.batch_fn(rec.sample_ids, rec.step)
        digest = batch_digest(batch)
        if digest != rec.ref["sha256"]:
            raise ReplayError(
                f"batch_fn rebuilt a different batch for step {rec.step} (sha256 {digest[:12]}, recorded "
                f"{rec.ref['sha256'][:12]})",
                path=self.run.path,
                hint="batch_fn(sample_ids, step) must return exactly the batch that step trained on: "
                "the same data, transforms and random seeds",
            )
        return batch

    def run_step(self, t: StepRunner, rec, batch=None, *, tracer=None, measure_update: bool = True) -> StepHealth:
        """One recorded step (or `batch` in its place), exactly as the Recorder ran it: its
        RNG states restored, then the same measured step (training/step.py).
        `measure_update` measures update ratios and weight norms, as the run recorded them."""
        if self.mirror is not None:  # (every stage runs it, and traces it when this one does)
            return self.mirror.step(t, rec, batch, tracer, measure_update, self.run_here)
        if self.fold is not None:  # (the recorded batches only: experiments run in a process group of one)
            assert batch is None and tracer is None, "a fold replays the recorded steps"
            return self.fold.step(t, rec, self.run_here, measure_update)
        return self.run_here(t, rec, batch, tracer, measure_update)

    def run_here(self, t: StepRunner, rec, batch, tracer, measure_update: bool) -> StepHealth:
        """`run_step` in this process alone."""
        if rec.rng is not None:
            try:
                restore_rng(rec.rng)
            except (ValueError, TypeError, KeyError) as e:  # a malformed record (a CUDA error stays itself)
                raise CorruptFileError(
                    f"step {rec.step}'s recorded RNG states cannot be restored ({type(e).__name__}: {e}); "
                    "its batch record is damaged",
                    path=self.run.path,
                ) from None
        batch = rec.batch if batch is None else batch
        t.stepped = True
        _, health = t.run_step(self.step_fn, batch, measure_update=measure_update, around=_around_step(tracer))
        self.follow_lr(t.optimizer, rec.step + 1)
        return cast(StepHealth, health)  # not deferred: measured now, never a PendingHealth

    def follow_lr(self, optimizer, step: int) -> None:
        """The learning rate is the loop's to change between steps, outside the recorded step
        (`update.lr /= 4` after an epoch, nanoGPT's `param_group['lr'] = get_lr(it)`, a
        scheduler a resumed script built anew): before step `step`, each parameter group gets
        the rate the record says that step ran with, where the record knows it (a scheduler's
        or step_fn's own: the same number). Set between steps, as the loop does, so a snapshot
        of the step's state holds it and a counterfactual that changes it keeps its own. A rate
        held as a tensor (a capturable optimizer's) is left alone. The first time the record's
        differs from the state's, a note says so (not for a hand-written update)."""
        m = self.run.metrics()
        i = m.index(step)
        if i is None:
            return
        stages = self.world.stages if self.world is not None else None
        first = stages.group_slots[stages.stage][0] if stages is not None else 0  # (a pipeline: its stage's groups)
        for g, (group, lr) in enumerate(zip(optimizer.param_groups, m.lr[i][first:])):
            now = group.get("lr")
            if not math.isfinite(lr) or not isinstance(now, (int, float)) or now == lr:
                continue
            group["lr"] = float(lr)
            if not self._lr_noted and not isinstance(optimizer, HandUpdate):
                self._lr_noted = True
                self.notes.append(
                    f"step {step} ran with learning rate {lr:.6g} (group {g}), not the {now:.6g} the replayed state "
                    "gives: replay follows the record (a loop that sets the learning rate outside step_fn, or a "
                    "scheduler that was not restored when the run resumed)"
                )

    def snapshot(self, t: StepRunner, step: int):
        """The state `step` starts in. Sharded training (FSDP2, ZeRO): collective, whole on rank 0
        only (in a process group of one too: DTensors, which only DCP's state-dict API takes
        whole; ZeRO's partitions, which DeepSpeed's API gathers). A fold's: every rank's RNG streams."""
        if self.fold is not None:
            return self.fold.snapshot(t, step)
        if self.world is not None and self.world.sharded:
            return whole_snapshot(self.world, step, t.model, t.optimizer, t.scheduler, t.scaler)
        if self.world is not None and self.world.zero is not None:  # DeepSpeed ZeRO: likewise
            state = capture_train_state(None, t.scheduler, t.scaler)
            return zero.snapshot(self.world, step, zero.engine_of(t.model), state)
        return snapshot(step, t.model, t.optimizer, t.scheduler, t.scaler)

    def restore(self, t: StepRunner, snap) -> None:
        """Put `t` back in the state of `snap` (a snapshot this rank took: its own RNG streams
        from a sharded run's). A pipeline's other stages restore theirs of the root step."""
        if self.mirror is not None:
            self.mirror.order("restore", t)
        restore_snapshot(snap, t.model, t.optimizer, t.scheduler, t.scaler, rank=self.rank)

    def set_lr(self, t: StepRunner, group: int, lr: float) -> None:
        """Parameter group `group` (its index in every step's `lr`: in a pipeline, among every
        stage's groups, and set by the stage that holds it) gets learning rate `lr`."""
        if self.mirror is not None:
            self.mirror.order("lr", t, group, lr)
        stages = self.world.stages if self.world is not None else None
        first = stages.group_slots[stages.stage][0] if stages is not None else 0
        if 0 <= group - first < len(t.optimizer.param_groups):
            t.optimizer.param_groups[group - first]["lr"] = lr

    def close(self, t: StepRunner) -> None:
        if self.mirror is not None:
            self.mirror.order("close", t)
        t.close()


def buckets_rebuilt(run: Run, w: World | None, ckpt) -> bool:
    """Whether the recorded step `ckpt` starts ran with DDP's gradient buckets rebuilt, as
    they are from a DistributedDataParallel's second iteration on: laid out in the order
    its first backward made the gradients ready, not in the parameters' order. Over more
    than two processes the layout decides the bits: a ring all-reduce sums each chunk of a
    bucket starting at another rank. So it was when the checkpoint is not the first step
    of the session that wrote it (a fresh process: a fresh DDP); only a replicated world
    of more than two processes has buckets whose layout changes a sum."""
    if w is None or w.size <= 2 or w.gathers_whole or w.stages is not None or w.data_ranks is not None:
        return False
    sessions = {s.get("session"): s.get("start_step") for s in run.manifest.get("sessions", [])}
    start = sessions.get(ckpt.commit.get("session"))
    return isinstance(start, int) and ckpt.step > start


def rebuild_buckets(r: Replayer, t: StepRunner, step: int) -> None:
    """Run step `step` once and put its state back (RNGs included), gradients dropped as a
    freshly loaded checkpoint has none: DDP's next forward, the replayed step's, rebuilds
    the buckets in the order this backward made the gradients ready, as the recording's
    did after its first step. Every rank does it (it is collective)."""
    snap = r.snapshot(t, step)
    r.log(f"rebuilding DDP's gradient buckets with step {step}, as the recording had them")
    r.run_here(t, r.batch(step), None, None, False)
    r.restore(t, snap)
    for p in t.model.parameters():
        p.grad = None


@contextlib.contextmanager
def _around_step(tracer):
    """What surrounds `step_fn` in a replayed step: the user's prints to stderr, and the tracer,
    entered only once the probe has begun the step (none of the probe's own ops is traced)."""
    with user_output(), tracer if tracer is not None else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def user_output():
    """The user's Python-level prints go to stderr: stdout is ours. This is what covers a
    replay driven from Python (`ckptlab.replay` in a notebook or a script); the CLI's `--json`
    holds stdout for the whole command at the file-descriptor level (render/console.py
    `StdoutClaim`), which also covers C code and child processes."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _to_device(obj, device: torch.device):
    if device.type == "cpu":
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
        return type(obj)(*[_to_device(v, device) for v in obj])
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def no_cuda(run: Run, device: torch.device, recorded: torch.device) -> ReplayError:
    """Replay on CUDA asked for where CUDA is not available: why not, and what to do, which
    depends on where the run was recorded: a CPU run replays on the CPU as it is."""
    why = (
        f"this PyTorch ({torch.__version__}) is built without CUDA"
        if torch.version.cuda is None
        else "no CUDA GPU is visible"
    )
    hint = (
        "the run was recorded on the CPU: replay it there, without --device or with --device cpu"
        if recorded.type == "cpu"
        else f"the run was recorded on {recorded}: replay it on a machine with a GPU, or pass --device cpu, "
        "which is not bit-exact for a GPU run"
    )
    return ReplayError(f"replay on {device} asked for, but CUDA is not available here: {why}", path=run.path, hint=hint)
