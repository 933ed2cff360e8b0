"""Checkpoints: committed atomically, verified by our own hashes.

A checkpoint folder `checkpoints/step-SSSSSSSSS/` holds
    model.safetensors   the model's state dict (plain safetensors: `safetensors.torch.load_file`
                        reads it; tied names are in metadata["ckptlab.aliases"])
    state.safetensors   optimizer, scheduler, grad scaler, RNG and execution settings
                        (tensors + codec spec in metadata["ckptlab"])
    COMMIT.json         step, session, reason, health, and every file's size and sha256

Commit protocol: write into `checkpoints/.tmp-...`, fsync each file, write COMMIT.json last,
fsync the folder, rename it into place, fsync `checkpoints/`. A kill at any instant leaves
either no `step-*` folder or a complete one. Integrity comes from the hashes, not from "it
parses": an interrupted safetensors write can leave a full-length file of zeros that loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from ckptlab.errors import CorruptFileError, IntegrityError
from ckptlab.run import codec
from ckptlab.run.layout import (
    COMMIT,
    MODEL_FILE,
    STATE_FILE,
    checkpoint_name,
    checkpoints_dir,
    fsync_path,
    parse_checkpoint,
)
from ckptlab.run.records import META_KEY

ALIASES_KEY = "ckptlab.aliases"
_HASH_CHUNK = 8 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class CapturedState:
    """A training state copied off the device, ready to be written in the background."""

    step: int
    model: dict[str, torch.Tensor]
    aliases: dict[str, str]
    state_spec: Any
    state_tensors: dict[str, torch.Tensor]
    info: dict = field(default_factory=dict)  # reason, session, health... -> COMMIT.json


def commit_checkpoint(run_dir: Path, captured: CapturedState) -> dict:
    """Write and atomically commit one checkpoint; returns its COMMIT record."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(captured.step)
    tmp = root / f".tmp-{checkpoint_name(captured.step)}-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        safetensors.torch.save_file(
            captured.model, tmp / MODEL_FILE, metadata={"format": "pt", ALIASES_KEY: json.dumps(captured.aliases)}
        )
        safetensors.torch.save_file(
            captured.state_tensors, tmp / STATE_FILE, metadata={META_KEY: json.dumps(captured.state_spec)}
        )
        files = {}
        for name in (MODEL_FILE, STATE_FILE):
            fsync_path(tmp / name)
            files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
        commit = {"format_version": 1, "step": captured.step, "created": time.time(), "files": files, **captured.info}
        with open(tmp / COMMIT, "w") as f:
            json.dump(commit, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
        if final.exists():  # an orphan from a crashed session at the same step: set it aside
            final.rename(root / f".superseded-{final.name}-{time.monotonic_ns()}")
        os.rename(tmp, final)
        fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit


def remove_checkpoint(path: Path) -> None:
    """Rename first, then delete: a half-deleted folder never looks like a checkpoint."""
    doomed = path.with_name(f".deleting-{path.name}-{time.monotonic_ns()}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


@dataclass
class Checkpoint:
    step: int
    path: Path
    commit: dict

    @property
    def model_path(self) -> Path:
        return self.path / MODEL_FILE

    @property
    def reason(self) -> str:
        return self.commit.get("reason", "periodic")

    @property
    def nbytes(self) -> int:
        return sum(int(f["bytes"]) for f in self.commit["files"].values())

    def verify(self) -> None:
        """Check every file against the sha256 recorded at commit; IntegrityError otherwise."""
        for name, expected in self.commit["files"].items():
            path = self.path / name
            if not path.is_file():
                raise IntegrityError(f"{name} is missing from checkpoint {self.step}", path=self.path)
            if path.stat().st_size != expected["bytes"]:
                raise IntegrityError(
                    f"size {path.stat().st_size} != {expected['bytes']} recorded at commit (truncated or replaced)",
                    path=path,
                )
            if sha256_file(path) != expected["sha256"]:
                raise IntegrityError("sha256 does not match the hash recorded at commit (tampered or corrupt)", path=path)

    def load_model(self, *, verify: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        if verify:
            self.verify()
        try:
            with safetensors.safe_open(self.model_path, framework="pt") as f:
                aliases = json.loads((f.metadata() or {}).get(ALIASES_KEY, "{}"))
            tensors = safetensors.torch.load_file(self.model_path)
        except Exception as e:  # noqa: BLE001
            raise CorruptFileError(f"unreadable safetensors ({e})", path=self.model_path) from None
        return tensors, aliases

    def load_state(self, *, verify: bool = True) -> dict[str, Any]:
        if verify:
            self.verify()
        path = self.path / STATE_FILE
        try:
            with safetensors.safe_open(path, framework="pt") as f:
                spec = json.loads(f.metadata()[META_KEY])
            tensors = safetensors.torch.load_file(path)
            return codec.decode(spec, tensors)
        except Exception as e:  # noqa: BLE001
            raise CorruptFileError(f"unreadable training state ({e})", path=path) from None


def load_captured(path: Path) -> CapturedState:
    """A committed checkpoint folder back as the in-memory state it was written from."""
    commit = json.loads((path / COMMIT).read_text())
    ckpt = Checkpoint(int(commit["step"]), path, commit)
    ckpt.verify()
    tensors, aliases = ckpt.load_model(verify=False)
    with safetensors.safe_open(path / STATE_FILE, framework="pt") as f:
        spec = json.loads(f.metadata()[META_KEY])
    return CapturedState(ckpt.step, tensors, aliases, spec, safetensors.torch.load_file(path / STATE_FILE), {})


def list_checkpoints(run_dir: Path) -> tuple[list[Checkpoint], list[str]]:
    """Committed checkpoints whose files are present at their committed sizes, and problems.

    Cheap (no hashing): `Checkpoint.verify()` does the full check before a checkpoint is used.
    """
    found, problems = [], []
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return found, problems
    for p in sorted(root.iterdir()):
        step = parse_checkpoint(p.name)
        if step is None:
            continue
        try:
            commit = json.loads((p / COMMIT).read_text())
            files = commit["files"]
            for name, meta in files.items():
                if (p / name).stat().st_size != int(meta["bytes"]):
                    raise ValueError(f"{name} has the wrong size")
        except FileNotFoundError as e:
            problems.append(f"{p}: incomplete checkpoint ({Path(e.filename or '').name or COMMIT} missing)")
            continue
        except (ValueError, KeyError, TypeError) as e:
            problems.append(f"{p}: corrupt checkpoint ({e})")
            continue
        found.append(Checkpoint(step, p, commit))
    return found, problems
