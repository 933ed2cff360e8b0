"""The journal as columns (ckptlab/run/columns.py): the records come back exactly as written,
from a segment's summary or from its frames, and a summary that is stale, damaged or foreign
costs time, never a record."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptlab
from ckptlab.run import columns, framelog
from ckptlab.run.columns import Columns
from tests import models


def nan_equal(a, b) -> bool:
    """Records equal, NaN equal to NaN."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(nan_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(nan_equal(x, y) for x, y in zip(a, b))
    return a == b


numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**60), 2**60),
    st.booleans(),
    st.none(),
)
values = st.one_of(
    numbers,
    st.lists(st.floats(), max_size=4),
    st.lists(numbers, max_size=3),
    st.text(max_size=5),
    st.dictionaries(st.sampled_from("ab"), numbers, max_size=2),
)
scalar_records = st.dictionaries(
    st.sampled_from(["loss", "grad_norm", "lr", "rank_loss", "x", "y"]), values, max_size=6
)


@settings(max_examples=150, deadline=None)
@given(st.lists(scalar_records, max_size=6), st.data())
def test_any_records_come_back_exactly_through_a_summary(recs, data):
    steps = []
    for i, r in enumerate(recs):
        width = data.draw(st.sampled_from([3, 3, 2]))  # a stray array of another shape is left out
        steps.append((i, {"step": i, **r}, {"param_grad_norm": np.arange(width, dtype=np.float32) + i}))
    others = [(framelog.VALIDATION, 2, {"metrics": {"val_loss": float("nan")}})]
    cols, size = columns.decode(columns.encode(Columns.from_records(steps, others), 1234), "x")
    assert size == 1234
    for (_, want, _), got in zip(steps, columns.Rows(cols)):
        assert nan_equal(got, want), (got, want)
    assert nan_equal([list(o) for o in cols.others], [list(o) for o in others])
    rows, kept = cols.arrays.get("param_grad_norm", (np.zeros(0, dtype=np.int64), None))
    for r, a in zip(rows, kept if kept is not None else []):
        assert np.array_equal(a, steps[r][2]["param_grad_norm"])


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A run of 23 steps in 5 journal segments (a checkpoint every 5), with validations, a
    learning-rate schedule and a non-finite loss recorded (on_nonfinite="record")."""
    run_dir = tmp_path_factory.mktemp("cols") / "run"
    batches = list(models.mlp_batches(23))
    x, y = batches[17][0]
    batches[17] = ((x * float("nan"), y), batches[17][1])
    models.record_run(
        run_dir,
        models.build_mlp,
        models.step_mlp,
        batches,
        stop_on_nonfinite=False,
        on_nonfinite="record",
        ckpt_every=5,
        health_every=3,
        validate=lambda i, m: {"val_loss": 1.0 / (i + 1)} if i % 4 == 3 else None,
    )
    return run_dir


def metrics_and_more(run_dir):
    run = ckptlab.open_run(run_dir)
    return run, run.metrics()


def assert_same(a, b):
    (ra, ma), (rb, mb) = a, b
    for name in ma.__dataclass_fields__:
        x, y = getattr(ma, name), getattr(mb, name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True), name
    assert nan_equal(list(ma.scalars), list(mb.scalars))
    assert nan_equal(ra.validation(), rb.validation()) and nan_equal(ra.events(), rb.events())


def test_the_recorder_summarizes_each_journal_segment_and_readers_take_the_same_records(recorded, tmp_path):
    logs = sorted((recorded / "journal").glob("*.log"))
    assert len(logs) == 5 and all(columns.summary_path(p).is_file() for p in logs)
    from_frames = tmp_path / "frames"
    shutil.copytree(recorded, from_frames)
    for p in from_frames.glob("journal/*.cols"):
        p.unlink()
    summarized, decoded = metrics_and_more(recorded), metrics_and_more(from_frames)
    assert_same(summarized, decoded)
    run, m = summarized
    assert len(m) == 23 and not run.damaged and not run.problems
    assert math.isnan(m.loss[17]) and m.loss_known[17] and m.nonfinite_grads[17] > 0
    assert [v["step"] for v in run.validation()] == [4, 8, 12, 16, 20]
    assert any(e["kind"] == "nonfinite_loss" for e in run.events())


def test_a_stale_damaged_or_foreign_summary_is_passed_over_for_the_frames(recorded, tmp_path):
    want = metrics_and_more(recorded)
    run_dir = tmp_path / "run"
    shutil.copytree(recorded, run_dir)
    summaries = sorted((run_dir / "journal").glob("*.cols"))
    data = summaries[0].read_bytes()
    damaged = {
        "a flipped data byte": data[:-3] + bytes([data[-3] ^ 1]) + data[-2:],
        "cut short": data[: len(data) // 2],
        "empty": b"",
        "not safetensors": b"\x00" * 64,
        "another segment's": summaries[1].read_bytes(),  # (describes another size)
    }
    for what, bad in damaged.items():
        summaries[0].write_bytes(bad)
        got = metrics_and_more(run_dir)
        assert_same(got, want), what
        assert not got[0].damaged and not got[0].problems, what  # nothing lost: no damage to report
        if what == "a flipped data byte":
            with pytest.raises(ckptlab.errors.CorruptFileError, match="does not match its CRC"):
                columns.decode(bad, "x")
    # A segment that grew after its summary (a frame appended by hand): the frames are read.
    summaries[0].write_bytes(data)
    log = summaries[0].with_suffix(".log")
    with open(log, "ab") as f:
        f.write(framelog.pack_frame(framelog.EVENT, 3, b'{"kind": "manual", "note": "appended"}'))
    assert any(e.get("note") == "appended" for e in ckptlab.open_run(run_dir).events())


def test_a_run_killed_before_a_segment_was_summarized_reads_whole(recorded, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(recorded, run_dir)
    last = sorted((run_dir / "journal").glob("*.cols"))[-1]
    last.unlink()
    assert_same(metrics_and_more(run_dir), metrics_and_more(recorded))


def test_the_recorders_summaries_are_those_decoding_the_frames_makes(recorded, tmp_path):
    # The Recorder's writer builds each summary from the records it appended, not from the
    # frames: byte for byte what decoding the segment gives.
    for log in sorted((recorded / "journal").glob("*.log")):
        copy = tmp_path / log.name
        shutil.copy(log, copy)
        assert columns.write_summary(copy)
        assert columns.summary_path(copy).read_bytes() == columns.summary_path(log).read_bytes(), log.name


def test_appended_records_that_are_not_the_segments_are_not_used(recorded, tmp_path):
    log = sorted((recorded / "journal").glob("*.log"))[1]
    frames = list(framelog.iter_payloads(log))
    cols = Columns.from_frames(frames, "x")
    steps = [(int(s), r, {}) for s, r in zip(cols.step, columns.Rows(cols))]
    copy = tmp_path / log.name
    shutil.copy(log, copy)
    wrong = [
        (steps[:-1], cols.others),  # a record missing
        ([(s, {**r, "loss": 0.0}, a) for s, r, a in steps][::-1], cols.others),  # out of order
        (steps, []),  # the validations missing
        ([(s, {**r, "note": "text"}, a) for s, r, a in steps], cols.others),  # a value JSON would not give back as is
    ]
    for appended in wrong:
        columns.summary_path(copy).unlink(missing_ok=True)
        assert columns.write_summary(copy, appended)
        got = columns.load_summary(copy, copy.stat().st_size)
        assert got is not None and np.array_equal(got.step, cols.step)
        assert nan_equal(list(columns.Rows(got)), list(columns.Rows(cols)))
        assert "param_grad_norm" in got.arrays  # (from the frames: the appended had no arrays)


def test_per_parameter_rows_are_read_without_making_the_whole_field(recorded):
    """`Metrics.measured` and `Metrics.per_param` give what indexing the (S, P) field gives:
    the update ratios and weight norms of the health steps only, and any rows of a field."""
    m = ckptlab.open_run(recorded).metrics()
    for key in ("param_grad_norm", "update_ratio", "weight_norm", "weight_norm_before", "param_nonfinite"):
        dense = getattr(m, key)
        rows, values = m.measured(key)
        assert values.dtype == dense.dtype and np.array_equal(values, dense[rows], equal_nan=True), key
        rest = np.setdiff1d(np.arange(len(m)), rows)
        assert np.all(np.isnan(dense[rest])) if dense.dtype.kind == "f" else np.all(dense[rest] == 0), key
        for pick in (slice(None), slice(4, 11), np.array([0, 3, 5, 22]), np.array([], dtype=np.int64)):
            got = m.per_param(key, pick)
            assert got.dtype == dense.dtype and np.array_equal(got, dense[pick], equal_nan=True), (key, pick)
    health_rows, _ = m.measured("update_ratio")
    assert 0 < len(health_rows) < len(m)  # health_every=3: a third of the steps
    assert len(m.measured("param_grad_norm")[0]) == len(m)
    with pytest.raises(ValueError):  # every row held: the columns' own array, shared, so read-only
        m.param_grad_norm[0, 0] = 1.0
