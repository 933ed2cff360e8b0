"""Fuzzing every reader of stored bytes: any input parses or raises a CkptlabError subclass,
never another exception (which the CLI would report as an internal error)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptlab.errors import CkptlabError
from ckptlab.io.dcp import dcp_tree, read_metadata
from ckptlab.io.safetensors_file import open_safetensors
from ckptlab.run import framelog, records
from ckptlab.run.checkpoint import list_checkpoints, load_captured
from ckptlab.run.manifest import read_manifest
from tests.hostile.conftest import SAMPLE_RUN
from tests.io.checkpoints import write_dcp

FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def mutated(draw, data: bytes, max_edits: int = 8):
    """`data` with a few bytes overwritten, a slice deleted or inserted, or cut short."""
    out = bytearray(data)
    for _ in range(draw(st.integers(0, max_edits))):
        if not out:
            break
        op = draw(st.sampled_from(["set", "delete", "insert", "cut"]))
        i = draw(st.integers(0, len(out) - 1))
        if op == "set":
            out[i] = draw(st.integers(0, 255))
        elif op == "delete":
            del out[i : i + draw(st.integers(1, 16))]
        elif op == "insert":
            out[i:i] = draw(st.binary(min_size=1, max_size=16))
        else:
            del out[i:]
    return bytes(out)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def _expect_ckptlab_error(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except CkptlabError:
        return None


# --- log segments ---------------------------------------------------------------------------


def _small_segment() -> bytes:
    segs = sorted((SAMPLE_RUN / "batches" / "rank0").glob("s*.log"), key=lambda p: p.stat().st_size)
    data = segs[0].read_bytes()
    refs = framelog._scan_buffer(segs[0], data, True).frames
    return data[: refs[min(3, len(refs) - 1)].offset + refs[min(3, len(refs) - 1)].length]  # a few frames


SEGMENT = _small_segment()


@FUZZ
@given(data=st.one_of(mutated(SEGMENT), st.binary(max_size=200).map(lambda b: framelog.FILE_MAGIC + b)))
def test_fuzz_segment_scan_and_decode(work, data):
    path = work / "s000-000000000.log"
    path.write_bytes(data)
    _expect_ckptlab_error(framelog.scan, path, verify=True)
    try:
        for ref, payload in framelog.iter_payloads(path):
            if ref.kind == framelog.BATCH:
                _expect_ckptlab_error(records.decode_batch, payload, where=str(path))
            elif ref.kind == framelog.STEP:
                _expect_ckptlab_error(records.decode_step, payload, where=str(path))
            else:
                _expect_ckptlab_error(records.decode_json, payload, where=str(path))
    except CkptlabError:
        pass


# --- the codec (batch records) ----------------------------------------------------------------

BATCH = records.encode_batch(
    3,
    {"ids": torch.arange(12).view(3, 4), "mask": [torch.ones(2, dtype=torch.bool), 1.5, "x"], "n": (1, None)},
    [1, 2, 3],
    None,
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=4)
        | st.dictionaries(
            st.sampled_from(["t", "v", "k", "ref", "dtype", "shape", "perm", "b64", "module", "name", "fields"]),
            kids,
            max_size=5,
        )
    ),
    max_leaves=20,
)
tags = st.sampled_from(
    [
        "dict",
        "list",
        "tuple",
        "namedtuple",
        "tensor",
        "ndarray",
        "npscalar",
        "float",
        "bytes",
        "dtype",
        "device",
        "size",
        "??",
    ]
)


@st.composite
def specs(draw):
    node = draw(
        st.dictionaries(
            st.sampled_from(
                ["v", "k", "ref", "dtype", "shape", "perm", "b64", "module", "name", "fields", "order", "raw", "stored"]
            ),
            json_values,
            max_size=5,
        )
    )
    node["t"] = draw(tags)
    return node


@FUZZ
@given(
    payload=st.one_of(
        mutated(BATCH, 4),
        specs().map(
            lambda s: records.pack({"step": 1, "batch": s, "sample_ids": None}, {"batch/ids": torch.arange(4)})
        ),
    )
)
def test_fuzz_batch_record_decode(payload):
    _expect_ckptlab_error(records.decode_batch, payload, where="fuzz")


# --- safetensors headers --------------------------------------------------------------------


@FUZZ
@given(
    header=st.one_of(
        st.binary(max_size=64),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.dictionaries(st.text(max_size=4), json_values, max_size=3).map(lambda v: json.dumps(v).encode()),
    ),
    body=st.binary(max_size=64),
)
def test_fuzz_safetensors_header(work, header, body):
    path = work / "f.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + body)
    try:
        refs, _, _, file = open_safetensors(path)
    except CkptlabError:
        return
    for ref in refs.values():
        _expect_ckptlab_error(ref.load)
    file.close()


# --- DCP metadata -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dcp_folder(work) -> Path:
    return write_dcp(work / "dcp", {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(3)})


@FUZZ
@given(data=st.data())
def test_fuzz_dcp_metadata(work, dcp_folder, data):
    folder = work / "dcp-mutated"
    if not folder.exists():
        shutil.copytree(dcp_folder, folder)
    (folder / ".metadata").write_bytes(data.draw(mutated((dcp_folder / ".metadata").read_bytes(), 4)))
    try:
        read_metadata(folder)
        tree, _, closers = dcp_tree(folder)
    except CkptlabError:
        return
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        else:
            _expect_ckptlab_error(node.load)
    for close in closers:
        close()


# --- manifest.json and COMMIT.json ------------------------------------------------------------

MANIFEST = (SAMPLE_RUN / "manifest.json").read_bytes()
COMMIT = sorted((SAMPLE_RUN / "checkpoints").glob("step-*"))[0].joinpath("COMMIT.json").read_bytes()


@FUZZ
@given(data=st.one_of(mutated(MANIFEST, 4), st.binary(max_size=64), json_values.map(lambda v: json.dumps(v).encode())))
def test_fuzz_manifest(work, data):
    run = work / "run-m"
    run.mkdir(exist_ok=True)
    (run / "manifest.json").write_bytes(data)
    _expect_ckptlab_error(read_manifest, run)


@FUZZ
@given(data=st.one_of(mutated(COMMIT, 4), st.binary(max_size=64), json_values.map(lambda v: json.dumps(v).encode())))
def test_fuzz_commit_json(work, data):
    run = work / "run-c"
    ckpt = run / "checkpoints" / "step-000000001"
    if not ckpt.exists():
        shutil.copytree(sorted((SAMPLE_RUN / "checkpoints").glob("step-*"))[0], ckpt)
    (ckpt / "COMMIT.json").write_bytes(data)
    found, problems = list_checkpoints(run)  # never raises: a bad commit is a problem listed
    assert len(found) + len(problems) == 1
    if found:
        _expect_ckptlab_error(found[0].verify)
        _expect_ckptlab_error(load_captured, ckpt)
