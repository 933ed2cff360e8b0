"""A step batch that is a plain list of micro-batches (#25 item 6): its rows are found across
the micro-batches for the row-alone replays, the counterfactuals, the minimal culprit and the
trace, and an ordinary `(x, y)` batch is never read as micro-batches."""

import pytest
import torch

from ckptlab.analysis.batches import batch_rows, micro_row, micro_rows, row_groups, select_rows
from ckptlab.replayer.trace import Tracer
from tests import micro_list_models as ml


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("micro_nan") / "run"
    ml.record(run_dir, "nan")
    return run_dir


@pytest.fixture(scope="module")
def token_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("micro_token") / "run"
    ml.record(run_dir, "token")
    return run_dir


def test_a_list_of_micro_batches_is_read_by_the_sample_ids():
    parts = ml.batch(0)
    n = ml.MICRO * ml.ROWS
    assert micro_rows(parts, n) == [4, 4] and micro_rows(parts) is None  # only given the rows
    assert [(first, k) for first, _, k in row_groups(parts, n)] == [(0, 4), (4, 4)]
    assert micro_row(parts, 6, n) == (1, 2)
    picked = select_rows(parts, [1, 6, 7], n)
    assert isinstance(picked, list) and [len(p[0]) for p in picked] == [1, 2]
    assert torch.equal(picked[1][0], parts[1][0][2:4])
    assert select_rows(parts, [5], n)[0][1].shape == (1, 1)  # the kept micro-batch only


def test_an_ordinary_tuple_batch_is_not_micro_batches():
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    assert micro_rows((x, y), 8) is None and batch_rows((x, y), list(range(8))) == 8
    assert [k for _, _, k in row_groups((x, y), 8)] == [8]
    assert select_rows((x, y), [2], 8)[0].shape == (1, 3)
    tokens, targets = torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long)
    assert micro_rows((tokens, targets), 8) is None  # sequence-first (T=4, B=8), not 2 x 4 rows
    views = ({"x": x}, {"x": x})  # two views of the same 8 rows (a contrastive pair)
    assert micro_rows(views, 8) is None


def test_replay_names_the_micro_batch_row_and_sample(nan_run, cli):
    r = cli("replay", "--run", nan_run, "--step", ml.BAD_STEP, "--json", "--budget", 8)
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["root_step"] == ml.BAD_STEP and doc["origin"]["kind"] == "data"
    assert [(s["micro_batch"], s["row"], s["sample_id"]) for s in doc["samples"]] == [
        (ml.BAD_MICRO, ml.BAD_ROW, ml.BAD_SAMPLE)
    ]
    without = next(c for c in doc["counterfactuals"] if "without the blamed rows" in c["question"])
    assert without["fault"] is False, without
    culprit = doc["culprit"]
    assert (culprit["micro_batches"], culprit["rows"], culprit["sample_ids"]) == (
        [ml.BAD_MICRO],
        [ml.BAD_ROW],
        [ml.BAD_SAMPLE],
    ), culprit


def test_a_row_that_raises_alone_is_blamed_not_every_row(token_run, cli):
    r = cli("replay", "--run", token_run, "--step", ml.BAD_STEP, "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["root_step"] == ml.BAD_STEP and doc["origin"]["kind"] == "exception"
    assert doc["origin"]["op"] == "IndexError"
    assert not any("every row raises" in n for n in doc["notes"]), doc["notes"]
    s = doc["samples"][0]
    assert (s["micro_batch"], s["row"], s["sample_id"]) == (ml.BAD_MICRO, ml.BAD_ROW, ml.BAD_SAMPLE)
    without = next(c for c in doc["counterfactuals"] if "without the blamed rows" in c["question"])
    assert without["fault"] is False, without


def test_the_trace_maps_each_micro_batch_to_its_rows():
    model, opt = ml.build()
    parts = ml.batch(0)
    parts[1][1][2, 0] = 1e38  # micro-batch 1 row 2: its squared error overflows
    with Tracer(model, opt, rows=ml.MICRO * ml.ROWS, batch=parts) as tr:
        for tokens, y in parts:
            ((model(tokens) - y) ** 2).mean().backward()
    assert tr.micro_batches == 2
    assert tr.origin is not None and tr.origin.op == "aten.pow.Tensor_Scalar" and tr.origin.bad_rows == {6: 1}


def test_dirty_finds_the_sample_across_the_micro_batches(nan_run, cli):
    r = cli("dirty", "--run", nan_run, "--json", "--no-attribute")
    assert r.code == 0, r.err
    top = r.json()["flagged"][0]
    assert (top["step"], top["row"], top["sample_id"], top["reason"]) == (ml.BAD_STEP, 6, ml.BAD_SAMPLE, "nonfinite")
