"""Export one checkpoint as plain files anyone can load without ckptlab.

    export_checkpoint(run.checkpoint(120), "best/")
    # best/model.safetensors   every state-dict name (tied ones as copies): load_state_dict works strictly
    # best/optimizer.pt        optimizer.state_dict()  (torch.load(..., weights_only=True));
    #                          several optimizers: {key: its state_dict()}, keyed as the Recorder got them
    # best/scheduler.pt        scheduler.state_dict(), if the run had one (likewise scaler.pt)
    # best/export.json         where it came from, each file's sha256, and how to load it

    model.load_state_dict(safetensors.torch.load_file("best/model.safetensors"))
    optimizer.load_state_dict(torch.load("best/optimizer.pt", weights_only=True))

The folder appears complete or not at all (written under a temp name, then renamed).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import safetensors.torch
import torch

from ckptlab.errors import CkptlabError
from ckptlab.io.base import expand_aliases
from ckptlab.run.atomic import fsync_path, rename_durably, write_json_atomic
from ckptlab.run.checkpoint import Checkpoint, sha256_file
from ckptlab.run.layout import MODEL_FILE

LOAD_HINT = (
    "model.load_state_dict(safetensors.torch.load_file('model.safetensors')); "
    "optimizer.load_state_dict(torch.load('optimizer.pt', weights_only=True))"
)
# Several optimizers (a list or a dict given to the Recorder): optimizer.pt and scheduler.pt hold
# one state dict per optimizer, keyed by its key (docs/run-format.md, "Several optimizers").
SEVERAL_LOAD_HINT = (
    "model.load_state_dict(safetensors.torch.load_file('model.safetensors')); "
    "states = torch.load('optimizer.pt', weights_only=True); "
    "for key, opt in optimizers.items(): opt.load_state_dict(states[key])  (a list: enumerate(optimizers))"
)
# A sharded (FSDP) run's optimizer state is keyed by parameter name: DCP's state-dict API
# loads it into a sharded or a plain model alike.
SHARDED_LOAD_HINT = (
    "from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict, "
    "StateDictOptions; o = StateDictOptions(full_state_dict=True); "
    "set_model_state_dict(model, safetensors.torch.load_file('model.safetensors'), options=o); "
    "set_optimizer_state_dict(model, optimizer, torch.load('optimizer.pt', weights_only=True), options=o)"
)


def export_checkpoint(ckpt: Checkpoint, dest: str | os.PathLike, *, run: str | None = None) -> dict:
    """Verify `ckpt`, then write it to `dest` (which must not exist, or be empty)."""
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise CkptlabError("already exists and is not an empty folder; refusing to overwrite", path=dest)
    ckpt.verify()
    tensors, aliases = ckpt.load_model(verify=False)
    state = ckpt.load_state(verify=False)
    if ckpt.sharded:  # the shards assembled: the whole model and the name-keyed optimizer state
        tensors, state["optimizer"] = ckpt.load_sharded(state)
    # Tied names become copies: a strict load_state_dict then finds every key, and copying
    # the same values into shared storage twice keeps the tie.
    full = {name: t.clone() if name in aliases else t for name, t in expand_aliases(tensors, aliases).items()}
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        safetensors.torch.save_file(full, tmp / MODEL_FILE, metadata={"format": "pt", "ckptlab.step": str(ckpt.step)})
        parts = {
            "optimizer.pt": state.get("optimizer"),
            "scheduler.pt": state.get("scheduler"),
            "scaler.pt": state.get("scaler"),
        }
        for name, obj in parts.items():
            if obj is not None:
                torch.save(obj, tmp / name)
        files = {}
        for f in sorted(tmp.iterdir()):
            fsync_path(f)
            files[f.name] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
        info = {
            "format": "ckptlab-export",
            "version": 1,
            "step": ckpt.step,
            "run": run,
            "reason": ckpt.reason,
            "created": time.time(),
            "tied": aliases,
            "files": files,
            "load": SHARDED_LOAD_HINT if ckpt.sharded else SEVERAL_LOAD_HINT if _several(state) else LOAD_HINT,
        }
        write_json_atomic(tmp / "export.json", info)
        fsync_path(tmp)
        if dest.exists():
            dest.rmdir()  # empty, checked above
        rename_durably(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info


def _several(state: dict) -> bool:
    """The checkpoint holds several optimizers' states (keyed by theirs), not one state dict."""
    optimizer = state.get("optimizer")
    return isinstance(optimizer, dict) and not {"state", "param_groups"} <= set(optimizer)
