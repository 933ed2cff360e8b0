"""Sharded checkpoints of FSDP2 training, in torch.distributed.checkpoint (DCP) format.

    checkpoints/step-SSSSSSSSS/
      dcp/.metadata, dcp/__R_0.distcp   model and optimizer tensors; every rank writes its shards
      state.safetensors                 rank 0: optimizer param_groups, scheduler, RNG, env
      COMMIT.json                       every file's size and sha256; "layout": "sharded"

Commit: every rank writes into the same temp folder (`dcp.save` is collective), hashes what it
wrote, rank 0 gathers the hashes, writes COMMIT.json and renames the folder into place: as
atomic as a single-writer checkpoint. It runs on the training thread, since DCP's planning is
collective (the training stalls for the write; DDP/single-process checkpoints do not).

Reading never unpickles: DCP's `.metadata` goes through ckptlab.io.dcp's allowlist unpickler
(torch's own reader uses plain pickle), tensors through torch.load(weights_only=True), and
the non-tensor optimizer state (param_groups) is kept out of DCP, in our own state file.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from ckptlab.run import codec
from ckptlab.run.checkpoint import DCP_DIR, STATE_FILE, CapturedState, file_record, finish_commit, write_state_file
from ckptlab.run.layout import checkpoint_name, checkpoints_dir


def _dcp():
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict as sd

    return dcp, sd


# --- writing (collective) -------------------------------------------------------------------

def save_sharded(run_dir: Path, step: int, world, model, optimizer, train_state: dict, info: dict) -> None:
    """Every rank calls this; rank 0 commits. `train_state`: scheduler/scaler/rng/env (rank 0's)."""
    dcp, sd = _dcp()
    root = checkpoints_dir(run_dir)
    tmp = root / f".tmp-{checkpoint_name(step)}-sharded-s{info.get('session', 0)}"  # the same name on every rank
    if world.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / DCP_DIR).mkdir(parents=True)
    world.barrier()
    try:
        optim = sd.get_optimizer_state_dict(model, optimizer)
        dcp.save({"model": sd.get_model_state_dict(model), "optim": {"state": optim["state"]}},
                 storage_writer=dcp.FileSystemWriter(tmp / DCP_DIR, sync_files=True))
        mine = {f"{DCP_DIR}/{p.name}": file_record(p) for p in (tmp / DCP_DIR).glob(f"__{world.rank}_*")}
        if world.is_main:
            mine[f"{DCP_DIR}/.metadata"] = file_record(tmp / DCP_DIR / ".metadata")
            spec, tensors = codec.encode({**train_state, "param_groups": optim["param_groups"]}, prefix="state")
            write_state_file(tmp, CapturedState(step, {}, {}, spec, tensors))
            mine[STATE_FILE] = file_record(tmp / STATE_FILE)
        files: dict = {}
        for part in world.gather_objects(mine):
            files.update(part)
        if world.is_main:
            finish_commit(tmp, step, dict(sorted(files.items())), {**info, "layout": "sharded", "world_size": world.size})
    except BaseException:
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    world.barrier()


# --- reading --------------------------------------------------------------------------------------

def _safe_reader(folder: Path):
    """torch's FileSystemReader, with `.metadata` read by our allowlist unpickler."""
    dcp, _ = _dcp()
    from ckptlab.io.dcp import read_metadata

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            return read_metadata(Path(folder))

    return Reader(folder)


def _safe_planner():
    dcp, _ = _dcp()
    import io

    class Planner(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:  # torch's uses weights_only=False
            raise ValueError(f"unexpected non-tensor item {read_item.dest_index.fqn!r} in a ckptlab DCP checkpoint")

    return Planner()


def load_sharded(folder: Path, model, optimizer, train_state: dict) -> None:
    """Load a sharded checkpoint into the live (sharded, distributed) model and optimizer."""
    dcp, sd = _dcp()
    sd._init_optim_state(optimizer)  # Adam's state exists only after a step: make the slots to load into
    optim = sd.get_optimizer_state_dict(model, optimizer)
    state = {"model": sd.get_model_state_dict(model), "optim": {"state": optim["state"]}}
    dcp.load(state, storage_reader=_safe_reader(folder / DCP_DIR), planner=_safe_planner())
    sd.set_model_state_dict(model, state["model"])
    sd.set_optimizer_state_dict(model, optimizer, {"state": state["optim"]["state"], "param_groups": train_state["param_groups"]})


def _tree(folder: Path) -> dict:
    from ckptlab.io.dcp import dcp_tree

    tree, _, closers = dcp_tree(folder)
    try:
        return _materialize(tree)
    finally:
        for close in closers:
            close()


def _materialize(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _materialize(v) for k, v in node.items()}
    return node.load()


def load_full_model(dcp_folder: Path) -> dict[str, torch.Tensor]:
    """The whole model state dict of a sharded checkpoint, assembled in one process."""
    return _tree(dcp_folder).get("model", {})


def load_full(folder: Path, train_state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(model state dict, FQN-keyed full optimizer state dict) of a sharded checkpoint."""
    tree = _tree(folder / DCP_DIR)
    return tree.get("model", {}), {"state": tree.get("optim", {}).get("state", {}), "param_groups": train_state["param_groups"]}


# --- whole-state snapshots of a sharded model (collective) --------------------------------------

def full_snapshot(world, step: int, model, optimizer, train_state: dict) -> CapturedState | None:
    """Every rank calls this; rank 0 gets the whole state (other ranks: None). The RNG states of
    every rank go in as `rng_by_rank`, so any rank's view can be restored."""
    _, sd = _dcp()
    opts = sd.StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = sd.get_model_state_dict(model, options=opts)
    optim_sd = sd.get_optimizer_state_dict(model, optimizer, options=opts)
    rngs = world.gather_objects(train_state["rng"])
    if not world.is_main:
        return None
    state = {**train_state, "rng_by_rank": rngs, "optimizer_fqn": optim_sd}
    state.pop("optimizer", None)
    spec, tensors = codec.encode(state, prefix="state")
    return CapturedState(step, {k: v.detach().cpu().contiguous() for k, v in model_sd.items()}, {}, spec, tensors)


def set_full(model, optimizer, model_sd: dict, optim_sd: dict) -> None:
    """Load whole (unsharded) state into a model that may be sharded (e.g. a world of one)."""
    _, sd = _dcp()
    opts = sd.StateDictOptions(full_state_dict=True)
    sd.set_model_state_dict(model, model_sd, options=opts)
    sd.set_optimizer_state_dict(model, optimizer, optim_sd, options=opts)
