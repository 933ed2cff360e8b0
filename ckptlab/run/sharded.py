"""Sharded checkpoints of FSDP2 training on disk, in torch.distributed.checkpoint (DCP) format.

    checkpoints/step-SSSSSSSSS/
      dcp/.metadata, dcp/__R_0.distcp   model and optimizer tensors; every rank writes its shards
      state.safetensors                 rank 0: optimizer param_groups, scheduler, RNG, env
      COMMIT.json                       every file's size and sha256; "layout": "sharded"

Commit: every rank writes into the same temp folder (`dcp.save` is collective), hashes what it
wrote, rank 0 gathers the hashes, writes COMMIT.json and renames the folder into place: as
atomic as a single-writer checkpoint. This module is the folder and the commit; the
collective save and load on the live model are training/sharded.py's. Reading a committed
sharded checkpoint whole is `Checkpoint.load_model` / `Checkpoint.load_sharded`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ckptlab.run import codec
from ckptlab.run.atomic import fsync_path
from ckptlab.run.checkpoint import CapturedState, file_record, finish_commit, write_state_file
from ckptlab.run.layout import DCP_DIR, STATE_FILE, checkpoint_name, checkpoints_dir


def temp_folder(run_dir: Path, step: int, session: int) -> Path:
    """The folder every rank writes its shards into (the same name on every rank)."""
    return checkpoints_dir(run_dir) / f".tmp-{checkpoint_name(step)}-sharded-s{session}"


def prepare(tmp: Path) -> Path:
    """Rank 0, before anyone writes: an empty temp folder; returns the DCP folder inside it."""
    tmp.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / DCP_DIR).mkdir(parents=True)
    return tmp / DCP_DIR


def rank_files(tmp: Path, rank: int) -> dict[str, dict]:
    """Size and sha256 of the shard files `rank` wrote (relative name -> record)."""
    return {f"{DCP_DIR}/{p.name}": file_record(p) for p in (tmp / DCP_DIR).glob(f"__{rank}_*")}


def write_main_files(tmp: Path, step: int, state: dict) -> dict[str, dict]:
    """Rank 0: the training state kept out of DCP (param_groups, scheduler, RNG, env) as
    state.safetensors; returns the records of it and of DCP's `.metadata`."""
    spec, tensors = codec.encode(state, prefix="state")
    state = write_state_file(tmp, CapturedState(step, {}, {}, spec, tensors))  # hashed as written
    fsync_path(tmp / STATE_FILE)
    return {f"{DCP_DIR}/.metadata": file_record(tmp / DCP_DIR / ".metadata"), STATE_FILE: state}


def commit(tmp: Path, step: int, files: dict[str, dict], info: dict, world_size: int) -> dict:
    """Rank 0, once every rank's files are recorded: COMMIT.json, then the rename into place."""
    return finish_commit(
        tmp, step, dict(sorted(files.items())), {**info, "layout": "sharded", "world_size": world_size}
    )


def abandon(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
