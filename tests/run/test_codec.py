"""run/codec.py and run/records.py: batches round-trip bit for bit, and nothing is executed."""

from __future__ import annotations

import struct
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptlab.errors import CorruptFileError, RecordError
from ckptlab.run import codec, records
from tests.run import strategies
from tests.run.bits import assert_same

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(strategies.batches, st.booleans())
def test_codec_round_trips_bit_exact(batch, compact):
    spec, tensors = codec.encode(batch, prefix="batch", compact_ints=compact)
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in tensors.values())
    assert_same(codec.decode(spec, tensors), batch)


@SETTINGS
@given(strategies.batches, strategies.sample_ids)
def test_batch_record_round_trips_bit_exact(batch, ids):
    """Through the frame payload: safetensors bytes with the spec in its metadata."""
    payload = records.encode_batch(7, batch, ids, None)
    rec = records.decode_batch(payload, where="test")
    assert rec.step == 7 and rec.sample_ids == ids and rec.rng is None
    assert_same(rec.batch, batch)


def test_nan_payloads_and_signed_zeros_survive():
    f32 = (
        torch.tensor([0x7FC00001, 0xFFC12345, 0x7F800001, 0x80000000, 1], dtype=torch.int64)
        .to(torch.int32)
        .view(torch.float32)
    )
    bf16 = torch.tensor([0x7FC1, -1, 0x0001, -32768], dtype=torch.int16).view(torch.bfloat16)
    f16 = torch.tensor([0x7E01, 0xFC00 - 65536, 0x8000 - 65536], dtype=torch.int16).view(torch.float16)
    arr = np.array([0x7FF8000000000001, -1], dtype=np.int64).view(np.float64)
    batch = {"f32": f32, "bf16": bf16, "f16": f16, "np": arr, "py": [-0.0, float("inf"), float("-inf")]}
    rec = records.decode_batch(records.encode_batch(0, batch, None, None), where="test")
    assert_same(rec.batch, batch)
    assert struct.pack("<d", rec.batch["py"][0]) == struct.pack("<d", -0.0)


def test_token_ids_are_stored_compactly_with_their_dtype_kept():
    ids = torch.randint(0, 50_000, (16, 128))  # int64, as a tokenizer returns them
    spec, tensors = codec.encode({"ids": ids}, prefix="batch", compact_ints=True)
    assert tensors["batch/ids"].dtype == torch.uint16  # 2 bytes per token, not 8
    assert spec["v"][0]["stored"] == "uint16"
    back = codec.decode(spec, tensors)["ids"]
    assert back.dtype == torch.int64 and torch.equal(back, ids)


def test_layouts_are_restored():
    base = torch.arange(24.0).reshape(2, 3, 4)
    permuted = base.permute(2, 0, 1)
    spec, tensors = codec.encode(permuted, prefix="t")
    back = codec.decode(spec, tensors)
    assert back.stride() == permuted.stride() and torch.equal(back, permuted)
    fortran = np.asfortranarray(np.arange(6.0).reshape(2, 3))
    back = codec.decode(*codec.encode(fortran, prefix="a"))
    assert back.flags.f_contiguous and not back.flags.c_contiguous and np.array_equal(back, fortran)


def test_recorded_batch_is_a_snapshot():
    x = torch.zeros(3)
    a = np.zeros(3)
    spec, tensors = codec.encode({"x": x, "a": a}, prefix="batch")
    x += 1  # the training loop goes on mutating its buffers
    a += 1
    back = codec.decode(spec, tensors)
    assert back["x"].sum() == 0 and back["a"].sum() == 0


def test_every_other_leaf_type():
    batch = {
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "bytes": b"\x00\xff",
        "np_scalar": np.float16(1.5),
        "big_int": 2**100,
        "req_grad": torch.ones(2, requires_grad=True),
        "expanded": torch.arange(3).expand(4, 3),  # overlapping view: values exact, stored dense
    }
    back = codec.decode(*codec.encode(batch, prefix="batch"))
    assert_same(back, {**batch, "expanded": batch["expanded"].contiguous()})


def test_unimported_namedtuple_comes_back_as_a_look_alike_without_importing():
    spec, tensors = codec.encode(strategies.Pair(1, "x"), prefix="b")
    spec["module"] = "some_module_that_does_not_exist"
    before = set(sys.modules)
    back = codec.decode(spec, tensors)
    assert type(back).__name__ == "Pair" and back._fields == ("first", "second") and tuple(back) == (1, "x")
    assert set(sys.modules) == before


@pytest.mark.parametrize(
    "bad, words",
    [
        (np.array([object()], dtype=object), "object arrays"),
        (torch.eye(3).to_sparse(), "sparse"),
        (torch.ones(2, dtype=torch.complex64), "complex"),
        (object(), "cannot record an object of type object"),
    ],
)
def test_unrecordable_leaves_are_refused_by_path(bad, words):
    with pytest.raises(RecordError, match=words) as e:
        codec.encode({"inputs": [bad]}, prefix="batch")
    assert "batch/inputs/0" in str(e.value)


def test_decoding_refuses_what_it_would_have_to_execute_or_guess():
    with pytest.raises(ValueError, match="object dtype"):
        codec.decode({"t": "npscalar", "dtype": "|O", "b64": ""}, {})
    with pytest.raises(ValueError, match="unknown spec tag"):
        codec.decode({"t": "pickle", "v": "..."}, {})
    with pytest.raises(ValueError, match="missing tensor"):
        codec.decode({"t": "tensor", "ref": "nope", "dtype": "float32", "shape": [1]}, {})


def test_garbage_payload_is_a_corrupt_file_error():
    good = records.encode_batch(3, {"x": torch.ones(4)}, [1], None)
    for bad in (b"", b"\x00" * 7, good[:40], b"\xff" * 8 + good[8:]):
        with pytest.raises(CorruptFileError, match="unreadable record"):
            records.decode_batch(bad, where="seg.log@3")
