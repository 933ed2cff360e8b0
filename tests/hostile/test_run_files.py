"""Hostile run files: manifest.json, journal records, COMMIT.json, safetensors headers."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import pytest

from ckptlab.run import framelog
from tests.hostile.conftest import MEMORY_LIMIT, refused, run_cli, tree_hash

DEEP = "[" * 200_000 + "]" * 200_000  # any JSON parser recurses once per level


def checkpoint_dirs(run: Path) -> list[Path]:
    return sorted((run / "checkpoints").glob("step-*"))


# --- item 6: deeply nested JSON is corruption, not a RecursionError -----------------------------


def test_deep_manifest(sample_run):
    (sample_run / "manifest.json").write_text(DEEP)
    refused(sample_run, "info", "--run", sample_run, names="manifest.json", says="nested too deeply")


def test_deep_journal_record(sample_run):
    last = sorted((sample_run / "journal").glob("s*.log"))[-1]
    payload = DEEP.encode()
    with open(last, "ab") as f:
        f.write(
            framelog.pack_frame(framelog.VALIDATION, 9000, payload, layout=framelog.LAYOUTS[last.read_bytes()[:16]])
        )
    refused(sample_run, "info", "--run", sample_run, names=last.name, says="nested too deeply")


def test_deep_commit_json(sample_run):
    ckpt = checkpoint_dirs(sample_run)[0]
    (ckpt / "COMMIT.json").write_text(DEEP)
    refused(sample_run, "info", "--run", sample_run, names=ckpt.name, says="nested too deeply")


def test_deep_safetensors_header(tmp_path):
    header = DEEP.encode()
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    refused(path, "diff", path, path, names="deep.safetensors", says="nested too deeply")


def test_commit_json_that_is_not_an_object(sample_run):
    ckpt = checkpoint_dirs(sample_run)[0]
    (ckpt / "COMMIT.json").write_text('{"step": 1000, "files": ["model.safetensors"]}')
    refused(sample_run, "info", "--run", sample_run, names=ckpt.name, says="has no files")


# --- item 7: COMMIT.json names only files inside its checkpoint folder ---------------------------


def test_commit_json_pointing_outside_the_checkpoint(sample_run, tmp_path):
    """A name with `..` is corruption, and the file it names is never opened: here it would
    even match its size and hash, so reading it would make the checkpoint look valid."""
    secret = tmp_path / "secret.txt"
    secret.write_text("not a checkpoint file\n")
    ckpt = checkpoint_dirs(sample_run)[0]
    commit = json.loads((ckpt / "COMMIT.json").read_text())
    name = os.path.relpath(secret, ckpt)
    assert name.startswith("..")
    commit["files"] = {
        name: {"bytes": secret.stat().st_size, "sha256": hashlib.sha256(secret.read_bytes()).hexdigest()}
    }
    (ckpt / "COMMIT.json").write_text(json.dumps(commit))
    refused(sample_run, "info", "--run", sample_run, names=ckpt.name, says="not a file inside the checkpoint folder")
    # absolute paths too
    commit["files"] = {str(secret): commit["files"][name]}
    (ckpt / "COMMIT.json").write_text(json.dumps(commit))
    refused(sample_run, "info", "--run", sample_run, names=ckpt.name, says="not a file inside the checkpoint folder")


# --- item 8: a manifest naming a huge file: hashed in chunks, memory stays flat -----------------


def test_manifest_naming_a_huge_source_file(sample_run, tmp_path):
    huge = tmp_path / "huge.py"
    with open(huge, "wb") as f:
        f.truncate(MEMORY_LIMIT + (64 << 20))  # sparse, and more than the child's address space limit
    manifest = json.loads((sample_run / "manifest.json").read_text())
    manifest["functions"]["build_fn"]["file"] = str(huge)
    manifest["functions"]["build_fn"]["module"] = "user_train"  # not ckptlab's own (the installed one runs)
    (sample_run / "manifest.json").write_text(json.dumps(manifest))
    before = tree_hash(sample_run)
    r = run_cli("info", "--run", sample_run, timeout=60)
    assert tree_hash(sample_run) == before
    assert "internal error" not in r.err, r.err
    assert r.code == 0, r.err
    assert "huge.py: source changed since recording" in r.out, r.out


# --- special files where a file should be: one line, never a hang -------------------------------


def test_a_fifo_segment_is_refused_not_waited_on(sample_run):
    segment = sorted((sample_run / "journal").glob("s*.log"))[0]
    segment.unlink()
    os.mkfifo(segment)
    refused(sample_run, "info", "--run", sample_run, names=segment.name, says="not a regular file (a FIFO)")


def test_special_files_given_to_diff(sample_run, tmp_path):
    model = checkpoint_dirs(sample_run)[-1] / "model.safetensors"
    model.unlink()
    os.mkfifo(model)
    refused(model.parent, "diff", model, model, names="model.safetensors", says="not a regular file (a FIFO)")
    zero = tmp_path / "zero.pt"
    zero.symlink_to("/dev/zero")
    refused(zero, "diff", zero, names="zero.pt", says="not a regular file (a device)")


# --- fields of the wrong type: one line naming the file, never an internal error ----------------


def _append_frame(segment: Path, kind: int, payload: bytes, flags: int = 0, step: int = 9000) -> None:
    layout = framelog.LAYOUTS[segment.read_bytes()[:16]]  # the segment's own
    with open(segment, "ab") as f:
        f.write(framelog.pack_frame(kind, step, payload, flags=flags, layout=layout))


@pytest.mark.parametrize(
    "kind, record, says",
    [
        (framelog.STEP, {"loss": "abc"}, "'loss' is not a number"),
        (framelog.STEP, {"loss": 1.0, "lr": ["x"]}, "'lr' holds something"),
        (framelog.STEP, {"loss": 1.0, "nonfinite_grads": "many"}, "'nonfinite_grads' is not an integer"),
        (framelog.VALIDATION, {"metrics": {"val_loss": "abc"}}, "'metrics' is not an object of numbers"),
        (framelog.VALIDATION, {"metrics": [1, 2]}, "'metrics' is not an object of numbers"),
        (framelog.EVENT, {"kind": 7, "step": "x"}, "'kind' is not a string"),
    ],
)
def test_journal_records_with_fields_of_the_wrong_type(sample_run, kind, record, says):
    from ckptlab.run import records

    last = sorted((sample_run / "journal").glob("s*.log"))[-1]
    if kind == framelog.STEP:
        _append_frame(last, kind, records.pack(record, {}), framelog.FLAG_SAFETENSORS)
    else:
        _append_frame(last, kind, json.dumps(record).encode())
    for command in ("info", "report"):
        refused(sample_run, command, "--run", sample_run, names=last.name, says=says)


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda m: m.update(sessions="abc"), "'sessions' is not a list"),
        (lambda m: m.update(parameters=[{"name": None}]), "a parameter without a name"),
        (lambda m: m.update(world_size="two"), "'world_size' is not a positive integer"),
        (lambda m: m.update(data_ranks=[0, 7]), "'data_ranks' is not one data-parallel rank per process"),
        (lambda m: m["config"].update(val_metric=["x"]), "config.val_metric is not a string"),
        (lambda m: m.update(functions={"build_fn": "x"}), "functions.build_fn is not an object"),
        (lambda m: m.update(data_info={"pad_id": "zero"}), "data_info.pad_id is not an integer"),
        (lambda m: m.update(format_version=True), "no valid format_version"),
    ],
)
def test_manifest_fields_of_the_wrong_type(sample_run, edit, says):
    manifest = json.loads((sample_run / "manifest.json").read_text())
    edit(manifest)
    (sample_run / "manifest.json").write_text(json.dumps(manifest))
    for command in ("info", "dirty", "rollback"):
        refused(sample_run, command, "--run", sample_run, names="manifest.json", says=says)


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda c: c.update(healthy="maybe"), "'healthy' is not true or false"),
        (lambda c: c.update(validation="bad"), "'validation' is not an object of numbers"),
        (lambda c: c.update(step=c["step"] + 1), "in the folder of step"),
    ],
)
def test_commit_facts_of_the_wrong_type(sample_run, edit, says):
    ckpt = checkpoint_dirs(sample_run)[-1]
    commit = json.loads((ckpt / "COMMIT.json").read_text())
    edit(commit)
    (ckpt / "COMMIT.json").write_text(json.dumps(commit))
    refused(sample_run, "info", "--run", sample_run, names=ckpt.name, says=says)


def test_a_fifo_manifest_or_commit_record_is_refused_not_waited_on(sample_run):
    commit = checkpoint_dirs(sample_run)[-1] / "COMMIT.json"
    commit.unlink()
    os.mkfifo(commit)
    refused(sample_run, "info", "--run", sample_run, names=commit.parent.name, says="not a regular file (a FIFO)")
    manifest = sample_run / "manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    refused(sample_run, "info", "--run", sample_run, names="manifest.json", says="not a regular file (a FIFO)")
