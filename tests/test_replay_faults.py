"""Replay finds the root step, module, op and data sample of each planted fault."""

import pytest

import ckptlab
from tests import fault_models as fm

SAMPLE_FAULTS = [
    "input_nan",
    "input_overflow",
    "empty_bag",
    "log_negative",
    "fp16_overflow",
    "masked_attention",
    "huge_target",
]


@pytest.mark.parametrize("fault", SAMPLE_FAULTS)
def test_fault_is_localized_to_step_module_and_sample(fault, run_dir):
    exp = getattr(fm, f"record_{fault}")(run_dir)
    report = ckptlab.replay(run_dir, exp.symptom)
    assert report.reproduced and report.deterministic
    assert report.root_step == exp.step
    assert report.origin.module == exp.module
    if exp.kind:
        assert report.origin.kind == exp.kind
    if exp.op:
        assert report.origin.op == exp.op
    assert [s.row for s in report.samples] == exp.rows
    assert [s.sample_id for s in report.samples] == exp.sample_ids
    # the proof: without the blamed rows the root step is healthy
    assert report.counterfactuals[0].fault is False
    assert str(exp.sample_ids[0]) in report.verdict


def test_symptom_after_root_names_the_earlier_step(run_dir):
    exp = fm.record_huge_target(run_dir)
    assert exp.symptom > exp.step  # the NaN shows one step after the explosion
    report = ckptlab.replay(run_dir, exp.symptom)
    assert report.root_step == exp.step
    assert f"Step {exp.step}" in report.verdict and f"step {exp.symptom}" in report.verdict


def test_learning_rate_spike_blames_the_optimizer_and_no_sample(run_dir):
    exp = fm.record_lr_spike(run_dir)
    report = ckptlab.replay(run_dir, exp.symptom)
    assert report.root_step == 18
    assert report.origin.kind == "optimizer"
    assert report.samples == []
    assert report.origin.parameter is not None
    lr_check = report.counterfactuals[0]
    assert "learning rate" in lr_check.question and lr_check.fault is False


def test_weight_corrupted_outside_step_fn_does_not_reproduce(run_dir):
    exp = fm.record_corrupted_weight(run_dir)
    report = ckptlab.replay(run_dir, exp.symptom)
    assert report.fault_recorded and not report.reproduced
    assert report.deterministic  # every step before it matched bit for bit
    assert report.origin.kind == "none" and report.samples == []
    assert "did not reproduce" in report.verdict and "transient" in report.verdict


def test_json_has_the_contract_keys(run_dir):
    exp = fm.record_masked_attention(run_dir)
    doc = ckptlab.replay(run_dir, exp.symptom).to_json()
    assert list(doc)[:7] == [
        "requested_step",
        "root_step",
        "reproduced",
        "deterministic",
        "origin",
        "samples",
        "verdict",
    ]
    assert set(doc["origin"]) >= {"kind", "phase", "module", "op", "parameter", "source"}
    assert doc["origin"]["source"].startswith("fault_models.py:")
    assert doc["samples"][0] == {**doc["samples"][0], "row": 5, "sample_id": 1205}
