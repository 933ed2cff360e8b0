"""An accelerate loop in the shape of transformers' run_clm_no_trainer.py (tests/accelerate_models.py:
gradient accumulation, accelerate's wrapped optimizer and scheduler, clipping, a shuffled
DataLoader) is recorded one optimizer step a step; `ckptlab replay` re-runs it bit for bit,
across an epoch's shorter last step too, and names the planted NaN sample by its micro-batch,
row and id, and a learning-rate spike by its step. The wrappers users hold (accelerate's, Lightning's) are accepted where a torch
optimizer or scheduler is."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

import ckptlab  # noqa: E402
from ckptlab.errors import RecordError  # noqa: E402
from ckptlab.integrations import accelerate as cka  # noqa: E402
from ckptlab.training.wrappers import torch_optimizer, torch_scheduler  # noqa: E402
from tests import accelerate_models as am  # noqa: E402

# Where the seeded shuffle puts the NaN sample: step 3 (ids 29, 22, 1, 33 | 16, 14, 6, 13).
FAULT_STEP, FAULT_MICRO, FAULT_ROW = 3, 1, 1


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("acc-nan") / "run"
    with pytest.raises(ckptlab.NonFiniteLoss) as e:
        am.main(run_dir, fault=True, ckpt_every=3)
    assert e.value.step == FAULT_STEP
    return run_dir


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("acc-clean") / "run"
    assert am.main(run_dir, ckpt_every=3, keep_last=10) == 10  # 2 epochs of 5 optimizer steps
    return run_dir


def test_records_one_step_per_optimizer_step_with_its_micro_batches(clean_run, nan_run):
    run = ckptlab.open_run(clean_run)
    assert run.steps == list(range(10))
    # 9 batches an epoch: accelerate syncs at the dataloader's end, so each epoch's last step has one
    assert [run.batch(s)[0]["micro_rows"] for s in (3, 4, 5)] == [[4, 4], [4], [4, 4]]
    batch, ids = ckptlab.open_run(nan_run).batch(FAULT_STEP)
    assert ids[FAULT_MICRO * am.BATCH + FAULT_ROW] == am.FAULT_SAMPLE
    assert batch["accelerate"] == {"gradient_accumulation_steps": am.ACCUM}
    assert [set(p["batch"]) for p in batch["micro_batches"]] == [{"inputs_embeds", "labels"}] * 2  # the id key popped
    assert [v["step"] for v in run.validation()] == [5, 10]  # after each epoch
    lr = run.metrics().lr[:, 0]
    assert lr[0] == 0 and lr[am.WARMUP] == pytest.approx(3e-3) and lr[-1] < lr[am.WARMUP]  # stepped once a step
    assert (run.metrics().grad_norm > 0).all() and 3 in run.checkpoints


def test_replay_from_the_cli_names_the_step_the_micro_batch_and_the_sample(nan_run, cli):
    done = cli("replay", "--run", nan_run, "--step", FAULT_STEP, "--json")
    assert done.code == 0, done.err
    doc = done.json()
    assert doc["root_step"] == FAULT_STEP and doc["reproduced"] and doc["deterministic"]
    assert doc["origin"]["kind"] == "data"
    assert [(s["micro_batch"], s["row"], s["sample_id"]) for s in doc["samples"]] == [
        (FAULT_MICRO, FAULT_ROW, am.FAULT_SAMPLE)
    ]
    assert f"micro-batch {FAULT_MICRO} row {FAULT_ROW} (sample {am.FAULT_SAMPLE})" in doc["verdict"]
    assert doc["counterfactuals"][0]["fault"] is False  # without that row, the step is healthy


def test_every_step_replays_bit_for_bit_across_an_epoch_end(clean_run):
    report = ckptlab.replay(clean_run, 9, from_step=0, trace=False, counterfactuals=False)
    assert [c.step for c in report.steps] == list(range(10)) and all(c.match for c in report.steps)


def test_a_learning_rate_spike_is_named_at_its_step_with_no_sample(tmp_path, cli):
    """A schedule bug multiplies one optimizer step's learning rate (accelerate's wrapped
    scheduler steps it in the body): the loss spikes a step later, replay names the step that
    used it, the optimizer, and no sample."""
    am.main(tmp_path / "run", lr_spike=True, epochs=4, ckpt_every=5)  # 20 steps: a baseline for the spike rule
    done = cli("replay", "--run", tmp_path / "run", "--step", am.LR_SPIKE_STEP + 1, "--json")
    assert done.code == 0, done.err
    doc = done.json()
    assert doc["root_step"] == am.LR_SPIKE_STEP and doc["reproduced"] and doc["deterministic"]
    assert doc["origin"]["kind"] == "optimizer" and doc["samples"] == []
    lr_check = doc["counterfactuals"][0]
    assert "learning rate" in lr_check["question"] and lr_check["fault"] is False


@pytest.mark.parametrize(("body", "says"), [("no_accumulate", "accelerator.accumulate"), ("no_loss", "not the loss")])
def test_a_body_that_does_not_fit_is_refused(tmp_path, body, says):
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model, optimizer = _linear()
    model, optimizer = accelerator.prepare(model, optimizer)
    body_fn = {"no_accumulate": _no_accumulate, "no_loss": _no_loss}[body]
    rec = cka.record(tmp_path / "run", accelerator, model, optimizer, body=body_fn, build_fn=_build_linear)
    with rec, pytest.raises(RecordError, match=says):
        rec.micro_batch(torch.ones(3, 4))


def test_without_accumulation_each_batch_is_a_step_and_replays(tmp_path):
    accelerator = Accelerator(cpu=True)  # gradient_accumulation_steps=1
    model, optimizer = _linear()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    with cka.record(
        tmp_path / "run", accelerator, model, optimizer, scheduler, body=_accumulated, build_fn=_build_linear_loop
    ) as rec:
        for i in range(3):
            rec.micro_batch(torch.full((3, 4), float(i)), sample_ids=[3 * i, 3 * i + 1, 3 * i + 2])
    run = ckptlab.open_run(tmp_path / "run")
    batch, ids = run.batch(2)
    assert set(batch) == {"batch", "accelerate"} and ids == [6, 7, 8]  # one batch, no micro-batches
    assert run.metrics().lr[:, 0].tolist() == pytest.approx([0.1, 0.05, 0.025])  # the body stepped the scheduler
    report = ckptlab.replay(tmp_path / "run", 2, from_step=0, trace=False, counterfactuals=False)
    assert len(report.steps) == 3 and all(c.match for c in report.steps)


# --- the wrappers users hold ------------------------------------------------------------------


def test_the_plain_recorder_takes_accelerates_wrapped_optimizer_and_scheduler(tmp_path):
    """What `accelerator.prepare` returns goes straight into a Recorder: its probe and its
    checkpoints use the torch objects inside, step_fn gets the wrapper."""
    model, optimizer, scheduler = _build_linear()
    assert type(optimizer).__name__ == "AcceleratedOptimizer" and type(scheduler).__name__ == "AcceleratedScheduler"
    with ckptlab.Recorder(
        tmp_path / "run", model, optimizer, step_fn=_plain_step, build_fn=_build_linear, scheduler=scheduler
    ) as rec:
        for _ in range(3):
            rec.step(torch.randn(3, 4))
    run = ckptlab.open_run(tmp_path / "run")
    assert run.steps == [0, 1, 2] and run.metrics().lr[:, 0].tolist() == pytest.approx([0.1, 0.05, 0.025])
    report = ckptlab.replay(tmp_path / "run", 2, from_step=0, trace=False, counterfactuals=False)
    assert all(c.match for c in report.steps) and len(report.steps) == 3


def test_wrappers_unwrap_by_their_documented_attributes():
    model, optimizer, scheduler = _build_linear()
    assert type(torch_optimizer(optimizer)) is torch.optim.SGD
    assert type(torch_scheduler(scheduler)) is torch.optim.lr_scheduler.StepLR
    inner = torch_optimizer(optimizer)
    assert torch_optimizer(inner) is inner and torch_scheduler(torch_scheduler(scheduler)) is torch_scheduler(scheduler)
    assert torch_optimizer(None) is None and torch_scheduler(None) is None
    lightning = pytest.importorskip("lightning.pytorch.core.optimizer")
    assert torch_optimizer(lightning.LightningOptimizer(inner)) is inner


# Module level: the Recorder describes build_fn and step_fn, and replay imports them.


def _linear():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _build_linear():
    accelerator = Accelerator(cpu=True)
    model, optimizer = _linear()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return accelerator.prepare(model, optimizer, scheduler)


def _build_linear_loop():
    accelerator = Accelerator(cpu=True)  # gradient_accumulation_steps=1
    model, optimizer = _linear()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return cka.build(accelerator, _accumulated, *accelerator.prepare(model, optimizer, scheduler))


def _accumulated(accelerator, model, optimizer, lr_scheduler, batch):
    with accelerator.accumulate(model):
        loss = model(batch).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
    return loss


def _plain_step(model, optimizer, batch):
    assert type(optimizer).__name__ == "AcceleratedOptimizer"  # what the user holds
    loss = model(batch).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _no_accumulate(accelerator, model, optimizer, lr_scheduler, batch):
    loss = model(batch).square().mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss


class _Lookahead(torch.optim.Optimizer):
    """An optimizer in its own right around a base optimizer (its own state): not unwrapped."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        super().__init__(optimizer.param_groups, {})

    def step(self, closure=None):
        return self.optimizer.step(closure)


def test_an_optimizer_in_its_own_right_around_another_is_not_unwrapped():
    _, inner = _linear()
    outer = _Lookahead(inner)
    assert torch_optimizer(outer) is outer
    scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=1)
    assert torch_scheduler(scheduler) is scheduler  # (a torch scheduler has `.optimizer`, never unwrapped)


def _no_loss(accelerator, model, optimizer, lr_scheduler, batch):
    with accelerator.accumulate(model):
        accelerator.backward(model(batch).square().mean())
        optimizer.step()
        optimizer.zero_grad()
