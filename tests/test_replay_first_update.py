"""Every replayed step measured (issue #26 item 2) and Adam's first update (item 3): the root
step is the step whose update exploded, though the record measured no update there
(`health_every` 10) and the loss exploded a step or three later (tests/first_update_models.py)."""

import numpy as np
import pytest
import torch

from ckptlab.analysis.anomalies import detectors, step_anomalies
from ckptlab.replayer.optstate import empty_second_moments, first_updates
from ckptlab.run.reader import Run
from ckptlab.training.health import StepHealth
from tests import first_update_models as fu


@pytest.fixture(scope="module")
def adam(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("adam") / "run"
    return run_dir, fu.record_adam_first_update(run_dir)


@pytest.fixture(scope="module")
def glitch(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("glitch") / "run"
    return run_dir, fu.record_hidden_update_explosion(run_dir)


def _unmeasured_in_the_record(run_dir, step: int) -> bool:
    m = Run(run_dir).metrics()
    return bool(np.isnan(m.update_ratio[m.index(step)]).all())


def _step(doc, step: int) -> dict:
    return next(c for c in doc["steps"] if c["step"] == step)


def test_adams_first_update_with_an_empty_second_moment_is_the_root(adam, cli):
    """The loss explodes at step 38; step 37's update of the block switched on there (its
    exp_avg_sq all zero) moved its tiny output projection by ~60x its norm. Replay names step
    37, the optimizer, the parameter and its empty second moment, not step 38 (whose update
    moved the weight by ~1x its norm)."""
    run_dir, exp = adam
    assert (exp.step, exp.symptom) == (37, 38) and _unmeasured_in_the_record(run_dir, 37)
    out = cli("replay", "--run", run_dir, "--step", exp.symptom, "--json")
    assert out.code == 0, out.err
    doc = out.json()
    assert doc["root_step"] == 37 and doc["reproduced"] and doc["samples"] == []
    o = doc["origin"]
    assert (o["kind"], o["parameter"], o["state"]) == ("optimizer", "block.out.weight", "exp_avg_sq")
    assert o["detail"].startswith("first update with an empty second moment: `block.out.weight`'s exp_avg_sq")
    assert "first update with an empty second moment" in doc["verdict"] and doc["verdict"].startswith("Step 37")
    first = doc["first_updates"][0]
    assert (first["step"], first["parameter"], first["state"]) == (37, "block.out.weight", "exp_avg_sq all zero")
    assert 30 < first["update_ratio"] < 100  # ~60x its norm, measured exactly
    assert "first_update" in _step(doc, 37)["anomalies"]
    # Proven: with the block's empty second moments in tune with their gradients, no fault.
    proof = next(c for c in doc["counterfactuals"] if "second moment" in c["question"])
    assert proof["fault"] is False and "the fault vanishes" in doc["verdict"]
    # Measuring every step only reads: every replayed step matches the record bit for bit.
    assert doc["bit_exact"] and all(c["match"] for c in doc["steps"])


def test_an_update_explosion_between_measured_steps_is_named_at_its_own_step(glitch, cli):
    """Step 35's update (an embedding row, at a learning rate 1e5x) exploded; the record
    measured no update there, and the loss explodes only at step 38, the first step to read
    that row. Replay measures every step exactly and names step 35."""
    run_dir, exp = glitch
    assert (exp.step, exp.symptom) == (35, 38) and _unmeasured_in_the_record(run_dir, 35)
    out = cli("replay", "--run", run_dir, "--step", exp.symptom, "--json")
    assert out.code == 0, out.err
    doc = out.json()
    assert doc["root_step"] == 35 and doc["origin"]["kind"] == "optimizer"
    assert "update_explosion" in _step(doc, 35)["anomalies"]
    assert [c["anomalies"] for c in doc["steps"] if 35 < c["step"] < 38] == [[], []]
    assert doc["first_updates"] == [] and doc["bit_exact"]


def test_an_empty_second_moment_is_an_all_zero_exp_avg_sq_or_no_state_after_others_stepped():
    a, b, c = (torch.nn.Parameter(torch.ones(3)) for _ in range(3))
    opt = torch.optim.Adam([a, b, c], lr=0.1)
    assert empty_second_moments(opt, [a, b, c]) == {}  # before the first update of all: training begins
    a.grad, b.grad = torch.ones(3), torch.zeros(3)  # c: no gradient yet
    opt.step()
    assert empty_second_moments(opt, [a, b, c]) == {1: "exp_avg_sq all zero", 2: "no optimizer state"}
    sgd = torch.optim.SGD([a], lr=0.1, momentum=0.9)
    sgd.step()
    assert empty_second_moments(sgd, [a]) == {}  # no second moment to be empty


def test_a_first_update_counts_when_a_gradient_reached_it_and_it_moved_more_than_half_its_norm():
    h = StepHealth(
        loss=1.0,
        grad_norm=1.0,
        param_grad_norm=np.array([0.5, 0.0, 0.5, -1.0, 0.5], dtype=np.float32),  # -1: no gradient (NO_GRAD)
        nonfinite_grads=0,
        param_nonfinite=None,
        lr=[0.1],
        stepped=True,
        update_ratio=np.array([60.0, 60.0, 0.1, 0.0, 60.0], dtype=np.float32),
        second_moment_empty=np.array([1, 1, 2, 2, 0], dtype=np.float32),  # the last: not empty
    )
    found = first_updates(7, h, list("abcde"))
    assert [(f.step, f.parameter, f.state, f.update_ratio) for f in found] == [(7, "a", "exp_avg_sq all zero", 60.0)]
    assert [e for e in step_anomalies(h, detectors()) if e["kind"] == "first_update"] == [
        {"kind": "first_update", "value": 60.0, "parameters": [0]}
    ]


def test_the_recorder_raises_a_first_update_live_on_a_step_that_measures_its_update(tmp_path, caplog):
    """Measured steps (health_every 1 here) carry the probe's flags, read with the rest of the
    health: the Recorder records a `first_update` event at step 37 and warns of it."""
    run_dir = tmp_path / "run"
    with caplog.at_level("WARNING", logger="ckptlab"):
        fu.record_adam_first_update(run_dir, health_every=1)
    events = [e for e in Run(run_dir).events() if e["kind"] == "first_update"]
    # block.out.weight (~60x its norm) and block.out.bias (zero-initialized: moved from zero)
    assert [(e["step"], e["parameters"]) for e in events] == [(37, [6, 7])]
    assert 30 < events[0]["value"] < 100
    assert "step 37: first update; explain it with ckptlab replay" in caplog.text
