"""The checkpoints a Recorder takes, and what keeps them exact.

Three ways to take one: *live* (a CPU model, `ckpt_snapshot="live"`: written in the background
from the parameters and the optimizer's state themselves, no copy; the optimizer's next step
waits for each tensor's bytes as it comes to it, through `AwaitLiveBytes`), *copy* (the state
copied off the device, then written in the background: run/checkpoint.py), *sharded* (FSDP,
pipeline stages: every rank writes its part through DCP, in the background unless
`async_sharded=False`, committed at the start of the next step; DeepSpeed ZeRO's partitions
alike: training/zero_parts.py). Retention runs after each commit, protecting the
best-validation checkpoint and the last healthy one before the first anomaly.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from ckptlab.errors import RecordError
from ckptlab.record.config import RecordConfig
from ckptlab.record.health import HealthLog
from ckptlab.run.checkpoint import CapturedState
from ckptlab.run.retention import apply_retention
from ckptlab.run.writer import Retention, RunWriter
from ckptlab.training import zero
from ckptlab.training.crash import call_through
from ckptlab.training.optimizer_set import OptimizerSet
from ckptlab.training.probe import StepProbe, learned
from ckptlab.training.sharded import PendingSave, save_sharded, save_tree, start_sharded_save, start_tree_save
from ckptlab.training.state import capture_train_state, snapshot
from ckptlab.training.world import World
from ckptlab.training.wrappers import torch_optimizer, torch_scheduler
from ckptlab.training.zero_parts import partition_tree


class Snapshots:
    """This session's checkpoints: the steps that have one (`steps`, earlier sessions'
    included), the best validation (`best`), the live checkpoint still being written, the
    sharded one still being committed, and `wait`: the seconds the running step waited for
    checkpoints (its record's `ckpt_wait`). `training`: (model, optimizer, scheduler, scaler)."""

    def __init__(
        self,
        writer: RunWriter,
        world: World,
        config: RecordConfig,
        training: tuple,
        health: HealthLog,
        probe: StepProbe | None = None,
    ):
        self.writer, self.world, self.config = writer, world, config
        model, optimizer, scheduler, self.scaler = training
        # (the torch objects inside a framework's wrappers: their hooks and state are the ones)
        self.model, self.optimizer, self.scheduler = model, torch_optimizer(optimizer), torch_scheduler(scheduler)
        if world.checkpoints_sharded and isinstance(self.optimizer, OptimizerSet):  # (DCP's state dicts take one)
            raise RecordError("several optimizers are not recorded under FSDP2 or pipeline stages yet")
        self.health = health
        self.probe = probe  # the recording's: what it learned goes with each checkpoint
        self.run_dir: Path = writer.run_dir
        self.steps: list[int] = []
        self.best: tuple[int, float] | None = None
        self.wait = 0.0
        self._retake = False  # a live checkpoint was torn: take one at the next step
        self._pending: PendingSave | None = None  # a sharded checkpoint being written in the background
        self._live: CapturedState | None = None  # a checkpoint written from live tensors
        self._mode: AwaitLiveBytes | None = None  # on during an optimizer step that follows it
        # Live checkpoints need the optimizer's step to wait for them (it is what changes the
        # tensors they are written from). Sharded ones go through DCP (staged copies).
        self._live_ok = (
            config.ckpt_snapshot == "live"
            and not world.checkpoints_sharded
            and not world.gathers_whole
            and world.is_main
            and hasattr(self.optimizer, "register_step_pre_hook")
        )
        self._hooks: tuple[RemovableHandle, ...] = ()
        if self._live_ok:
            self._hooks = (
                self.optimizer.register_step_pre_hook(lambda *_: self._before_update()),
                self.optimizer.register_step_post_hook(lambda *_: self._after_update()),
            )

    def new_best(self, step: int, value: float) -> bool:
        """A validation value at `step`: whether it is the best so far (then it is `best`)."""
        best = self.best
        if best is not None and (value >= best[1] if self.config.val_mode == "min" else value <= best[1]):
            return False
        self.best = (step, value)
        return True

    def retake_due(self) -> bool:
        """Whether a torn live checkpoint is to be taken again now (asked once per step)."""
        retake, self._retake = self._retake, False
        return retake

    def take(self, step: int, reason: str, session: int) -> float:
        """Checkpoint the current state as the state at `step`; the seconds the step waited."""
        a = self.health.first_anomaly
        info = {"session": session, "reason": reason, "healthy": a is None, "first_anomaly": a}
        if self.probe is not None:  # what a replay from here takes up (training/probe.py `learned`)
            info["probe"] = learned(self.probe)
        if self.best is not None and self.best[0] == step:
            info["validation"] = {self.config.val_metric: self.best[1]}
        self.steps.append(step)
        if self.world.checkpoints_sharded:  # FSDP, pipeline stages: every rank writes its part (DCP)
            return self._take_sharded(step, info)
        if self.world.zero is not None:  # DeepSpeed ZeRO: every rank writes its partitions (DCP)
            return self._take_zero(step, info)
        if not self.world.is_main:  # replicated: rank 0's copy is everyone's (RNGs are per rank, in the batch log)
            return 0.0
        self.await_write()
        captured = snapshot(step, self.model, self.optimizer, self.scheduler, self.scaler, info, live=self._live_ok)
        waited = self.writer.submit_checkpoint(captured, Retention(self.config.keep_last, self._protected))
        if captured.live:
            self._live = captured
        return waited

    def _take_sharded(self, step: int, info: dict) -> float:
        t0 = time.perf_counter()
        self.finish_sharded()  # the previous one first (its commit is collective)
        state = capture_train_state(self.optimizer, self.scheduler, self.scaler)
        state.pop("optimizer")  # its tensors go into DCP; param_groups with them
        args = (self.run_dir, step, self.world, self.model, self.optimizer, state, info)
        if self.config.async_sharded:  # staged to host memory now, written in the background
            self._pending = start_sharded_save(*args)
        else:
            save_sharded(*args)
            if self.world.is_main:
                apply_retention(self.run_dir, self.config.keep_last, *self._protected())
        return time.perf_counter() - t0

    def _take_zero(self, step: int, info: dict) -> float:
        """Every rank writes its own partitions through DCP (training/zero_parts.py), as
        FSDP2's ranks write their shards: staged now, written in the background unless
        `async_sharded=False`, committed at the next step."""
        t0 = time.perf_counter()
        self.finish_sharded()  # the previous one first (its commit is collective)
        engine = zero.engine_of(self.model)
        zero.check_step_boundary(engine, step)
        tree, main = partition_tree(self.world, engine, copy=self.config.async_sharded)
        main.update(capture_train_state(None, self.scheduler, self.scaler), deepspeed=zero.counters(engine))
        args = (self.run_dir, step, self.world, tree, main, info)
        if self.config.async_sharded:
            self._pending = start_tree_save(*args, staged=True)  # (copied: DCP need not stage it)
        else:
            save_tree(*args)
            if self.world.is_main:
                apply_retention(self.run_dir, self.config.keep_last, *self._protected())
        return time.perf_counter() - t0

    def _before_update(self) -> None:
        """The optimizer's step is about to change the tensors a live checkpoint is written
        from: it waits for each tensor's bytes as it comes to it (AwaitLiveBytes), or, when it
        updates them all at once, for the whole checkpoint."""
        self._drop_mode()  # (an optimizer's step that raised, called again)
        snap = self._live
        if (
            snap is None
            or snap.released.is_set()
            or torch.compiler.is_compiling()
            or not per_tensor_updates(self.optimizer)
        ):
            return self.await_write()
        snap.begin_update()
        self._mode = AwaitLiveBytes(snap)
        self._mode.__enter__()

    def _after_update(self) -> None:
        """The optimizer's step is over: the rest of the step may change tensors it did not
        touch (an EMA copy of the weights, another hook), so the whole write comes first. By
        now the optimizer has followed the writer to about its end."""
        if self._mode is not None:
            self._drop_mode()
            self.await_write()

    def _drop_mode(self) -> None:
        """AwaitLiveBytes off, its wait counted. A mode the optimizer's step pushed and left
        above it (raising inside `with mode:` pops the top one, ours) keeps its place: ours
        then lets everything through where it is."""
        mode, self._mode = self._mode, None
        if mode is None:
            return
        mode.close()
        if torch.overrides._get_current_function_mode() is mode:
            mode.__exit__(None, None, None)
        self.wait += mode.waited

    def await_write(self) -> None:
        """Before anything may change the tensors a live checkpoint is written from (the
        optimizer's step, the end of the step, the next checkpoint): wait for their bytes to
        be written. Usually long done; the wait counts in the step's `ckpt_wait`.

        A checkpoint whose tensors changed before they were written (in place, outside the
        optimizer's step) is not committed: it is taken again at the next step, and by copy
        from then on."""
        self._drop_mode()  # (an optimizer's step that raised left it on)
        snap, self._live = self._live, None
        if snap is None:
            return
        if not snap.released.is_set():
            t0 = time.perf_counter()
            snap.released.wait()
            self.wait += time.perf_counter() - t0
        if snap.intact is False:
            if snap.step in self.steps:
                self.steps.remove(snap.step)
            self._retake, self._live_ok = True, False
            warnings.warn(
                f"{self.run_dir}: the checkpoint of step {snap.step} was not committed: a parameter or optimizer "
                "state changed in place while it was written (outside optimizer.step); it is taken again at the "
                "next step, and checkpoints copy the state from now on (ckpt_snapshot='copy')",
                stacklevel=2,
            )

    def finish_sharded(self) -> float:
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
        """What retention keeps besides the last `keep_last`: the best-validation checkpoint,
        and the last healthy one before the first anomaly (with that anomaly's step)."""
        keep = {self.best[0]} if self.best else set()
        a = self.health.first_anomaly
        if a is None:
            return keep, None
        healthy = max((s for s in self.steps if s < a), default=None)
        if healthy is None:
            return keep, None
        return keep | {healthy}, (healthy, a)

    def close(self) -> None:
        """The session ends: no more waiting in the optimizer's step; every write finished."""
        for hook in self._hooks:
            hook.remove()
        self.await_write()
        self.finish_sharded()


class AwaitLiveBytes(TorchFunctionMode):
    """Around the optimizer's step while a live checkpoint is still being written from its
    tensors: an op that changes a live tensor (or hands out its memory) waits for that
    tensor's bytes alone, not for the whole checkpoint; reads go on (the writer only reads).
    A CPU optimizer updates one parameter at a time (AdamW: the parameter, then its two
    moments), so it follows the writer instead of waiting for all of it: on the
    250M-parameter MLP of scripts/bench_record.py the write takes ~1.5 s longer than the
    forward and backward passes, and the optimizer's step ~2 s (docs/performance.md). An op
    over all the tensors at once (foreach, fused) waits for all of them, as before. Tensors
    are told apart by their storage, so a view into a live tensor counts as it. `waited`:
    seconds waited. `close()` makes it let everything through, for good."""

    def __init__(self, captured: CapturedState):
        super().__init__()
        self.captured: CapturedState | None = captured
        self.waited = 0.0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        captured = self.captured
        if captured is not None and not captured.released.is_set() and _changes_memory(func, kwargs):
            ptrs = _storage_ptrs((*args, *kwargs.values()))
            if captured.unwritten(ptrs):
                t0 = time.perf_counter()
                captured.wait_copied(ptrs)
                self.waited += time.perf_counter() - t0
        return call_through(func, *args, **kwargs)

    def close(self) -> None:
        self.captured = None


# What, besides in-place ops (`mul_`, `_foreach_add_`: names ending in one underscore) and
# `out=`, may change a tensor's memory or let code outside torch change it.
_CHANGES_MEMORY = frozenset(
    f"__i{op}__" for op in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor")
) | {"__ilshift__", "__irshift__", "__setitem__", "numpy", "data_ptr", "untyped_storage", "storage", "__dlpack__"}


def _changes_memory(func, kwargs) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in _CHANGES_MEMORY or "out" in kwargs


def _storage_ptrs(values) -> list[int]:
    """Where the storage of each tensor among `values` (or in a list or tuple there) starts."""
    ptrs = []
    for v in values:
        for t in v if isinstance(v, (list, tuple)) else (v,):
            if isinstance(t, torch.Tensor):
                try:
                    ptrs.append(t.untyped_storage().data_ptr())
                except (RuntimeError, NotImplementedError):  # no storage of its own (a wrapper subclass)
                    pass
    return ptrs


def per_tensor_updates(optimizer) -> bool:
    """Whether the optimizer's step updates its parameters one at a time through torch's
    Python API, so that AwaitLiveBytes lets it start early: one of torch.optim's own, neither
    foreach nor fused (torch's default for CPU tensors). Another optimizer may change the
    tensors by other means (a C++ kernel given their memory, another thread) that the mode
    cannot see: its step waits for the whole checkpoint."""
    module = type(optimizer).__module__
    return (module == "torch.optim" or module.startswith("torch.optim.")) and not any(
        g.get("foreach") or g.get("fused") for g in optimizer.param_groups
    )
