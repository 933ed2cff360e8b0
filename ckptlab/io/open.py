"""`open_checkpoint`: from whatever the user typed to a LazyStateDict.

The format is decided by content, not by file name: a `.bin` may be a torch zip, a legacy
pickle or safetensors. Folders are recognised by what they hold.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, cast

from ckptlab.errors import CkptlabError, CorruptFileError, UnknownFormatError
from ckptlab.io.base import LazyStateDict
from ckptlab.io.files import open_regular
from ckptlab.io.hf_sharded import find_index, open_sharded
from ckptlab.io.safetensors_file import ALIASES_KEY, looks_like_safetensors, open_safetensors, read_aliases
from ckptlab.run.layout import MODEL_FILE, is_run

if TYPE_CHECKING:
    import torch

# torch is imported only for what needs it (.pt files, DCP folders, in-memory state dicts):
# the readers of those are imported where they are used, so that a diff of safetensors
# files starts without it.
DCP_METADATA = ".metadata"  # (ckptlab.io.dcp.METADATA, which imports torch)

SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")  # an unsharded save_pretrained folder
EXPECTED = (
    "expected a .pt/.pth/.bin or .safetensors file, a sharded folder (*.index.json), "
    "a DCP folder (.metadata), a DeepSpeed checkpoint folder (*_optim_states.pt), a ckptlab run, or RUN@STEP"
)


def open_checkpoint(ref, *, sequential: bool = False, verify: bool = True) -> LazyStateDict:
    """Open a checkpoint for lazy reading.

    ref: a path (file or folder), "RUN@STEP" / "RUN@latest", a run directory (its latest
    checkpoint), an in-memory state dict (nested is fine), or a LazyStateDict (returned as is).
    sequential: read with plain reads instead of mmap (network filesystems).
    verify: check a run checkpoint's sha256 hashes before reading it.
    """
    if isinstance(ref, LazyStateDict):
        return ref
    if isinstance(ref, Mapping):
        from ckptlab.io.base import from_tensors
        from ckptlab.io.nested import describe, find_state_dict

        flat, where = find_state_dict(ref)
        # (an in-memory state dict: its leaves are the caller's torch tensors)
        return from_tensors(cast("dict[str, torch.Tensor]", flat), notes=[n for n in [describe(ref, where)] if n])
    text = os.fspath(ref)
    path = Path(text)
    if not path.exists():
        run_dir, sep, step = text.rpartition("@")
        if sep and run_dir:
            return open_run_checkpoint(Path(run_dir), step, sequential=sequential, verify=verify)
        raise CkptlabError("no such file or folder", path=text)
    if path.is_dir():
        return _open_folder(path, text, sequential=sequential, verify=verify)
    return _open_file(path, text, sequential=sequential)


def _open_file(path: Path, label: str, *, sequential: bool, aliases=None, notes=None, format=None) -> LazyStateDict:
    with open_regular(path) as f:
        head = f.read(16)
    if not head:
        raise CorruptFileError("empty file", path=path)
    if looks_like_safetensors(head) or (
        path.suffix == ".safetensors" and head[:4] != b"PK\x03\x04"
    ):  # damaged: say how
        refs, metadata, skipped, file = open_safetensors(path, sequential=sequential)
        if aliases is None and ALIASES_KEY in metadata:
            aliases = read_aliases(metadata, path)
        return LazyStateDict(
            refs,
            label=label,
            format=format or "safetensors",
            aliases=aliases,
            notes=notes,
            skipped=skipped,
            closers=[file.close],
        )
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":  # a torch.save zip, or a (legacy) pickle
        from ckptlab.io.torch_file import open_torch

        refs, tied, torch_notes, closers = open_torch(path, sequential=sequential)
        return LazyStateDict(
            refs,
            label=label,
            format=format or "torch",
            aliases=tied,
            notes=(notes or []) + torch_notes,
            closers=closers,
        )
    raise UnknownFormatError(f"not a checkpoint format ckptlab reads ({EXPECTED})", path=path)


def _open_folder(path: Path, label: str, *, sequential: bool, verify: bool) -> LazyStateDict:
    if is_run(path):
        return open_run_checkpoint(path, "latest", sequential=sequential, verify=verify)
    index = find_index(path)
    if index is not None:
        refs, aliases, notes, skipped, closers = open_sharded(index, sequential=sequential)
        return LazyStateDict(
            refs, label=label, format="hf-sharded", aliases=aliases, notes=notes, skipped=skipped, closers=closers
        )
    if (path / DCP_METADATA).is_file():
        from ckptlab.io.dcp import open_dcp

        refs, notes, skipped, closers = open_dcp(path)
        return LazyStateDict(refs, label=label, format="dcp", notes=notes, skipped=skipped, closers=closers)
    if any(p.name == "latest" or p.name.endswith("_optim_states.pt") for p in path.iterdir()):
        from ckptlab.io.zero import find_zero, open_zero

        folder = find_zero(path)
        if folder is not None:
            refs, notes = open_zero(folder)
            return LazyStateDict(refs, label=label, format="deepspeed-zero", notes=notes)
    for name in SINGLE_FILES:
        if (path / name).is_file():
            return _open_file(path / name, label, sequential=sequential)
    raise UnknownFormatError(f"a folder ckptlab cannot read ({EXPECTED})", path=path)


def open_run_checkpoint(run_dir: Path, step: str, *, sequential: bool, verify: bool) -> LazyStateDict:
    """RUN@STEP: the model weights of one committed checkpoint of a ckptlab run (labelled
    RUN@<step>, also when asked for RUN@latest or RUN). The one place io/ reaches up into run/.

    A committed single-file checkpoint is found and verified from its COMMIT.json alone
    (run/commit.py), without importing torch (seconds of start-up); anything else (a sharded
    checkpoint, a step that is not there, a damaged run) goes through the run reader, which
    says what is wrong."""
    from ckptlab.run.commit import committed, verify_files
    from ckptlab.run.manifest import read_manifest

    read_manifest(run_dir)  # not a run, a newer format, a corrupt manifest: as open_run says
    if step == "latest" or step.isdigit():
        found, _ = committed(run_dir)
        if step == "latest":
            pick = found[-1] if found else None
        else:
            pick = next((c for c in found if c[0] == int(step)), None)
        if pick is not None and pick[2].get("layout") != "sharded":
            number, folder, commit = pick
            if verify:
                verify_files(folder, commit)
            return _open_file(folder / MODEL_FILE, f"{run_dir}@{number}", sequential=sequential, format="ckptlab-run")
    from ckptlab.run import open_run

    run = open_run(run_dir)
    if not run.checkpoints:
        raise CkptlabError("the run has no complete checkpoint yet", path=run_dir)
    if step == "latest":
        number = run.checkpoints[-1]
    elif step.isdigit():
        number = int(step)
    else:
        raise CkptlabError(f"{step!r} is not a step: use RUN@<step number> or RUN@latest", path=run_dir)
    ck = run.checkpoint(number)  # ReplayError naming the checkpoints there are, if absent
    if verify:
        ck.verify()  # IntegrityError if a file no longer matches its recorded sha256
    if ck.sharded:  # FSDP training: a DCP folder of shards
        from ckptlab.io.dcp import open_dcp

        refs, notes, skipped, closers = open_dcp(ck.model_path)
        return LazyStateDict(
            refs, label=f"{run_dir}@{number}", format="ckptlab-run (dcp)", notes=notes, skipped=skipped, closers=closers
        )
    return _open_file(ck.model_path, f"{run_dir}@{number}", sequential=sequential, format="ckptlab-run")
