"""A trainer that owns its loop (tests/owned_loop_models.py, minGPT's Trainer: optimizer and
DataLoader made inside run(), one callback after each step) is recorded from the model's forward
and its callback, on the optimizer run() built; `ckptlab replay` re-runs it bit for bit and names
the planted NaN sample's step, row and id."""

from types import SimpleNamespace

import pytest
import torch

import ckptlab
from ckptlab.errors import RecordError
from ckptlab.integrations import owned_loop
from tests import owned_loop_models as om

# Where the seeded sampler first puts the NaN sample: step 7, row 3.
FAULT_STEP, FAULT_ROW = 7, 3


def evaluate(trainer):
    """A callback that runs the model outside training (as minGPT's demos generate text): no step."""
    if trainer.iter_num % 3 == 0:
        trainer.model.eval()
        with torch.no_grad():
            trainer.model(torch.zeros(2, om.SEQ, om.EMBD))
        trainer.model.train()


def record_trainer(run_dir, config, *callbacks, fault: bool = False):
    """What a user writes: the dataset tracked, the Recorder on the model's forward and the
    callback, then the trainer's own run() (with `callbacks` after the step). Returns the
    recording (its `.recorder` is made at the first step), the trainer, and the NonFiniteLoss
    that stopped it (None: it ran to its end)."""
    torch.manual_seed(0)
    model = om.TinyLM()
    data = owned_loop.track_ids(om.Sequences(fault=fault))
    trainer = om.Trainer(config, model, data)
    with owned_loop.record(
        run_dir,
        model,
        lambda: trainer.optimizer,
        step_fn=om.step,
        build_fn=om.build,
        sample_ids=data.take,
        ckpt_every=4,
    ) as rec:
        trainer.add_callback("on_batch_end", lambda t: rec.end_step(t.loss))
        for callback in callbacks:
            trainer.add_callback("on_batch_end", callback)
        try:
            trainer.run()
        except ckptlab.NonFiniteLoss as e:
            return rec, trainer, e
    return rec, trainer, None


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("owned") / "run"
    rec, trainer, stopped = record_trainer(run_dir, om.TRAIN_CONFIG, evaluate, fault=True)
    assert stopped is not None and stopped.step == FAULT_STEP
    assert rec.recorder is not None and rec.recorder.optimizer is trainer.optimizer  # the one run() built
    return run_dir


def test_records_each_step_with_its_batch_and_sample_ids(nan_run):
    run = ckptlab.open_run(nan_run)
    assert run.steps == list(range(FAULT_STEP + 1))  # the evaluations in the callback began no step
    batch, ids = run.batch(FAULT_STEP)
    assert len(batch) == 2 and batch[0].shape == (4, om.SEQ, om.EMBD)  # (x, y), as the forward got them
    assert ids[FAULT_ROW] == om.FAULT_SAMPLE and run.checkpoints[:2] == [0, 4]
    m = run.metrics()
    assert m.lr[:, 0].tolist() == pytest.approx([3e-3] * (FAULT_STEP + 1))  # the trainer's own optimizer
    assert (m.grad_norm[:FAULT_STEP] > 0).all()


def test_replay_from_the_cli_names_the_step_and_the_sample(nan_run, cli):
    done = cli("replay", "--run", nan_run, "--step", FAULT_STEP, "--json")
    assert done.code == 0, done.err
    doc = done.json()
    assert doc["root_step"] == FAULT_STEP and doc["reproduced"] and doc["deterministic"]
    assert doc["origin"]["kind"] == "data"
    assert [(s["row"], s["sample_id"]) for s in doc["samples"]] == [(FAULT_ROW, om.FAULT_SAMPLE)]
    assert doc["counterfactuals"][0]["fault"] is False


def test_every_step_replays_bit_for_bit(nan_run):
    report = ckptlab.replay(nan_run, FAULT_STEP, from_step=0, trace=False, counterfactuals=False)
    assert [c.step for c in report.steps] == list(range(FAULT_STEP + 1)) and all(c.match for c in report.steps)


def test_samples_read_in_worker_processes_are_named_as_the_problem(tmp_path):
    config = SimpleNamespace(**{**vars(om.TRAIN_CONFIG), "num_workers": 1, "max_iters": 1})
    model = om.TinyLM()
    data = owned_loop.track_ids(om.Sequences())
    trainer = om.Trainer(config, model, data)
    with pytest.raises(RecordError, match="num_workers=0"):
        with owned_loop.record(
            tmp_path / "run", model, lambda: trainer.optimizer, step_fn=om.step, build_fn=om.build, sample_ids=data.take
        ) as rec:
            trainer.add_callback("on_batch_end", lambda t: rec.end_step(t.loss))
            trainer.run()
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_end_step_without_a_training_forward_says_so(tmp_path):
    with owned_loop.record(tmp_path / "run", om.TinyLM(), None, step_fn=om.step, build_fn=om.build) as rec:
        with pytest.raises(RecordError, match="no training forward"):
            rec.end_step(torch.tensor(1.0))


def test_a_learning_rate_spike_set_from_a_callback_is_named(tmp_path, cli):
    # The trainer's callback sets the rate outside the step (as loops that compute their own
    # schedule do): x1e4 for step 20 only. Replay follows the recorded rate and names step 20,
    # kind optimizer, no sample (after 20 steps: the spike rule's history).
    def spike(t):
        for g in t.optimizer.param_groups:
            g["lr"] = om.TRAIN_CONFIG.learning_rate * (1e4 if t.iter_num == 19 else 1.0)

    run_dir = tmp_path / "run"
    config = SimpleNamespace(**{**vars(om.TRAIN_CONFIG), "max_iters": 26})
    record_trainer(run_dir, config, spike)  # (it may stop at the first non-finite loss)
    m = ckptlab.open_run(run_dir).metrics()
    assert m.lr[20, 0] == pytest.approx(30.0) and m.lr[19, 0] == pytest.approx(3e-3)
    symptom = next(e["step"] for e in ckptlab.open_run(run_dir).events() if e["step"] > 20)
    doc = cli("replay", "--run", run_dir, "--step", symptom, "--json").json()
    assert doc["reproduced"] and doc["deterministic"]
    assert (doc["root_step"], doc["origin"]["kind"], doc["samples"]) == (20, "optimizer", [])
