"""The deeper searches of replay (ckptlab/replayer/search.py): the minimal culprit and its
transplant into a healthy batch, the earlier step that doomed the root step, and the budget."""

import ckptlab
from ckptlab.replayer.search import Budget, ddmin
from tests import fault_models as fm
from tests import padding_models as pm


def test_ddmin_finds_a_one_minimal_subset_within_its_budget():
    needed = {3, 11}
    calls = []

    def test(xs):
        calls.append(xs)
        return needed <= set(xs)

    found, complete = ddmin(list(range(16)), test)
    assert sorted(found) == [3, 11] and complete
    budget = Budget(3)
    found, complete = ddmin(list(range(16)), lambda xs: test(xs) if budget.take("t") else None)
    assert not complete and needed <= set(found) and budget.ran_out == ["t"]


def test_minimal_culprit_is_the_row_and_the_feature_and_the_data_alone(run_dir):
    """x[4, 2] is NaN at step 27: the culprit is row 4, position 2 of x, and it faults in
    another step's batch and from an older state: the data alone."""
    exp = fm.record_input_nan(run_dir)
    doc = ckptlab.replay(run_dir, exp.symptom).to_json()
    c = doc["culprit"]
    assert c["rows"] == [4] and c["sample_ids"] == exp.sample_ids and c["minimal"]
    assert c["fields"] == ["[0]"] and c["positions"] == [2]
    assert c["transplant_step"] == 26 and c["transplant_fault"] is True
    assert c["cause"] == "data alone"
    assert doc["rewind"] is None  # the batch alone explains it: no search back
    assert 0 < doc["budget"]["used"] <= doc["budget"]["replays"] and doc["budget"]["ran_out"] == []
    assert "position 2 of batch[0]" in doc["verdict"] and "data alone" in doc["verdict"]


def test_a_fault_doomed_by_an_earlier_step_names_that_step(run_dir):
    """A blank batch at step 21 makes the delayed input scale tiny; step 22's normal batch then
    overflows float16. Step 22's batch is harmless from an older state, so replay searches back
    and names step 21; the rows of step 22 fault in step 21's batch from this state: data x
    model state."""
    exp = fm.record_delayed_scale(run_dir)
    report = ckptlab.replay(run_dir, exp.symptom)
    assert report.root_step == 22 and report.reproduced
    assert report.rewind is not None and report.rewind.step == 21 and report.rewind.complete
    assert report.rewind.searched == [20, 21]
    assert report.culprit is not None and report.culprit.cause == "data x model state"
    assert "without step 21, step 22 does not fault" in report.verdict


def test_budget_zero_skips_the_searches_and_a_small_one_says_it_ran_out(run_dir, cli):
    exp = fm.record_delayed_scale(run_dir)
    none = ckptlab.replay(run_dir, exp.symptom, budget=0)
    assert none.culprit is None and none.rewind is None and none.budget is None
    out = cli("replay", "--run", run_dir, "--step", 22, "--budget", 2, "--json")
    assert out.code == 0, out.err
    doc = out.json()
    assert doc["budget"]["used"] == 2 and doc["budget"]["ran_out"]
    assert "budget" in doc["verdict"]


def test_adam_second_moment_out_of_tune_is_an_optimizer_fault_named_and_proven(run_dir):
    """Features that switch on at step 25: Adam's exp_avg_sq of the matrix on them is 0 when
    their first gradient arrives, so the matrix moves ~100x its norm and the loss spikes at
    step 26. Replay names the parameter and the state, and proves it: with the second moment
    in tune with the gradient, the fault is gone."""
    exp = fm.record_late_feature(run_dir)
    doc = ckptlab.replay(run_dir, exp.symptom).to_json()
    assert doc["root_step"] == 25 and doc["reproduced"]
    o = doc["origin"]
    assert o["kind"] == "optimizer" and o["parameter"] == "late" and o["state"] == "exp_avg_sq"
    proof = next(c for c in doc["counterfactuals"] if "second moment" in c["question"])
    assert proof["fault"] is False
    assert "exp_avg_sq" in doc["verdict"] and "fault vanishes" in doc["verdict"] and doc["samples"] == []


def test_a_half_module_that_hands_float16_on_needs_the_whole_model_in_float32(run_dir):
    """half_block.proj overflows float16, but the block hands its output on in float16: only
    with the whole model in float32 does the step stay finite (the outlier row still spikes)."""
    exp = fm.record_fp16_overflow(run_dir)
    report = ckptlab.replay(run_dir, exp.symptom, budget=0)
    assert report.origin.kind == "precision" and report.origin.float32_module == ""
    asked = {c.question.split(" with ")[1]: c.fault for c in report.counterfactuals if "in float32?" in c.question}
    assert asked == {"`half_block.proj` in float32?": True, "the whole model in float32?": False}
    assert "whole model in float32 the step stays finite" in report.verdict


def test_the_culprit_positions_never_take_a_padded_healthy_row(run_dir):
    """x[3, 6] is NaN, at a real position; row 0, the first healthy row, is padding there, and
    the model clears padding. Row 1, padded nowhere, stands in for the culprit's other
    positions: it needs x alone at position 6 (with row 0's mask there, its NaN would be
    cleared, and the search would say it needs the mask too)."""
    pm.record(run_dir)
    c = ckptlab.replay(run_dir, pm.BAD_STEP).to_json()["culprit"]
    assert c["rows"] == [pm.BAD_ROW] and c["minimal"]
    assert (c["positions"], c["fields"]) == ([pm.BAD_POSITION], ["['x']"])
