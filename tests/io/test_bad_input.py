"""Bad input: each a typed error with one clear line, and nothing from a file ever runs."""

import json
import os
import pickle
import struct

import pytest
import safetensors.torch
import torch

from ckptlab.errors import (
    CkptlabError,
    CorruptFileError,
    IntegrityError,
    ReplayError,
    UnknownFormatError,
    UnsafeFileError,
)
from ckptlab.io import open_checkpoint
from ckptlab.io.dcp import _MetadataUnpickler
from tests import models
from tests.io.checkpoints import toy_state, write, write_sharded


class Payload:
    """Unpickling this runs code: it touches `marker` (if any loader ever executes it)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _one_line(e: Exception, path) -> str:
    text = str(e)
    assert "\n" not in text and text.startswith(str(path)), text
    return text


def test_pickle_with_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "PWNED"
    evil = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.zeros(2)}, "hook": Payload(marker)}, evil)
    with pytest.raises(UnsafeFileError) as e:
        open_checkpoint(evil)
    assert "system" in _one_line(e.value, evil) and "never runs code" in str(e.value)
    raw = tmp_path / "evil.pkl"  # a plain pickle, not a torch file at all
    raw.write_bytes(pickle.dumps({"w": Payload(marker)}))
    with pytest.raises(UnsafeFileError):
        open_checkpoint(raw)
    assert not marker.exists()


def test_pickle_with_non_tensor_objects_is_refused(tmp_path):
    import collections

    path = tmp_path / "obj.pt"
    torch.save(
        {"w": torch.zeros(2), "counter": collections.Counter("ab"), "shape": __import__("fractions").Fraction(1, 3)},
        path,
    )
    with pytest.raises(UnsafeFileError) as e:
        open_checkpoint(path)
    assert "fractions.Fraction" in _one_line(e.value, path) or "Counter" in str(e.value)


def test_truncated_torch_zip(tmp_path):
    path = write(tmp_path / "a", toy_state(blocks=1), "pt")
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(CorruptFileError) as e:
        open_checkpoint(path)
    assert "unreadable torch checkpoint (truncated: a zip archive without its index" in _one_line(e.value, path)
    index = data.find(b"PK\x01\x02")  # bytes cut from the middle, the zip index kept
    path.write_bytes(data[: index // 2] + data[index:])
    with pytest.raises(CorruptFileError) as e:
        open_checkpoint(path)
    assert "unreadable torch checkpoint (its zip index does not match" in _one_line(e.value, path)


@pytest.fixture
def st_file(tmp_path):
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"a": torch.ones(100), "b": torch.zeros(10)}, path)
    return path


def _header(path):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _rewrite(path, header, body):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-40]), "truncated: tensor"),
        (lambda p: p.write_bytes(p.read_bytes()[:20]), "truncated: the header needs"),
        (lambda p: p.write_bytes(struct.pack("<Q", 10**12) + b"{" + b"\0" * 30), "claims"),
        (lambda p: p.write_bytes(struct.pack("<Q", 6) + b"{oops}" + b"\0" * 8), "not JSON"),
        (
            lambda p: _rewrite(
                p, {**_header(p)[0], "b": {**_header(p)[0]["b"], "data_offsets": [360, 400]}}, _header(p)[1]
            ),
            "overlap",
        ),
        (
            lambda p: _rewrite(p, {**_header(p)[0], "a": {**_header(p)[0]["a"], "shape": [99]}}, _header(p)[1]),
            "should take",
        ),
        (
            lambda p: _rewrite(p, {**_header(p)[0], "a": {**_header(p)[0]["a"], "shape": [-1]}}, _header(p)[1]),
            "invalid shape",
        ),
        (
            lambda p: _rewrite(
                p, {**_header(p)[0], "a": {**_header(p)[0]["a"], "data_offsets": [8, 4]}}, _header(p)[1]
            ),
            "invalid data_offsets",
        ),
    ],
    ids=["data cut", "header cut", "huge header", "bad json", "overlap", "wrong size", "bad shape", "bad offsets"],
)
def test_corrupt_safetensors(st_file, damage, words):
    damage(st_file)
    with pytest.raises(CorruptFileError) as e:
        open_checkpoint(st_file)
    assert words in _one_line(e.value, st_file)


@pytest.mark.parametrize(
    "dtype, error, words",
    [
        ("F4", UnknownFormatError, "tensor 'b' has dtype F4, which ckptlab cannot read"),
        ("X99", CorruptFileError, "tensor 'b' has unknown dtype 'X99'"),
    ],
)
def test_unreadable_safetensors_dtype_is_an_error(st_file, dtype, error, words):
    """Not skipped: a diff without that tensor would call it "only in B", or the files identical."""
    header, body = _header(st_file)
    header["b"]["dtype"] = dtype
    _rewrite(st_file, header, body)
    with pytest.raises(error) as e:
        open_checkpoint(st_file)
    assert words in _one_line(e.value, st_file)


def test_unknown_formats(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello, not a checkpoint")
    with pytest.raises(UnknownFormatError) as e:
        open_checkpoint(text)
    assert "not a checkpoint format" in _one_line(e.value, text)
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(CorruptFileError, match="empty file"):
        open_checkpoint(tmp_path / "empty")
    (tmp_path / "folder").mkdir()
    with pytest.raises(UnknownFormatError, match="a folder ckptlab cannot read"):
        open_checkpoint(tmp_path / "folder")
    with pytest.raises(CkptlabError, match="no such file"):
        open_checkpoint(tmp_path / "nope.pt")


@pytest.mark.parametrize(
    "shard", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors", "C:\\Windows\\x"]
)
def test_shard_names_cannot_leave_the_folder(tmp_path, shard):
    folder = write_sharded(tmp_path / "hf", toy_state(blocks=1))
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["wte.weight"] = shard
    index.write_text(json.dumps(data))
    with pytest.raises(UnsafeFileError, match="outside its folder"):
        open_checkpoint(folder)


def test_sharded_index_naming_a_missing_tensor_or_shard(tmp_path):
    folder = write_sharded(tmp_path / "hf", toy_state(blocks=1))
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["ghost.weight"] = data["weight_map"]["wte.weight"]
    index.write_text(json.dumps(data))
    with pytest.raises(CorruptFileError, match="do not hold"):
        open_checkpoint(folder)
    data["weight_map"]["ghost.weight"] = "model-00009-of-00009.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(CorruptFileError, match="is missing"):
        open_checkpoint(folder)


def test_dcp_metadata_with_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "PWNED"
    folder = write(tmp_path / "dcp", toy_state(blocks=1), "dcp")
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UnsafeFileError) as e:
        open_checkpoint(folder)
    assert "system" in str(e.value) and "not DCP checkpoint metadata" in str(e.value)
    assert not marker.exists()


def test_dcp_storage_paths_cannot_leave_the_folder(tmp_path):
    folder = write(tmp_path / "dcp", toy_state(blocks=1), "dcp")
    with open(folder / ".metadata", "rb") as f:
        meta = _MetadataUnpickler(f, folder).load()
    for info in meta.storage_data.values():
        info.relative_path = "../../secret.distcp"
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(UnsafeFileError, match="outside its folder"):
        open_checkpoint(folder)


def test_old_torch_is_refused_before_unpickling(tmp_path, monkeypatch):
    path = write(tmp_path / "a", {"w": torch.ones(2)}, "pt")
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    with pytest.raises(CkptlabError, match="too old"):
        open_checkpoint(path)


def test_run_references_are_verified(tmp_path):
    run = tmp_path / "run"
    models.record_run(run, models.build_mlp, models.step_mlp, models.mlp_batches(11), ckpt_every=10)
    with pytest.raises(ReplayError, match="no checkpoint at step 7"):
        open_checkpoint(f"{run}@7")
    with pytest.raises(CkptlabError, match="not a step"):
        open_checkpoint(f"{run}@last")
    model = run / "checkpoints" / "step-000000010" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF  # flip one bit of a weight: still parses, no longer what was committed
    model.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="sha256"):
        open_checkpoint(f"{run}@10")
    assert open_checkpoint(f"{run}@10", verify=False).label == f"{run}@10"


def test_small_expanded_buffers_still_open(tmp_path):
    """A stride-0 buffer (e.g. HF's position_ids, an `expand`ed arange) within MAX_EXPANDED reads."""
    path = tmp_path / "buf.pt"
    torch.save({"position_ids": torch.arange(8).expand((1, -1)), "bias": torch.zeros(1).expand(100)}, path)
    sd = open_checkpoint(path)
    assert torch.equal(sd["bias"], torch.zeros(100)) and sd["position_ids"].shape == (1, 8)
