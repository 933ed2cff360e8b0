"""The seams between the user's code and replay, on loops of shapes found in public training
code (tests/seams_models.py): the user's exception is never ckptlab's internal error, every
experiment that the user's code refuses fails alone, the root is the first anomaly of the
episode whatever the symptom, and a step that raised because a value went non-finite is traced
to the op that made it."""

from __future__ import annotations

import logging

import pytest

import ckptlab
from ckptlab.replayer.investigation import Investigation
from ckptlab.replayer.rewind import earlier_cause
from ckptlab.replayer.rootstep import RootStep
from ckptlab.replayer.search import Budget, _transplant
from ckptlab.run.reader import open_run
from ckptlab.training.crash import call_through, is_step_error
from tests import seams_models as sm


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("seams")
    return {
        "lm": (root / "lm", sm.record_word_lm(root / "lm")),
        "strict": (root / "strict", sm.record_word_lm(root / "strict", checksum=True)),
        "vae": (root / "vae", sm.record_vae_overflow(root / "vae")),
        "vae_lr": (root / "vae_lr", sm.record_vae_lr_explosion(root / "vae_lr")),
        "bn": (root / "bn", sm.record_batchnorm_nan(root / "bn")),
    }


def replay_json(cli, run_dir, step, *more):
    r = cli("replay", "--run", run_dir, "--step", step, "--json", *more)
    assert r.code == 0, r.err
    return r.json()


def test_rows_are_removed_from_a_flattened_target_as_from_the_sequence_first_data(runs, cli):
    """`targets` is the (bptt, B) chunk flattened to (bptt*B,): the step without a row, and each
    row alone, take that row's elements out of it too (else cross-entropy raises on 15 inputs
    against 20 targets)."""
    run_dir, exp = runs["lm"]
    doc = replay_json(cli, run_dir, exp.symptom)
    assert doc["root_step"] == exp.step and doc["bit_exact"] and doc["origin"]["kind"] == "data"
    assert [s["sample_id"] for s in doc["samples"]] == exp.sample_ids  # the NaN in its column of the carried state
    assert doc["failed_experiments"] == []
    without = doc["counterfactuals"][0]
    assert "without the blamed rows" in without["question"] and without["fault"] is False
    assert doc["culprit"]["sample_ids"] == exp.sample_ids and doc["culprit"]["transplant_step"] is not None


def test_experiments_the_users_code_refuses_fail_alone_and_the_replay_still_answers(runs, cli):
    """The step checks its batch against a checksum: every experiment that changes the batch
    raises in the user's code. Each is named as not run, with the error; the others run."""
    run_dir, exp = runs["strict"]
    doc = replay_json(cli, run_dir, exp.symptom)
    assert doc["root_step"] == exp.step and doc["origin"]["kind"] == "data"
    assert [s["sample_id"] for s in doc["samples"]] == exp.sample_ids
    failed = {f["experiment"]: f for f in doc["failed_experiments"]}
    assert set(failed) == {"rows alone", "without the blamed rows", "minimal culprit"}
    assert all(f["error"] == "ValueError: the batch does not match its checksum" for f in failed.values())
    assert all(f["source"].startswith("seams_models.py:") for f in failed.values())
    older = next(c for c in doc["counterfactuals"] if "older model state" in c["question"])
    assert older["fault"] is True  # the same batch from an older state: it ran
    assert "Not run (the step raised ValueError on them)" in doc["verdict"]
    out = cli("replay", "--run", run_dir, "--step", exp.symptom).out
    assert "not run    without the blamed rows: the step raised ValueError" in out


def test_the_transplant_fails_alone_and_the_earlier_cause_runs_on_whole_batches(runs):
    """The two searches that change other steps' batches, run directly on the strict loop: the
    transplant (the culprit rows put into another step's batch) fails as an experiment; the
    earlier cause's windows leave whole steps out (their batches unchanged), so they run."""
    run_dir, exp = runs["strict"]
    run = open_run(run_dir)
    inv = Investigation(run, exp.step, device=None, from_step=None, log=None)
    root = RootStep(inv, inv.root_at(exp.step))
    try:
        root.report = ckptlab.replay(run, exp.step, counterfactuals=False)
        root.base = root.step()
        culprit = ckptlab.replayer.Culprit([2], exp.sample_ids, True)
        _transplant(root, culprit, Budget(4))
        assert culprit.transplant_step is None
        found = earlier_cause(root, Budget(32))
    finally:
        root.close()
        run.release()
    assert [f["experiment"] for f in root.failed] == ["transplant"]
    assert found is not None and found.windows[0]["result"] == "primed"  # the data alone: it ran


def test_a_step_that_raised_after_a_value_went_nonfinite_is_traced_to_the_op(runs, cli):
    """A corrupt condition feature makes `exp(0.5 * logvar)` overflow in `reparameterize`; the
    decoder turns the Inf into NaN and binary cross-entropy raises on it. The origin is the exp,
    not the line that raised; the exception comes with it."""
    run_dir, exp = runs["vae"]
    events = open_run(run_dir).events()
    assert [(e["step"], e["kind"]) for e in events] == [(exp.step, "exception")]
    doc = replay_json(cli, run_dir, exp.symptom)
    o = doc["origin"]
    assert doc["root_step"] == exp.step and o["op"] == "aten.exp.default" and o["produced"] == "Inf"
    assert o["module"] == "" and o["call"] == "exp" and o["kind"] == "data"  # an absurd input made it overflow
    exp_line = next(i for i, line in enumerate(open(sm.__file__), 1) if "torch.exp(0.5 * logvar)" in line)
    assert o["source"] == f"seams_models.py:{exp_line}"
    assert o["raised"]["error"] == "RuntimeError: all elements of input should be between 0 and 1"
    assert [s["sample_id"] for s in doc["samples"]] == exp.sample_ids
    assert "The step then raised RuntimeError" in doc["verdict"] and "aten.exp.default" in doc["verdict"]


def test_the_root_is_the_update_explosion_not_the_exception_after_it(runs, cli):
    """Adam's learning rate x1e13 at step 14 explodes the update; step 15 refuses its Inf loss
    and raises. Root 14, an optimizer fault, naming the parameter the update moved most."""
    run_dir, exp = runs["vae_lr"]
    doc = replay_json(cli, run_dir, exp.symptom)
    assert exp.symptom == exp.step + 1 and doc["steps"][-1]["error"] == "FloatingPointError: loss is inf"
    assert doc["root_step"] == exp.step and doc["origin"]["kind"] == "optimizer"
    assert "learning rate" in doc["origin"]["detail"] and doc["samples"] == []
    moved = max(doc["parameters"], key=lambda p: p["update_ratio"] or 0)
    assert doc["origin"]["parameter"] == moved["name"]
    assert f"Step {exp.symptom} then raised FloatingPointError: loss is inf" in doc["verdict"]


def test_a_spike_that_recovered_is_no_root_of_a_later_unrelated_exception(tmp_path, cli):
    """A clipped loss spike two steps before a step that raises on an out-of-range token: the
    crash is its own root, blamed on its row, and no verdict says anything went non-finite
    (another row's NaN feature, which the step never read before it raised, is no cause)."""
    exp = sm.record_spike_then_crash(tmp_path / "run")
    kinds = {(e["step"], e["kind"]) for e in open_run(tmp_path / "run").events()}
    assert (exp.step, "exception") in kinds and any(s == 18 and "spike" in k for s, k in kinds)
    doc = replay_json(cli, tmp_path / "run", exp.symptom)
    assert doc["root_step"] == exp.step and doc["origin"]["kind"] == "exception"
    assert doc["origin"]["op"] == "IndexError" and doc["origin"]["module"] == "emb"
    assert (
        doc["samples"][0]["sample_id"] == exp.sample_ids[0] and "raises IndexError alone" in doc["samples"][0]["reason"]
    )
    assert "go non-finite" not in doc["verdict"] and "alone makes the step non-finite" not in doc["verdict"]


def test_a_buffer_left_nonfinite_is_lasting_damage_the_verdict_names(runs, cli):
    run_dir, exp = runs["bn"]
    doc = replay_json(cli, run_dir, exp.symptom)
    assert doc["root_step"] == exp.step and [s["sample_id"] for s in doc["samples"]] == exp.sample_ids
    assert {b["buffer"] for b in doc["nonfinite_buffers"]} == {"bn.running_mean", "bn.running_var"}
    assert "`bn.running_mean`, `bn.running_var` non-finite: lasting damage" in doc["verdict"]
    # BatchNorm refuses a one-row batch: said, not silently skipped
    assert "Expected more than 1 value per channel" in doc["failed_experiments"][0]["error"]


# --- torch's own checks raising through ckptlab's wrappers --------------------------------------


def test_clipping_with_error_if_nonfinite_is_the_users_step_raising(tmp_path, cli, caplog):
    with caplog.at_level(logging.WARNING, logger="ckptlab"):
        exp = sm.record_clip_error_if_nonfinite(tmp_path / "run")
    assert exp.symptom == exp.step
    (event,) = open_run(tmp_path / "run").events()
    assert event["step"] == exp.step and event["kind"] == "exception" and "total norm of order 2.0" in event["error"]
    assert any(f"step {exp.step}" in r.getMessage() for r in caplog.records)  # the alert is this step's
    doc = replay_json(cli, tmp_path / "run", exp.step)
    assert doc["root_step"] == exp.step and doc["origin"]["kind"] == "data"
    assert doc["origin"]["raised"]["error"].startswith("RuntimeError: The total norm of order 2.0")
    assert [s["sample_id"] for s in doc["samples"]] == exp.sample_ids


def test_an_error_through_a_wrapper_is_the_steps_own():
    def users(x):
        raise ValueError("the user's")

    with pytest.raises(ValueError) as raised:
        call_through(users, 1)
    assert is_step_error(raised.value)
