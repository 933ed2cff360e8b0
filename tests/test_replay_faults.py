"""Replay finds the root step, module, op and data sample of each planted fault."""

import numpy as np
import pytest
import torch

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
    "micro_batch_ignored_targets",  # one-row micro-batches: the trace maps the loss to its row
    "micro_batch_copied",  # micro-batches copied out of the batch: taken in order
    "micro_batch_pairs",  # two-row micro-batches: the rows that fail alone
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
    assert report.root_step == exp.step and report.left_record_step == exp.symptom  # named, though not reproduced
    assert report.to_json()["root_step"] == exp.step
    assert report.deterministic  # every step before it matched bit for bit
    assert report.origin.kind == "none" and report.samples == []
    assert "did not reproduce" in report.verdict and "transient" in report.verdict
    # The recorded step had NaN gradients, so the Recorder kept the norms of the weights before
    # its update: fc1.weight was already NaN then (changed outside the step), the others not.
    m = ckptlab.open_run(run_dir).metrics()
    assert np.isnan(m.weight_norm_before[: exp.step]).all()  # kept only where some were bad
    bad = [n for n, norm in zip(m.param_names, m.weight_norm_before[exp.step]) if not np.isfinite(norm)]
    assert bad == ["fc1.weight"]
    assert report.origin.parameter == "fc1.weight"
    assert "`fc1.weight` already non-finite when step 24 began, before its update" in report.verdict


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


def test_micro_batch_loop_blames_the_row_in_json_and_cli(run_dir, cli):
    """A nanoGPT-shaped step_fn: one-row micro-batches, one of them all ignore_index (0/0)."""
    exp = fm.record_micro_batch_ignored_targets(run_dir)
    doc = ckptlab.replay(run_dir, exp.symptom).to_json()
    assert doc["root_step"] == exp.step and doc["reproduced"] and doc["deterministic"]
    assert doc["origin"]["kind"] == "numeric" and doc["origin"]["op"] == "aten.nll_loss_forward.default"
    assert doc["samples"][0]["sample_id"] == exp.sample_ids[0] and doc["samples"][0]["row"] == exp.rows[0]
    assert "empty" in doc["samples"][0]["reason"] and str(exp.sample_ids[0]) in doc["verdict"]
    out = cli("replay", "--run", run_dir, "--step", exp.symptom, "--json")
    assert out.code == 0, out.err
    shown = out.json()
    assert shown["root_step"] == exp.step and shown["origin"]["kind"] == "numeric"
    assert shown["samples"][0]["sample_id"] == exp.sample_ids[0]
    assert shown["verdict"] == doc["verdict"]


def test_ignored_labels_are_not_out_of_range_token_ids(run_dir):
    """With data_info's vocab_size known, a -100 label (the ignore_index) is not a bad token id:
    the all-ignored row is blamed as empty, and no row is called out of range."""
    exp = fm.record_micro_batch_ignored_targets(run_dir, data_info={"vocab_size": 32})
    doc = ckptlab.replay(run_dir, exp.symptom).to_json()
    assert doc["samples"][0]["row"] == exp.rows[0] and "empty" in doc["samples"][0]["reason"]
    assert not any("outside [0" in s["reason"] for s in doc["samples"]), doc["samples"]


def test_micro_batch_loop_without_trace_blames_the_row_that_fails_alone(run_dir):
    exp = fm.record_micro_batch_ignored_targets(run_dir)
    report = ckptlab.replay(run_dir, exp.symptom, trace=False)
    assert report.root_step == exp.step and report.origin.kind == "data"
    assert [s.sample_id for s in report.samples] == exp.sample_ids
    assert "alone" in report.samples[0].reason
    assert report.verdict.startswith(f"Step {exp.step}: row {exp.rows[0]} (sample {exp.sample_ids[0]}) alone")


def test_an_outsized_weight_is_told_from_its_peers_or_its_default_init():
    from ckptlab.replayer.parameters import outsized_weight

    torch.manual_seed(0)
    heads = torch.nn.ModuleDict({"heads": torch.nn.ModuleList(torch.nn.Linear(16, 1) for _ in range(3))})
    assert outsized_weight(heads, "heads.2") is None  # all three alike
    with torch.no_grad():
        heads["heads"][2].weight.mul_(1000)
    name, why = outsized_weight(heads, "heads.2")
    assert name == "heads.2.weight" and "its peers' (heads.0.weight, heads.1.weight)" in why
    assert outsized_weight(heads, "heads.0") is None  # the others are not blamed
    lone = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Embedding(100, 4096))
    assert outsized_weight(lone, "") is None  # an Embedding's N(0, 1) init is not outsized
    with torch.no_grad():
        lone[0].weight.normal_(0, 100)
    name, why = outsized_weight(lone, "0")
    assert name == "0.weight" and "default init for fan-in 64" in why


def test_a_malformed_recorded_rng_state_is_damage_not_the_users_step():
    """A batch record whose RNG states cannot be restored (a crafted or damaged record) is one
    CorruptFileError naming the step, not "step_fn raised ValueError" blamed on the user."""
    from pathlib import Path

    from ckptlab.errors import CorruptFileError
    from ckptlab.replayer.driver import Replayer

    run = ckptlab.open_run(Path(__file__).resolve().parent.parent / "sample_ckpts" / "tinylm-nan")
    replayer = Replayer(run)
    runner = replayer.build()
    rec = replayer.batch(5000)
    rec.rng = {**(rec.rng or {}), "python": (3, "x", None)}
    with pytest.raises(CorruptFileError, match="step 5000's recorded RNG states cannot be restored"):
        replayer.run_step(runner, rec)
    replayer.close(runner)


def test_batches_lost_to_a_damaged_log_are_not_blamed_on_retention(tmp_path):
    import shutil
    from pathlib import Path

    run_dir = tmp_path / "run"
    shutil.copytree(Path(__file__).resolve().parent.parent / "sample_ckpts" / "tinylm-nan", run_dir)
    log = run_dir / "batches" / "rank0" / "s000-000005000.log"
    log.write_bytes(log.read_bytes()[: log.stat().st_size // 2])
    with pytest.raises(ckptlab.CkptlabError, match="a batch log is damaged: .*s000-000005000.log") as e:
        ckptlab.replay(ckptlab.open_run(run_dir), 5432)
    assert "retention" not in str(e.value)
