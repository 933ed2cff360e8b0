"""A loop without an optimizer object (the weights updated by hand, `p.data.add_(p.grad,
alpha=-lr)`) is recorded and replayed: its learning rate (a `ckptlab.HandUpdate`, annealed by
the loop), update ratios and gradient norms recorded, a planted data fault and a learning-rate
spike named as they are for torch.optim.SGD; and an optimizer that is not the one that trains
is caught while recording (tests/hand_models.py: the classic word-language-model loop)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import ckptlab
from tests import hand_models as hm
from tests.carried_models import B

BAD_STEP, BAD_COL, ANNEAL_AT = 13, 2, 8


def ids(s: int) -> list[int]:
    return [100 * s + b for b in range(B)]


def _record_nan(run_dir) -> list[float]:
    """The hand-written loop, annealing its learning rate at ANNEAL_AT (between steps, as the
    word-language-model example does), with a NaN sample weight in column BAD_COL at BAD_STEP."""
    model, losses = hm.build(), []
    options = {"ckpt_every": 5, "health_every": 2, "update_ratio": "exact"}  # (sampled: an estimate)
    with ckptlab.Recorder(run_dir, model, None, lr=hm.LR, step_fn=hm.step, build_fn=hm.build, **options) as rec:
        assert isinstance(rec.optimizer, ckptlab.HandUpdate) and rec.optimizer.lr == hm.LR
        with pytest.raises(ckptlab.NonFiniteLoss):
            for s in range(20):
                if s == ANNEAL_AT:
                    rec.optimizer.lr /= 4
                losses.append(rec.step(hm.chunk(s, BAD_STEP, BAD_COL), sample_ids=ids(s)).item())
    return losses


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("hand") / "run"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "ckptlab: .*did not step")  # a hand update is never idle
        losses = _record_nan(run_dir)
    return run_dir, losses


def _record_spike(run_dir, *, hand: bool) -> list[float]:
    """The learning rate times hm.SPIKE at step hm.SPIKE_STEP: set by the loop on the
    HandUpdate, or by a LambdaLR on torch.optim.SGD (the same update, bit for bit)."""
    if hand:
        model, opt, sched, step, build = hm.build(), None, None, hm.step, hm.build
        options = {"lr": hm.LR}
    else:
        (model, opt, sched), step, build = hm.build_sgd(), hm.step_sgd, hm.build_sgd
        options = {"scheduler": sched}
    losses = []
    with ckptlab.Recorder(
        run_dir, model, opt, step_fn=step, build_fn=build, ckpt_every=5, on_nonfinite="record", **options
    ) as rec:
        for s in range(22):
            if hand:
                rec.optimizer.lr = hm.LR * (hm.SPIKE if s == hm.SPIKE_STEP else 1.0)
            losses.append(rec.step(hm.chunk(s), sample_ids=ids(s)).item())
    return losses


@pytest.fixture(scope="module")
def spike_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spike")
    return {hand: (root / str(hand), _record_spike(root / str(hand), hand=hand)) for hand in (False, True)}


# --- recording ----------------------------------------------------------------------------------


def test_the_learning_rate_and_update_ratios_of_a_hand_update_are_recorded(nan_run):
    run_dir, losses = nan_run
    run = ckptlab.open_run(run_dir)
    m = run.metrics()
    # (checkpoints copy the weights: a live one knows in-place changes by version counters,
    # which `p.data.add_` does not move)
    assert run.manifest["config"]["ckpt_snapshot"] == "copy"
    assert list(m.lr[:BAD_STEP, 0]) == [hm.LR] * ANNEAL_AT + [hm.LR / 4] * (BAD_STEP - ANNEAL_AT)
    assert m.stepped[:BAD_STEP].all()
    measured = [i for i in range(BAD_STEP) if i % 2 == 0]
    assert np.isfinite(m.update_ratio[measured]).all() and (m.update_ratio[measured] > 0).all()
    # Right, too: the update of step 0, measured here by hand.
    model = hm.build()
    before = [p.detach().clone() for p in model.parameters()]
    hm.step(model, ckptlab.HandUpdate(model.parameters(), lr=hm.LR), hm.chunk(0))
    expected = [float((p.detach() - b).norm() / b.norm()) for p, b in zip(model.parameters(), before)]
    np.testing.assert_allclose(m.update_ratio[0], expected, rtol=1e-5)


def test_gradients_dropped_by_hand_are_measured(run_dir):
    """No clipping and `p.grad = None` in the loop: the norms come from the end of backward."""
    model = hm.build()
    with ckptlab.Recorder(run_dir, model, None, lr=0.1, step_fn=hm.step_grads_dropped, build_fn=hm.build) as rec:
        for s in range(4):
            rec.step(hm.chunk(s), sample_ids=ids(s))
    m = ckptlab.open_run(run_dir).metrics()
    twin = hm.build()
    hm._loss(twin, hm.chunk(0)).backward()
    expected = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in twin.parameters()])))
    assert m.grad_norm[0] == pytest.approx(expected, rel=1e-5)
    assert np.isfinite(m.grad_norm).all() and np.isfinite(m.update_ratio[0]).all() and m.stepped.all()


def test_an_unknown_learning_rate_is_recorded_as_unknown_and_replays(run_dir):
    """No lr= given: the HandUpdate does not know it (NaN in the record, an error to read it),
    the update is still measured, and the run replays bit for bit. build_fn may return
    `(model, None)`."""
    model = hm.build()
    with ckptlab.Recorder(run_dir, model, None, step_fn=hm.step_own_lr, build_fn=hm.build_pair, ckpt_every=3) as rec:
        with pytest.raises(ckptlab.RecordError, match="learning rate of this HandUpdate is unknown"):
            _ = rec.optimizer.lr
        losses = [rec.step(hm.chunk(s), sample_ids=ids(s)).item() for s in range(6)]
    m = ckptlab.open_run(run_dir).metrics()
    assert np.isnan(m.lr[:, 0]).all() and m.stepped.all() and np.isfinite(m.update_ratio[0]).all()
    report = ckptlab.replay(run_dir, 5, from_step=3)
    assert [c.loss for c in report.steps] == losses[3:6] and report.deterministic


# --- replay ---------------------------------------------------------------------------------------


def test_a_hand_update_replays_bit_for_bit_with_the_learning_rate_the_loop_set(nan_run):
    """Replayed across the loop's annealing (a step that began with another learning rate than
    its checkpoint holds): every loss equals the record."""
    run_dir, losses = nan_run
    report = ckptlab.replay(run_dir, 12, from_step=5, trace=False, counterfactuals=False)
    assert [c.step for c in report.steps] == list(range(5, 13))
    assert [c.loss for c in report.steps] == losses[5:13] and report.deterministic


def test_a_data_fault_in_a_hand_update_loop_names_its_step_and_sample(nan_run, cli):
    run_dir, _ = nan_run
    r = cli("replay", "--run", run_dir, "--step", BAD_STEP, "--json", "--no-counterfactuals")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["deterministic"] and doc["root_step"] == BAD_STEP and doc["origin"]["kind"] == "data"
    assert [s["sample_id"] for s in doc["samples"]][:1] == [100 * BAD_STEP + BAD_COL]


def test_a_learning_rate_spike_is_the_optimizer_with_a_hand_update_as_with_sgd(spike_runs):
    """The same spike, set by the loop on a HandUpdate or by a scheduler on SGD: the same
    losses, and replay names the same root step and kind (#25 item 9)."""
    (sgd_dir, sgd_losses), (hand_dir, hand_losses) = spike_runs[False], spike_runs[True]
    assert hand_losses == sgd_losses  # one update, two ways of writing it
    symptom = next(s for s, loss in enumerate(hand_losses) if s > hm.SPIKE_STEP and loss > 2 * hand_losses[0])
    found = {}
    for name, run_dir in (("sgd", sgd_dir), ("hand", hand_dir)):
        report = ckptlab.replay(run_dir, symptom)
        found[name] = (report.root_step, report.origin.kind, report.samples, report.deterministic)
        lr_check = report.counterfactuals[0]
        assert "learning rate" in lr_check.question and lr_check.fault is False, (name, lr_check)
    assert found["hand"] == found["sgd"] == (hm.SPIKE_STEP, "optimizer", [], True)


# --- an optimizer that does not train, and failed starts -------------------------------------------


def test_an_optimizer_that_never_steps_is_caught_while_recording(run_dir, cli):
    """The Recorder is given an SGD the step never uses (it trains with its own): a warning
    and an `idle_optimizer` event after the first 3 steps; a replay that leaves the record says
    why."""
    model, opt = hm.build_with_sgd()
    with pytest.warns(UserWarning, match="did not step in the first 3 steps, yet the weights changed") as caught:
        with ckptlab.Recorder(
            run_dir, model, opt, step_fn=hm.step_own_optimizer, build_fn=hm.build_with_sgd, ckpt_every=5
        ) as rec:
            for s in range(8):
                rec.step(hm.chunk(s), sample_ids=ids(s))
    assert len([w for w in caught if "did not step" in str(w.message)]) == 1  # once, not every step
    assert [(e["step"], e["kind"]) for e in ckptlab.open_run(run_dir).events()] == [(2, "idle_optimizer")]
    r = cli("replay", "--run", run_dir, "--step", 7, "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["reproduced"] is False and doc["deterministic"] is False
    assert "the replay left the record at step 6" in doc["verdict"]
    assert "the Recorder warned at step 2: the optimizer given to the Recorder did not step" in doc["verdict"]
    info = cli("info", "--run", run_dir, "--json").json()  # a warning, not an anomaly of a step
    assert info["anomalies"] == [] and [w["kind"] for w in info["warnings"]] == ["idle_optimizer"]
    assert (
        "warned" in cli("info", "--run", run_dir).out
        and "none seen while recording" in cli("info", "--run", run_dir).out
    )


def test_an_optimizer_that_never_steps_is_caught_in_a_trainer_that_owns_its_loop(run_dir):
    """Recorded from a trainer's callbacks (begin_step / end_step), with the optimizer built
    before the trainer made its own: the same warning and event."""
    model, early = hm.build_with_sgd()
    with pytest.warns(UserWarning, match="it is not the one that trains them"):
        with ckptlab.Recorder(run_dir, model, early, step_fn=hm.step_sgd, build_fn=hm.build_with_sgd) as rec:
            trainer = hm.OwnLoopTrainer(
                model, lambda s, batch: rec.begin_step(batch, sample_ids=ids(s)), lambda s, loss: rec.end_step(loss)
            )
            trainer.run(4)
    assert [e["kind"] for e in ckptlab.open_run(run_dir).events()] == ["idle_optimizer"]


def test_an_optimizer_that_steps_raises_no_warning(spike_runs):
    for run_dir, _ in spike_runs.values():
        assert "idle_optimizer" not in [e["kind"] for e in ckptlab.open_run(run_dir).events()]


@pytest.mark.parametrize(
    "optimizer, options, message",
    [
        (None, {"lr": "fast"}, "lr must be a number"),
        ("sgd", {"lr": 0.1}, "lr= is for a loop that updates the weights by hand"),
        ("not an optimizer", {}, "optimizer is str, not a torch.optim.Optimizer"),
    ],
)
def test_a_failed_start_leaves_the_directory_as_it_was(tmp_path, optimizer, options, message):
    run_dir = tmp_path / "run"
    model = hm.build()
    if optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ckptlab.RecordError, match=message):
        ckptlab.Recorder(run_dir, model, optimizer, step_fn=hm.step, build_fn=hm.build, **options)
    assert not run_dir.exists()
    with ckptlab.Recorder(run_dir, model, None, lr=hm.LR, step_fn=hm.step, build_fn=hm.build) as rec:
        rec.step(hm.chunk(0), sample_ids=ids(0))  # the next attempt starts cleanly
    assert ckptlab.open_run(run_dir).steps == [0]


def test_a_hand_update_without_parameters_is_a_clear_error(run_dir):
    with pytest.raises(ckptlab.RecordError, match="the model has no parameters"):
        ckptlab.Recorder(run_dir, torch.nn.ReLU(), None, lr=0.1, step_fn=hm.step, build_fn=hm.build)
    assert not run_dir.exists()


def test_a_hand_update_driven_by_a_scheduler_replays_bit_for_bit(run_dir):
    """build_fn makes the HandUpdate and a LambdaLR on it: the scheduler's learning rates are
    recorded, and the run replays across them."""
    model, update, scheduler = hm.build_scheduled()
    with ckptlab.Recorder(
        run_dir, model, update, scheduler=scheduler, step_fn=hm.step, build_fn=hm.build_scheduled, ckpt_every=4
    ) as rec:
        losses = [rec.step(hm.chunk(s), sample_ids=ids(s)).item() for s in range(9)]
    assert list(ckptlab.open_run(run_dir).metrics().lr[:, 0]) == [hm.LR * 0.5 ** (s // 3) for s in range(9)]
    report = ckptlab.replay(run_dir, 8, from_step=4, trace=False, counterfactuals=False)
    assert [c.loss for c in report.steps] == losses[4:9] and report.deterministic
