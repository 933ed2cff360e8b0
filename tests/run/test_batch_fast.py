"""run/batch_fast.py: the common batch record, byte for byte the general path's payload."""

from __future__ import annotations

import enum
from collections import namedtuple
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptlab.record.batches import plain_ids
from ckptlab.run import batch_fast, codec, records
from tests.run import strategies
from tests.run.bits import assert_same

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
Pair = namedtuple("Pair", "a b")


@pytest.fixture(autouse=True, params=["small ints from Python", "every tensor through numpy"])
def _both_paths(request, monkeypatch):
    """Every test on both ways of taking a tensor's data: small integer tensors packed from
    their Python values, and everything through numpy."""
    if request.param == "every tensor through numpy":
        monkeypatch.setattr(batch_fast, "SMALL_NUMEL", -1)


def general(step, batch, ids, rng=None) -> bytes:
    """records.encode_batch without its fast path."""
    with mock.patch.object(batch_fast, "encode_batch", lambda *a: None):
        return records.encode_batch(step, batch, ids, rng)


def check(batch, ids=None, step=7, *, fast: bool | None = None) -> bytes | None:
    """The fast path's payload is None or the general path's bytes, and decodes to the batch;
    `fast`: whether it must be taken (True) or left to the general path (False)."""
    want = general(step, batch, ids)
    got = batch_fast.encode_batch(step, batch, ids)
    if fast is not None:
        assert (got is not None) == fast
    if got is not None:
        assert got == want
    payload = records.encode_batch(step, batch, ids, None)
    assert payload == want
    rec = records.decode_batch(payload, where="test")
    assert rec.step == step and rec.sample_ids == ids and rec.rng is None
    assert_same(rec.batch, batch)
    return got


def ids_tensor(values, dtype=torch.int64, shape=None) -> torch.Tensor:
    t = torch.tensor(values, dtype=dtype)
    return t.reshape(shape) if shape is not None else t


# values -> the dtype the codec stores them in (None: as they are)
INT64_RANGES = [
    ([0, 5, 255], "uint8"),
    ([-128, 0, 127], "int8"),
    ([-5, -1], "int8"),
    ([0, 256], "uint16"),
    ([4095, 17, 0], "uint16"),
    ([0, 65535], "uint16"),
    ([-129, 5], "int16"),
    ([-32768, 32767], "int16"),
    ([0, 65536], "int32"),
    ([-(2**31), 2**31 - 1], "int32"),
    ([0, 2**31], None),
    ([-(2**31) - 1, 0], None),
    ([-(2**63), 2**63 - 1], None),
    ([2**63 - 1], None),
]


@pytest.mark.parametrize(("values", "stored"), INT64_RANGES)
def test_int64_ids_are_compacted_as_the_codec_does(values, stored):
    t = ids_tensor(values)
    check({"ids": t}, [0, 1], fast=True)
    spec, tensors = codec.encode({"ids": t}, prefix="batch", compact_ints=True)
    assert spec["v"][0].get("stored") == stored  # the cases cover each choice
    for dtype in (torch.int32, torch.int16):  # narrower sources: kept when not smaller
        if all(torch.iinfo(dtype).min <= v <= torch.iinfo(dtype).max for v in values):
            check([t.to(dtype), t.to(dtype).reshape(1, -1)], fast=True)


@pytest.mark.parametrize(
    "batch",
    [
        {"ids": torch.randint(0, 4096, (4, 33)), "mask": torch.ones(4, 33, dtype=torch.bool)},
        torch.randint(0, 4096, (16, 129)),
        [torch.randint(-9, 9, (3,)), torch.randn(2, 3)],
        (torch.randn(3, dtype=torch.float64), torch.randn(2).to(torch.float16), torch.randn(2, 2).to(torch.bfloat16)),
        {"x": torch.empty(0, dtype=torch.int64), "y": torch.empty(2, 0), "z": torch.tensor(3), "w": torch.tensor(-3.5)},
        {"u8": torch.arange(7, dtype=torch.uint8), "i8": torch.arange(-3, 3, dtype=torch.int8)},
        {"u16": torch.arange(5).to(torch.uint16), "i32": torch.arange(70000, 70003, dtype=torch.int32)},
        {"n": 3, "s": 'caf\u00e9 "q" \\', "none": None, "flag": True, "ids": torch.arange(4)},
        {"zé": torch.arange(3), 'q"k': torch.arange(2), "a/0": torch.arange(2), "a": [torch.arange(5)]},
        {"a": [torch.arange(5)], "a/0": torch.arange(2)},  # the same path twice: "batch/a/0#2"
        {"outer": {"inner": [torch.arange(3), (torch.randn(2), "x")]}, "b": []},
        {},
        [],
        (),
        None,
        5,
        "text",
        torch.tensor([[1, 2], [3, 4]])[1:],  # contiguous, at an offset in its storage
    ],
)
@pytest.mark.parametrize("ids", [None, [0, 1, 2, 3], ["a", "b\u00e9"], [2**63 - 1, -5]])
def test_common_batches_take_the_fast_path_with_the_same_bytes(batch, ids):
    check(batch, ids, fast=True)


@pytest.mark.parametrize(
    "batch",
    [
        {"ids": torch.arange(12).reshape(3, 4).t()},  # transposed: the spec carries its permutation
        {"ids": torch.arange(12)[::2]},  # gappy
        {"x": torch.randn(3, requires_grad=True)},
        {"a": np.arange(5)},
        {"f": 0.5, "ids": torch.arange(3)},
        {"f": -0.0},
        {1: torch.arange(3)},  # a key that is not a string
        Pair(torch.arange(2), torch.arange(3)),
        [torch.arange(3), Pair(1, 2)],
        {"u32": torch.arange(3).to(torch.uint32)},
        {"s": torch.Size([2, 3])},
        {"b": b"bytes"},
    ],
)
def test_other_batches_take_the_general_path(batch):
    check(batch, [1, 2], fast=False)


def test_a_tensor_subclass_takes_the_general_path():
    batch = {"w": torch.nn.Parameter(torch.randn(2), requires_grad=False)}
    assert batch_fast.encode_batch(1, batch, None) is None
    assert records.encode_batch(1, batch, None, None) == general(1, batch, None)


def test_a_step_that_is_not_a_plain_int_and_rng_states_take_the_general_path():
    batch = {"ids": torch.arange(6)}
    assert batch_fast.encode_batch(np.int64(3), batch, None) is None  # type: ignore[arg-type]
    rng = {"torch": torch.get_rng_state()}
    rec = records.decode_batch(records.encode_batch(3, batch, [1], rng), where="test")
    assert_same(rec.rng, rng)
    assert_same(rec.batch, batch)


def test_records_encode_batch_does_not_call_the_codec_for_a_common_batch():
    with mock.patch.object(codec, "encode", side_effect=AssertionError("general path")):
        payload = records.encode_batch(3, {"ids": torch.randint(0, 4096, (4, 33))}, [0, 1, 2, 3], None)
    assert records.decode_batch(payload, where="test").step == 3


@SETTINGS
@given(strategies.batches, strategies.sample_ids, st.integers(0, 2**40))
def test_any_batch_is_the_general_paths_bytes_or_none(batch, ids, step):
    check(batch, ids, step)


fast_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.text(max_size=6),
    strategies.tensors().map(lambda t: t.contiguous()),
)
fast_batches = st.recursive(
    fast_leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=4), children, max_size=3),
    ),
    max_leaves=6,
)


@SETTINGS
@given(fast_batches, strategies.sample_ids)
def test_contiguous_batches_always_take_the_fast_path(batch, ids):
    check(batch, ids, fast=True)


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.float32, torch.bfloat16, torch.bool])
def test_a_batch_changed_after_its_record_does_not_change_the_record(dtype):
    t = torch.arange(12).reshape(3, 4).to(dtype)
    batch = {"ids": t, "more": [t[1:]]}
    want = general(5, {"ids": t.clone(), "more": [t[1:].clone()]}, [1])
    payload = records.encode_batch(5, batch, [1], None)
    t.zero_() if dtype is torch.bool else t.add_(1)
    assert payload == want


def test_a_changed_structure_never_gets_an_older_header():
    ids = torch.randint(0, 4096, (4, 33))
    batches = [
        {"ids": ids},
        {"ids": ids[:2].clone()},  # same key, new shape
        {"ids": ids.to(torch.int32)},  # new dtype
        {"ids": ids % 200},  # new stored dtype (uint8)
        {"ids": ids - 5000},  # int16
        {"ids": ids, "mask": ids > 7},  # an extra key
        {"mask": ids > 7, "ids": ids},  # the same keys in another order
        {"idz": ids},  # another key
        [ids],
        (ids,),
        {"ids": ids, "n": 1},
        {"ids": ids, "n": 2},  # a leaf's value
        {"ids": ids, "n": True},  # equal to 1, another type
        {"ids": ids, "n": "1"},
        {"ids": [ids, ids]},
        {"ids": [[ids], ids]},
    ]
    for _ in range(2):  # the second time, from the cache
        for step, batch in enumerate(batches):
            check(batch, [step], step=step, fast=True)


def test_the_cache_stays_bounded():
    for n in range(batch_fast._CACHE_MAX * 2):
        check({"ids": torch.arange(3), "n": n}, fast=True)
    assert len(batch_fast._CACHE) <= batch_fast._CACHE_MAX


class Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize(
    ("ids", "want"),
    [
        ([1, 2, 3], [1, 2, 3]),
        (["a", "b"], ["a", "b"]),
        ([1, "a"], [1, "a"]),
        ((4, 5), [4, 5]),
        ([], []),
        ([True, 2], ["True", 2]),
        ([np.int64(3), 4], [3, 4]),
        ([b"x", 1.5], ["x", "1.5"]),
        ([Color.RED], [Color.RED]),
        (torch.tensor([7, 8]), [7, 8]),
        (np.array([9, 10]), [9, 10]),
        (range(3), [0, 1, 2]),
    ],
)
def test_plain_ids(ids, want):
    got = plain_ids(ids)
    assert got == want and [type(i) for i in got] == [type(i) for i in want]
    assert type(got) is list and got is not ids
    if isinstance(ids, list):
        got.append("new")
        assert "new" not in ids  # a copy: the caller may reuse its list


def test_sample_ids_the_json_encoder_refuses_raise_as_on_the_general_path():
    circular: list = [1]
    circular.append(circular)
    for ids in (circular, [object()]):
        with pytest.raises((ValueError, TypeError)) as general_error:
            general(1, {"ids": torch.arange(3)}, ids)
        with pytest.raises(general_error.type):
            records.encode_batch(1, {"ids": torch.arange(3)}, ids, None)


def test_the_sample_ids_encoder_writes_what_records_json_does():
    ids = [1, 2.5, None, True, 'caf\u00e9 "\\\n']
    assert batch_fast._ids_json(ids) == records._JSON(ids)
