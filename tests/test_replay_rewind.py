"""Causes that lie before the replay window (ckptlab/replayer/rewind.py): a poisoned update a
checkpoint before the symptom is found by replaying from older checkpoints, named with its
row, sample id and what it did to the state; a search that cannot finish says so."""

import pytest

from tests import models
from tests import rewind_models as rm


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    run = tmp_path_factory.mktemp("rewind") / "run"
    losses = models.record_run(run, rm.build, rm.step, rm.batches(), ckpt_every=20, health_every=5)
    assert len(losses) == rm.FAULT_STEP + 1 and losses[-1] != losses[-1]  # NaN at step 42, the first
    return run


def test_a_poisoned_update_one_checkpoint_before_the_fault_is_named(poisoned, cli):
    # Step 42's batch faults from checkpoint 40's state (already primed) and not from 20's: the
    # search goes back to checkpoint 20 and names step 37, its poisoned row and what it did.
    out = cli("replay", "--run", poisoned, "--step", rm.FAULT_STEP, "--json")
    assert out.code == 0, out.err
    doc = out.json()
    assert doc["root_step"] == rm.FAULT_STEP and doc["reproduced"]
    w = doc["rewind"]
    assert (w["step"], w["rows"], w["sample_ids"]) == (rm.POISON_STEP, [rm.POISON_ROW], [100 * rm.POISON_STEP + 3])
    assert [x["result"] for x in w["windows"]] == ["primed", "prevented"]
    assert [x["checkpoint"] for x in w["windows"]] == [40, 20]
    assert (w["start"], w["searched"], w["how"], w["complete"]) == (20, [20, 41], "journal", True)
    e = w["effect"]  # it pushed the rare token's embedding row from 0
    assert (e["param"], e["row"], e["row_norm_before"]) == ("emb.weight", rm.RARE, 0.0) and e["row_norm_after"] > 50
    assert f"Doomed earlier: without row 3 (sample {100 * rm.POISON_STEP + 3}) of step 37" in doc["verdict"]
    assert f"most its row {rm.RARE}" in doc["verdict"]
    # The Recorder had flagged step 37's gradient as the loss's precursor: the verdict links the two.
    assert (doc["precursor"]["param"], doc["precursor"]["step"]) == ("emb.weight", rm.POISON_STEP)
    assert "The record saw it coming: emb.weight's gradient spiked" in doc["verdict"]
    assert "at step 37 (the step found above)" in doc["verdict"]


def test_a_search_back_that_runs_out_of_budget_says_what_it_did_not_test(poisoned, cli):
    def rewind(budget):
        out = cli("replay", "--run", poisoned, "--step", rm.FAULT_STEP, "--budget", budget, "--json")
        assert out.code == 0, out.err
        return out.json()["rewind"], out.json()["verdict"]

    w, verdict = rewind(1)  # not one window replayed: every step before the root is untested
    assert (w["step"], w["complete"], w["searched"], w["untested"]) == (None, False, [], [0, 41])
    assert [x["result"] for x in w["windows"]] == ["budget spent"]
    assert "steps 0..41 were not tested" in verdict
    w, verdict = rewind(8)  # both windows, but no replay left to find the step in 20..41
    assert w["step"] is None and not w["complete"] and w["searched"] == [20, 41]
    assert "leaving out steps 20..41 prevents it (the budget ran out before one step was found)" in verdict


def test_without_the_poison_nothing_faults(tmp_path):
    losses = models.record_run(tmp_path / "r", rm.build, rm.step, rm.batches(poison=False), ckpt_every=20)
    assert all(x == x and x < 10 for x in losses)  # the same batches, the corrupt count fixed: healthy
