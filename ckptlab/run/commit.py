"""COMMIT.json, the record that makes a checkpoint folder a checkpoint: read, checked, and the
files verified against it. Torch-free (json and hashlib only): `ckptlab diff RUN@STEP` finds
and verifies a checkpoint's weights with this alone, and checkpoint.py builds on it."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from ckptlab.errors import CorruptFileError, IntegrityError, RetiredError
from ckptlab.io.files import open_regular
from ckptlab.jsonable import is_int, is_number
from ckptlab.run.hashing import sha256_file
from ckptlab.run.layout import COMMIT, checkpoints_dir, parse_checkpoint


def committed(run_dir: Path) -> tuple[list[tuple[int, Path, dict]], list[str]]:
    """(step, folder, COMMIT record) of each committed checkpoint whose files are present at
    their committed sizes, in step order; and the problems of the others.

    Cheap (no hashing): `verify_files` does the full check before a checkpoint is used.
    """
    found: list[tuple[int, Path, dict]] = []
    problems: list[str] = []
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return found, problems
    for p in sorted(root.iterdir()):
        step = parse_checkpoint(p.name)
        if step is None:
            continue
        try:
            commit = read_commit(p)  # every file name checked before any is looked at
            if commit["step"] != step:
                raise ValueError(f"{COMMIT} is for step {commit['step']}, in the folder of step {step}")
            for name, meta in commit["files"].items():
                if (p / name).stat().st_size != meta["bytes"]:
                    raise ValueError(f"{name} has the wrong size")
        except FileNotFoundError as e:
            if not p.is_dir():  # retired (retention, a rollback) after it was listed: not here
                continue
            problems.append(f"{p}: incomplete checkpoint ({Path(e.filename or '').name or COMMIT} missing)")
            continue
        except (ValueError, OSError) as e:
            problems.append(f"{p}: corrupt checkpoint ({e})")
            continue
        found.append((step, p, commit))
    return found, problems


def verify_files(folder: Path, commit: dict) -> None:
    """Check every file of a checkpoint folder against the size and sha256 its COMMIT record
    holds; CorruptFileError for a malformed record, IntegrityError for a file that differs."""
    try:
        check_commit(commit)
    except ValueError as e:
        raise CorruptFileError(f"corrupt checkpoint ({e})", path=folder / COMMIT) from None
    try:
        for name, expected in commit["files"].items():
            path = folder / name
            if not path.is_file():
                raise IntegrityError(f"{name} is missing from checkpoint {commit['step']}", path=folder)
            if path.stat().st_size != expected["bytes"]:
                raise IntegrityError(
                    f"size {path.stat().st_size} != {expected['bytes']} recorded at commit (truncated or replaced)",
                    path=path,
                )
            if sha256_file(path) != expected["sha256"]:
                raise IntegrityError(
                    "sha256 does not match the hash recorded at commit (tampered or corrupt)", path=path
                )
    except (IntegrityError, FileNotFoundError):
        if not folder.is_dir():  # the folder went away as it was read: retired, not damaged
            raise RetiredError(f"checkpoint {commit['step']}", path=folder) from None
        raise


def read_commit(folder: Path) -> dict:
    """A checkpoint folder's COMMIT.json, parsed and checked (`check_commit`); ValueError saying
    what is wrong when it is malformed, FileNotFoundError when it is missing."""
    try:
        with open_regular(folder / COMMIT) as f:
            commit = json.loads(f.read())
    except RecursionError:
        raise ValueError(f"{COMMIT} is nested too deeply") from None
    check_commit(commit)
    return commit


def check_commit(commit: Any) -> None:
    """ValueError unless `commit` is a COMMIT record: a JSON object with a `step`, whose `files` maps plain
    relative names inside the checkpoint folder (no `..`, not absolute) to {bytes, sha256}."""
    if not isinstance(commit, dict):
        raise ValueError(f"{COMMIT} is not a JSON object")
    step = commit.get("step")
    if not is_int(step) or step < 0:
        raise ValueError(f"{COMMIT} has no step")
    files = commit.get("files")
    if not isinstance(files, dict):
        raise ValueError(f"{COMMIT} has no files")
    for name, meta in files.items():
        if not _plain_member(name):
            raise ValueError(f"{COMMIT} names {name!r}, not a file inside the checkpoint folder")
        if (
            not isinstance(meta, dict)
            or not isinstance(meta.get("bytes"), int)
            or isinstance(meta["bytes"], bool)
            or meta["bytes"] < 0
            or not isinstance(meta.get("sha256"), str)
        ):
            raise ValueError(f"{COMMIT} has a malformed entry for {name!r}")
    _check_info(commit)


def _check_info(commit: dict) -> None:
    """The checkpoint's facts that info, rollback and report read, with their types."""

    for key, ok, what in (
        ("healthy", lambda x: isinstance(x, bool), "true or false"),
        ("first_anomaly", is_int, "a step"),
        ("session", is_int, "an integer"),
        ("reason", lambda x: isinstance(x, str), "a string"),
        ("layout", lambda x: isinstance(x, str), "a string"),
        (
            "validation",
            lambda x: isinstance(x, dict) and all(is_number(v) for v in x.values()),
            "an object of numbers",
        ),
        ("probe", lambda x: isinstance(x, dict), "an object"),
    ):
        if commit.get(key) is not None and not ok(commit[key]):
            raise ValueError(f"{COMMIT}'s {key!r} is not {what}")


def _plain_member(name: str) -> bool:
    if not name or "\x00" in name or name in (".", COMMIT):
        return False
    for flavour in (PurePosixPath, PureWindowsPath):
        p = flavour(name)
        if p.is_absolute() or p.drive or ".." in p.parts or not p.parts or p.parts == (".",):
            return False
    return True
