"""What makes a run directory this Recorder's: the checks before anything is written, the
run's lock, the manifest (a new run's, or a resumed run's with one more session), and on
resume where the run stands (the next step, its checkpoints, its progress) with the state
restored from a checkpoint when asked.

From its start until `release()` the session holds the run's lock (RUN/.lock, run/lock.py;
in a distributed run, rank 0's): a second Recorder on the run, or a rollback, is refused with
RunLockedError naming this process. Inside torch.distributed every rank opens its session:
rank 0 writes the manifest; checks read the same disk on every rank, so every rank raises the
same error.
"""

from __future__ import annotations

import math
import os
import socket
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckptlab.errors import CkptlabError, RecordError
from ckptlab.record.config import RecordConfig
from ckptlab.run import codec
from ckptlab.run.archive import unfinished_rollback
from ckptlab.run.checkpoint import clean_stale, list_checkpoints
from ckptlab.run.layout import FORMAT_VERSION, MANIFEST, is_first_leftover, remove_new_entries
from ckptlab.run.lock import RunLock, RunLockedError, acquire
from ckptlab.run.manifest import new_manifest, read_manifest, write_manifest
from ckptlab.run.reader import Progress, read_progress
from ckptlab.run.writer import io_error
from ckptlab.training import fsdp1, userfns, zero
from ckptlab.training.optimizer_set import describe
from ckptlab.training.probe import named_parameters
from ckptlab.training.state import capture_env, is_compiled, restore_checkpoint
from ckptlab.training.world import World
from ckptlab.training.wrappers import torch_module, torch_optimizer


class Session:
    """This process's session of the run in `run_dir`: its number, the step it starts at,
    and on resume what the earlier sessions left (`checkpoints`, `progress`,
    `restored_step`). `fns`: the user's build_fn, step_fn and batch_fn (None when absent),
    described in the manifest. `training`: (model, optimizer, scheduler, scaler)."""

    def __init__(
        self,
        run_dir: Path,
        world: World,
        config: RecordConfig,
        training: tuple[torch.nn.Module, Any, Any, Any],
        fns: dict[str, Callable | None],
        *,
        deferred: bool,
    ):
        self.run_dir, self.world, self.config = run_dir, world, config
        self.training, self.fns, self.deferred = training, fns, deferred
        self.checkpoints: list[int] = []  # committed before this session
        self.progress: Progress | None = None  # the run so far, when resumed
        self.restored_step: int | None = None
        exists = (run_dir / MANIFEST).exists()
        if exists and not config.resume:
            raise RecordError(
                "already holds a run", path=run_dir, hint="pass resume=True to continue it, or choose a new directory"
            )
        if not exists and run_dir.exists() and any(not is_first_leftover(p.name) for p in run_dir.iterdir()):
            raise RecordError("exists and is not a ckptlab run; refusing to write into it", path=run_dir)
        world.barrier()  # nobody writes before every rank has checked
        # A first session that fails to start takes back what it wrote (`undo`).
        self._fresh, self._made_dir = not exists, not run_dir.exists()
        self._before = set(os.listdir(run_dir)) if run_dir.is_dir() else set()
        # One process records a run at a time, the lock taken before anything is written.
        self._lock: RunLock | None = None
        self._lock_run()
        try:
            self._start(exists)
        except BaseException:
            self.undo()
            raise

    def _lock_run(self) -> None:
        refused: tuple[str, Any] | None = None  # ("locked", the holder's dict) or ("error", the message)
        if self.world.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            try:
                self._lock = acquire(self.run_dir, "recorder")
            except RunLockedError as e:
                refused = ("locked", e.holder)
            except CkptlabError as e:
                refused = ("error", e.problem)
        refused = self.world.broadcast(refused)  # every rank raises if rank 0 was refused
        if refused is not None:
            self.release()
            kind, detail = refused
            if kind == "locked":
                raise RunLockedError(self.run_dir, detail)
            raise RecordError(detail, path=self.run_dir)

    def release(self) -> None:
        """Let go of the run's lock (a second call does nothing)."""
        if self._lock is not None:
            self._lock.release()

    def undo(self) -> None:
        """The Recorder failed to start: release the run, and if this was its first session,
        leave the directory as it was found (a resumed run keeps everything)."""
        if self._fresh and self.world.is_main and self._lock is not None and self._lock.held:
            remove_new_entries(self.run_dir, self._before)
        self.release()
        if self._fresh and self._made_dir and self.world.is_main:
            try:
                self.run_dir.rmdir()  # (only if empty: another process may have written since)
            except OSError:
                pass

    def _start(self, exists: bool) -> None:
        self._described = self._parameters()  # (collective in a pipeline)
        if self.world.is_main:
            if exists:
                clean_stale(self.run_dir)
            else:
                self.write_manifest(self._new_manifest())
        self.world.barrier()
        self.manifest = read_manifest(self.run_dir)
        self.start_step = self._resume() if exists else 0
        batch_fn = self.fns.get("batch_fn")
        if exists and batch_fn is not None:  # (a resumed run may add or change it)
            self.manifest.setdefault("functions", {})["batch_fn"] = userfns.describe(batch_fn, "batch_fn", self.run_dir)
        # This session writes segments of the current layout (an old run's manifest says so from now).
        self.manifest["format_version"] = max(self.manifest["format_version"], FORMAT_VERSION)
        self.number = len(self.manifest["sessions"])
        self.manifest["sessions"].append(
            {
                "session": self.number,
                "start_step": self.start_step,
                "started": time.time(),
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "restored_from": self.restored_step,
            }
        )
        self.world.barrier()  # every rank has read the manifest before rank 0 rewrites it
        if self.world.is_main:
            self.write_manifest(self.manifest)

    def write_manifest(self, manifest: dict) -> None:
        try:
            write_manifest(self.run_dir, manifest)
        except OSError as e:  # e.g. a full disk: one clear line, like every other failed write
            raise (io_error(e, "writing manifest.json", self.run_dir) or e) from None

    def mark_closed(self) -> None:
        """The session ended with every frame whole on disk: a torn tail from now on is damage."""
        self.manifest["sessions"][-1]["closed"] = time.time()
        self.write_manifest(self.manifest)

    def _parameters(self) -> tuple[list[dict], list[dict], int]:
        """The manifest's `parameters` and `optimizers`, and how many parameter groups there
        are: the model's, or a pipeline's stages' together, in stage order (collective: each
        rank describes its stage, with its groups numbered among all stages', one optimizer
        whose groups are every stage's)."""
        model, optimizer = self.training[0], self.training[1]
        params = named_parameters(model)
        # (one group each for its parameters, and with several optimizers whose groups are whose)
        optimizers, groups = describe(optimizer, [p for _, p in params]) if optimizer is not None else ([], [])
        shapes = fsdp1.full_shapes(torch_module(model))  # (the model's own shapes, not FSDP1's views into a shard)
        entries = [
            {
                "name": n,
                "shape": list(shapes.get(id(p)) or zero.shape_of(p)),
                "dtype": codec.dtype_name(p.dtype),
                "requires_grad": p.requires_grad,
                "group": group,
            }
            for (n, p), group in zip(params, groups or [None] * len(params))
        ]
        count = len(torch_optimizer(optimizer).param_groups) if optimizer is not None else 0
        stages = self.world.stages
        if stages is None:
            return entries, optimizers, count
        first = stages.group_slots[stages.stage][0]
        for e, group in zip(entries, groups or [None] * len(entries)):
            e["stage"], e["group"] = stages.stage, None if group is None else group + first
        every = self.world.gather_objects(entries)
        count = sum(n for _, n in stages.group_slots)
        whole = [{"key": None, "class": optimizers[0]["class"] if optimizers else "", "groups": list(range(count))}]
        return [e for part in every for e in part], whole, count

    def _new_manifest(self) -> dict:
        model, optimizer, scheduler, scaler = self.training
        params = named_parameters(model)
        first = params[0][1] if params else None
        parameters, optimizers, groups = self._described
        keys = ("ckpt_every", "health_every", "keep_last", "on_nonfinite", "val_metric", "val_mode")
        return new_manifest(
            device=str(first.device) if first is not None else "cpu",
            config={
                **{k: getattr(self.config, k) for k in keys},
                "has_scheduler": scheduler is not None,
                "step_scheduler": self.config.step_scheduler,
                "has_scaler": scaler is not None,
                "update_ratio": self.config.update_ratio,
                "health_read": "deferred" if self.deferred else "immediate",
                "ckpt_snapshot": self.config.ckpt_snapshot,
                "compiled": is_compiled(model) or is_compiled(self.fns["step_fn"]),
            },
            functions={
                name: userfns.describe(fn, name, self.run_dir) for name, fn in self.fns.items() if fn is not None
            },
            parameters=parameters,
            param_groups=groups,
            optimizers=optimizers,
            data_info=self.config.data_info or {},
            env=capture_env(),
            world_size=self.world.size,
            **({"data_ranks": list(self.world.data_ranks)} if self.world.data_ranks is not None else {}),
            layout="pipeline"
            if self.world.stages
            else "sharded"
            if self.world.sharded
            else "zero"
            if self.world.zero is not None
            else "replicated",
            backend=self.world.backend,
            **({"pipeline": self.world.stages.describe()} if self.world.stages else {}),
        )

    def _check_same_model(self) -> None:
        recorded = [(p["name"], list(p["shape"])) for p in self.manifest.get("parameters", [])]
        current = [(p["name"], list(p["shape"])) for p in self._described[0]]
        if recorded != current:
            diff = next(((a, b) for a, b in zip(recorded, current) if a != b), (len(recorded), len(current)))
            raise RecordError(f"the model differs from the recorded one ({diff[0]} vs {diff[1]})", path=self.run_dir)

    def _resume(self) -> int:
        """The next step of a resumed run; restores the state when asked (or rolled back)."""
        self._check_same_model()
        pending = unfinished_rollback(self.run_dir)
        if pending is not None:  # half the later steps moved: resuming now would mix timelines
            raise RecordError(
                f"a rollback into {pending.name} was interrupted",
                path=self.run_dir,
                hint=f"run `ckptlab rollback --run {self.run_dir}` again to finish it, then resume",
            )
        found, _ = list_checkpoints(self.run_dir)
        self.progress = read_progress(self.run_dir)
        self.checkpoints = [c.step for c in found]
        if not found:
            warnings.warn(
                f"{self.run_dir}: resuming a run that has no checkpoint; the model as given becomes the "
                "state of the first resumed step",
                stacklevel=4,
            )
        rollback = self.manifest.get("rollback")
        # The next step follows the last one recorded. A checkpoint can be one past it (taken at
        # a validation after the last step, or committed just before a kill hit its step).
        next_step = max(self.progress.last_step + 1, max(self.checkpoints, default=0))
        target, restore = None, self.config.restore
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
            restore_checkpoint(target, *self.training, self.world)
            self.restored_step = target.step
        return next_step

    def validation(self, metric: str) -> list[tuple[int, float]]:
        """(step, value) of `metric` at each finite validation of the earlier sessions."""
        found = self.progress.validation if self.progress is not None else []
        values = ((step, metrics.get(metric)) for step, metrics in found)
        return [(step, float(v)) for step, v in values if v is not None and math.isfinite(v)]
