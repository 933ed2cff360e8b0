"""FSDP2 (`fully_shard`) training state in and out of the live, sharded model.

    save_sharded(run_dir, step, world, model, optimizer, train_state, info)   # collective
    pending = start_sharded_save(run_dir, step, world, model, optimizer, ...)  # staged, then
    pending.finish()                                                           # commit later
    load_sharded(checkpoint, model, optimizer, train_state)                   # collective
    snap = full_snapshot(world, step, model, optimizer, train_state)           # whole, on rank 0
    set_full(model, optimizer, model_sd, optim_sd)                             # whole -> any model

A pipeline's stages (training/pipeline.py) are saved and loaded alike: each rank's state dict
holds its stage's whole tensors under the whole model's names, so together they are the model's
(DCP writes each key once), and the optimizer's `param_groups` of every stage go into the main
state file, each rank loading the groups of its own parameters.

`save_sharded` writes on the training thread (the training stalls for the write).
`start_sharded_save` stalls only for DCP's collective planning and the copy of each rank's
shards to host memory (`dcp.async_save`); the files are written and hashed in the background,
and `finish()`, called by every rank at the same later step, commits them. The folder
and its atomic commit are run/sharded.py's.

Reading never unpickles: DCP's `.metadata` goes through ckptlab.io.dcp's allowlist unpickler
(torch's own reader uses plain pickle), tensors through torch.load(weights_only=True), and
the non-tensor optimizer state (param_groups) is kept out of DCP, in our own state file.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckptlab.errors import RecordError
from ckptlab.io.dcp import safe_planner, safe_reader
from ckptlab.run import codec
from ckptlab.run import sharded as on_disk
from ckptlab.run.checkpoint import CapturedState
from ckptlab.run.layout import DCP_DIR
from ckptlab.training import fsdp1
from ckptlab.training.world import local


def _dcp():
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict as sd

    return dcp, sd


def save_sharded(run_dir: Path, step: int, world, model, optimizer, train_state: dict, info: dict) -> None:
    """Every rank calls this; rank 0 commits. `train_state`: scheduler/scaler/rng/env (rank 0's)."""
    tree, groups = _tree(world, model, optimizer)
    save_tree(run_dir, step, world, tree, {**train_state, "param_groups": groups}, info)


def save_tree(run_dir: Path, step: int, world, tree: dict, main_state: dict, info: dict) -> None:
    """Write every rank's part of `tree` (DCP's state dict: "model", "optim") on the training
    thread and commit it; `main_state` (rank 0's) goes into state.safetensors. Collective."""
    dcp, _ = _dcp()
    tmp = on_disk.temp_folder(run_dir, step, info.get("session", 0))
    if world.is_main:
        on_disk.prepare(tmp)
    world.barrier()
    try:
        dcp.save(tree, storage_writer=dcp.FileSystemWriter(tmp / DCP_DIR, sync_files=True))
        mine = on_disk.rank_files(tmp, world.rank)
        if world.is_main:
            mine.update(on_disk.write_main_files(tmp, step, main_state))
        files: dict = {}
        for part in world.gather_objects(mine):
            files.update(part)
        if world.is_main:
            on_disk.commit(tmp, step, files, info, world.size)
    except BaseException:
        if world.is_main:
            on_disk.abandon(tmp)
        raise
    world.barrier()


class PendingSave:
    """A sharded checkpoint being written in the background (`start_sharded_save`): the state
    was staged to host memory before training went on; `finish()`, which every rank calls at
    the same step, waits for the write and commits it (collective). Each rank hashes its own
    shards on the writing thread as soon as they are written."""

    def __init__(self, world, run_dir: Path, step: int, tmp: Path, info: dict, main_state: dict, future):
        self.world, self.run_dir, self.step, self.tmp, self.info = world, run_dir, step, tmp, info
        self._main_state = main_state
        self._files: dict | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        future.add_done_callback(self._written)

    def _written(self, future) -> None:
        try:
            future.result()
            self._files = on_disk.rank_files(self.tmp, self.world.rank)
            if self.world.is_main:
                self._files.update(on_disk.write_main_files(self.tmp, self.step, self._main_state))
        except BaseException as e:  # noqa: BLE001 - raised again by finish(), on the training thread
            self._error = e
        finally:
            self._done.set()

    def finish(self) -> float:
        """Wait for this rank's write, gather every rank's file records, commit (rank 0).
        Returns the seconds this rank waited for its write."""
        t0 = time.perf_counter()
        self._done.wait()
        waited = time.perf_counter() - t0
        failed = self.world.gather_objects(repr(self._error) if self._error is not None else None)
        parts = self.world.gather_objects(self._files or {})
        try:
            if any(failed):
                raise RecordError(
                    f"the background write of sharded checkpoint {self.step} failed: "
                    + "; ".join(f"rank {r}: {e}" for r, e in enumerate(failed) if e),
                    path=self.tmp,
                )
            if self.world.is_main:
                files: dict = {}
                for part in parts:
                    files.update(part)
                on_disk.commit(self.tmp, self.step, files, self.info, self.world.size)
        except BaseException:
            if self.world.is_main:
                on_disk.abandon(self.tmp)
            raise
        return waited


def start_sharded_save(run_dir: Path, step: int, world, model, optimizer, train_state: dict, info: dict) -> PendingSave:
    """Every rank calls this at the same step: DCP's collective planning and the copy of this
    rank's shards to host memory happen now; the write runs in the background, on a process
    group of its own (`World.checkpoint_group`). Commit with `PendingSave.finish()`."""
    tree, groups = _tree(world, model, optimizer)
    return start_tree_save(run_dir, step, world, tree, {**train_state, "param_groups": groups}, info)


def start_tree_save(
    run_dir: Path, step: int, world, tree: dict, main_state: dict, info: dict, *, staged: bool = False
) -> PendingSave:
    """`save_tree`, written in the background (collective). DCP stages `tree` to host memory
    first (`async_save`); a `staged` tree, already a copy of its own, is written as it is, by
    `dcp.save` on a thread of ours (what `async_save`'s thread checkpointer does after staging)."""
    dcp, _ = _dcp()
    tmp = on_disk.temp_folder(run_dir, step, info.get("session", 0))
    if world.is_main:
        on_disk.prepare(tmp)
    world.barrier()
    writer = dcp.FileSystemWriter(tmp / DCP_DIR, sync_files=True)
    group = world.checkpoint_group()  # (made here, on the training thread: collective)
    if staged:
        future = _writer_thread().submit(dcp.save, tree, storage_writer=writer, process_group=group)
    else:
        future = dcp.async_save(tree, storage_writer=writer, process_group=group)
    return PendingSave(world, run_dir, step, tmp, info, main_state, future)


_WRITER: list[ThreadPoolExecutor] = []


def _writer_thread() -> ThreadPoolExecutor:
    """One thread for this process's background writes of staged trees (one at a time: each
    commits before the next starts)."""
    if not _WRITER:
        _WRITER.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptlab-dcp"))
    return _WRITER[0]


def _tree(world, model, optimizer) -> tuple[dict, list]:
    """(DCP's state dict of this rank's shards, the optimizer's name-keyed param_groups)."""
    _, sd = _dcp()
    optim = sd.get_optimizer_state_dict(model, optimizer)
    return {"model": sd.get_model_state_dict(model), "optim": {"state": optim["state"]}}, _param_groups(world, optim)


def _param_groups(world, optim: dict) -> list:
    """The optimizer's `param_groups` (name-keyed) for the main state file: this rank's, which
    are every rank's under FSDP2; in a pipeline every stage's, in stage order (collective)."""
    if world.stages is None:
        return optim["param_groups"]
    return [g for part in world.gather_objects(optim["param_groups"]) for g in part]


def load_sharded(folder: Path, model, optimizer, train_state: dict) -> None:
    """Load a sharded checkpoint into the live (sharded, distributed) model and optimizer: a
    pipeline stage, the groups whose parameters are its own."""
    dcp, sd = _dcp()
    sd._init_optim_state(optimizer)  # Adam's state exists only after a step: make the slots to load into
    optim = sd.get_optimizer_state_dict(model, optimizer)
    state = {"model": sd.get_model_state_dict(model), "optim": {"state": optim["state"]}}
    dcp.load(state, storage_reader=safe_reader(folder / DCP_DIR), planner=safe_planner())
    sd.set_model_state_dict(model, state["model"])
    mine = {n for g in optim["param_groups"] for n in g["params"]}
    groups = [g for g in train_state["param_groups"] if set(g["params"]) <= mine]
    sd.set_optimizer_state_dict(model, optimizer, {"state": state["optim"]["state"], "param_groups": groups})


# --- whole-state snapshots of a sharded model (collective) --------------------------------------


def full_snapshot(world, step: int, model, optimizer, train_state: dict, rngs=None) -> CapturedState | None:
    """Every rank calls this; rank 0 gets the whole state (other ranks: None). The RNG states of
    every rank go in as `rng_by_rank` (`rngs`, when the caller has them: a fold's recorded
    ranks'), so any rank's view can be restored."""
    _, sd = _dcp()
    # (offloaded: whole on rank 0 only. FSDP1 on the CPU is not offloaded: torch 2.13 crashes
    # there, a segfault cloning the gathered parameters on rank 0; every rank gathers instead.)
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    opts = sd.StateDictOptions(full_state_dict=True, cpu_offload=not (on_cpu and fsdp1.units(model)))
    model_sd = sd.get_model_state_dict(model, options=opts)
    optim_sd = sd.get_optimizer_state_dict(model, optimizer, options=opts)
    rngs = world.gather_objects(train_state["rng"]) if rngs is None else rngs
    if not world.is_main:
        return None
    state = {**train_state, "rng_by_rank": rngs, "optimizer_fqn": optim_sd}
    state.pop("optimizer", None)
    spec, tensors = codec.encode(state, prefix="state")
    # In a world of one, a parameter's full tensor is its shard itself: copy it, or the next
    # step would update the snapshot in place.
    live = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    whole = {
        k: v.detach().cpu().clone() if v.untyped_storage().data_ptr() in live else v.detach().cpu().contiguous()
        for k, v in model_sd.items()
    }
    return CapturedState(step, whole, {}, spec, tensors)


def set_full(model, optimizer, model_sd: dict, optim_sd: dict) -> None:
    """Load whole (unsharded) state into a model that may be sharded (e.g. a world of one)."""
    _, sd = _dcp()
    opts = sd.StateDictOptions(full_state_dict=True)
    sd.set_model_state_dict(model, model_sd, options=opts)
    sd.set_optimizer_state_dict(model, optimizer, optim_sd, options=opts)
