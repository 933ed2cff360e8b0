"""The Hugging Face callback records a real Trainer's run (a tiny GPT-2 built from a config);
replay re-runs its steps bit for bit and names the planted sample and the layer."""

import json
from dataclasses import replace

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402
from transformers import GPT2LMHeadModel, Trainer  # noqa: E402

import ckptlab  # noqa: E402
from ckptlab.errors import RecordError  # noqa: E402
from ckptlab.integrations import transformers as ckt  # noqa: E402
from tests.integrations import hf_models as hm  # noqa: E402

FAULT_STEP = hm.FAULT_SAMPLE // hm.BATCH  # 9
FAULT_ROW = hm.FAULT_SAMPLE % hm.BATCH  # 1


def train(tmp_path, fault, args=hm.ARGS, **callback_kw):
    run_dir = tmp_path / "run"
    torch.manual_seed(0)  # the same initial weights every time
    trainer = Trainer(
        model=GPT2LMHeadModel(hm.config()),
        args=args,
        train_dataset=hm.Sequences(fault=fault),
        eval_dataset=hm.Sequences(8, seed=4),
    )
    ckt.record(trainer, run_dir, build_fn=hm.build, sample_id_key="idx", ckpt_every=5, **callback_kw)
    if fault is None:
        trainer.train()
    else:
        with pytest.raises(ckptlab.NonFiniteLoss) as e:
            trainer.train()
        assert e.value.step == FAULT_STEP
    return run_dir


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("hf-nan"), "nan")


def test_records_inputs_ids_health_validation_and_checkpoints(nan_run):
    run = ckptlab.open_run(nan_run)
    assert run.steps == list(range(FAULT_STEP + 1))
    batch, ids = run.batch(FAULT_STEP)
    assert ids == [36, 37, 38, 39]
    assert set(batch["inputs"]) == {"inputs_embeds", "labels"}  # the id column never reached the model
    assert batch["transformers"] == {"max_grad_norm": 1.0}
    assert int(batch["num_items_in_batch"]) == hm.BATCH * hm.SEQ  # label tokens, as the Trainer counts them
    assert [v["step"] for v in run.validation()] == [4, 8]
    assert "eval_loss" in run.validation()[0]["metrics"] and "eval_runtime" not in run.validation()[0]["metrics"]
    m = run.metrics()
    assert m.lr[1, 0] > m.lr[0, 0]  # linear warm-up, stepped by the Trainer
    assert 5 in run.checkpoints
    # where each step's time went (record/system.py): tokens from the labels' (B, T) ids
    assert (m.samples == hm.BATCH).all() and (m.tokens == hm.BATCH * hm.SEQ).all()
    assert (m.wall_time[1:] >= m.data_wait[1:]).all() and m.ckpt_time[5] > 0


def test_replay_names_the_nan_sample_bit_exactly(nan_run):
    report = ckptlab.replay(nan_run, FAULT_STEP)
    assert report.reproduced and report.deterministic and report.root_step == FAULT_STEP
    assert report.origin.kind == "data" and report.origin.module is None  # it arrived in the batch
    assert "enters the model at `transformer`" in report.origin.detail
    assert [(s.row, s.sample_id) for s in report.samples] == [(FAULT_ROW, hm.FAULT_SAMPLE)]
    assert report.counterfactuals[0].fault is False


def test_every_step_replays_bit_for_bit(nan_run):
    """Dropout's RNG, clipping and the LR warm-up as the Trainer ran them, twice alike."""
    start = ckptlab.open_run(nan_run).checkpoints[0]
    first = ckptlab.replay(nan_run, FAULT_STEP, from_step=start, trace=False, counterfactuals=False)
    assert len(first.steps) >= 2 and all(c.match for c in first.steps) and first.deterministic
    again = ckptlab.replay(nan_run, FAULT_STEP, from_step=start, trace=False, counterfactuals=False)
    assert [repr((c.loss, c.grad_norm)) for c in again.steps] == [repr((c.loss, c.grad_norm)) for c in first.steps]


def test_replay_names_the_layer_an_absurd_sample_overflows(tmp_path):
    report = ckptlab.replay(train(tmp_path, "overflow"), FAULT_STEP)
    assert report.reproduced and report.deterministic and report.root_step == FAULT_STEP
    assert report.origin.module == "transformer.h.0.ln_1"
    assert report.origin.op == "aten.native_layer_norm.default"
    assert [s.sample_id for s in report.samples] == [hm.FAULT_SAMPLE]


# --- gradient accumulation ---------------------------------------------------------------------

ACCUM = 2  # micro-batches per optimizer step
ACCUM_STEP, ACCUM_MICRO = divmod(hm.FAULT_SAMPLE // hm.BATCH, ACCUM)  # step 4, its micro-batch 1


@pytest.fixture(scope="module")
def accum_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf-accum")
    args = replace(hm.ARGS, gradient_accumulation_steps=ACCUM, eval_strategy="no")
    trainer = Trainer(model=hm.model(), args=args, train_dataset=hm.Sequences(fault="nan"))
    ckt.record(trainer, tmp / "run", build_fn=hm.build, sample_id_key="idx", ckpt_every=3)
    with pytest.raises(ckptlab.NonFiniteLoss) as e:
        trainer.train()
    assert e.value.step == ACCUM_STEP  # one recorded step per optimizer step
    return tmp / "run"


def test_accumulation_records_one_step_per_optimizer_step_with_its_micro_batches(accum_run):
    run = ckptlab.open_run(accum_run)
    assert run.steps == list(range(ACCUM_STEP + 1))
    batch, ids = run.batch(ACCUM_STEP)
    assert ids == list(range(32, 40)) and batch["micro_rows"] == [4, 4]
    assert [set(p["inputs"]) for p in batch["micro_batches"]] == [{"inputs_embeds", "labels"}] * 2
    # the Trainer's loss normalization: the label tokens of the whole step, not of one micro-batch
    assert int(batch["num_items_in_batch"]) == ACCUM * hm.BATCH * hm.SEQ
    assert batch["transformers"]["current_gradient_accumulation_steps"] == ACCUM
    assert (run.metrics().grad_norm[:ACCUM_STEP] > 0).all()


def test_accumulation_replays_bit_for_bit_and_blames_the_micro_batch_row(accum_run, capsys):
    from ckptlab.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["replay", "--run", str(accum_run), "--step", str(ACCUM_STEP), "--json"])
    assert done.value.code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["root_step"] == ACCUM_STEP and doc["reproduced"] and doc["deterministic"]
    assert doc["samples"][0] == {
        **doc["samples"][0],
        "micro_batch": ACCUM_MICRO,
        "row": FAULT_ROW,
        "sample_id": hm.FAULT_SAMPLE,
    }
    assert len(doc["samples"]) == 1 and f"micro-batch {ACCUM_MICRO} row {FAULT_ROW}" in doc["verdict"]
    assert doc["counterfactuals"][0]["fault"] is False  # without that row, the step is healthy
    steps = ckptlab.replay(accum_run, ACCUM_STEP, from_step=3, trace=False, counterfactuals=False).steps
    assert [c.step for c in steps] == [3, ACCUM_STEP] and all(c.match for c in steps)


@pytest.mark.parametrize("model_normalizes", [True, False])
def test_accumulation_across_an_epoch_end_replays_bit_for_bit(tmp_path, model_normalizes):
    """16 batches an epoch, 3 per step: the epoch's last step has one micro-batch. The loss is
    normalized by num_items_in_batch (a model that takes it) or by the step's micro-batch count
    (one, at the epoch's end)."""
    trainer_cls = Trainer if model_normalizes else hm.UnnormalizedTrainer
    trainer = trainer_cls(model=hm.model(), args=hm.EPOCH_ARGS, train_dataset=hm.Sequences())
    build = hm.build_epoch if model_normalizes else hm.build_epoch_unnormalized
    ckt.record(trainer, tmp_path / "run", build_fn=build, sample_id_key="idx", ckpt_every=100)
    trainer.train()
    run = ckptlab.open_run(tmp_path / "run")
    assert [run.batch(s)[0]["micro_rows"] for s in (4, 5, 6)] == [[4, 4, 4], [4], [4, 4, 4]]
    assert run.batch(5)[0]["transformers"]["current_gradient_accumulation_steps"] == 1
    assert ("num_items_in_batch" in run.batch(5)[0]) == model_normalizes
    report = ckptlab.replay(tmp_path / "run", 7, from_step=0, trace=False, counterfactuals=False)
    assert [c.step for c in report.steps] == list(range(8)) and all(c.match for c in report.steps)


def test_a_callback_that_was_not_attached_says_how(tmp_path):
    cb = ckt.CkptlabCallback(tmp_path / "run", build_fn=hm.build)
    trainer = Trainer(
        model=GPT2LMHeadModel(hm.config()),
        args=hm.ARGS,
        train_dataset=hm.Sequences(),
        eval_dataset=hm.Sequences(8),
        callbacks=[cb],
    )
    with pytest.raises(RecordError, match="attach"):
        trainer.train()


def test_callback_takes_the_recorders_options_and_refuses_unknown_ones(tmp_path):
    cb = ckt.CkptlabCallback(tmp_path / "run", build_fn=hm.build, health_every=1)
    assert (cb.config.val_metric, cb.config.health_every, cb.config.step_scheduler) == ("eval_loss", 1, False)
    given = ckt.CkptlabCallback(tmp_path / "run", build_fn=hm.build, config=ckptlab.RecordConfig(ckpt_every=50))
    assert given.config.val_metric == "eval_loss"  # the Trainer never reports a "val_loss"
    with pytest.raises(ckptlab.RecordError, match="unknown Recorder option"):
        ckt.CkptlabCallback(tmp_path / "run", build_fn=hm.build, keep_lst=2)


# --- mixed precision ---------------------------------------------------------------------------


def replay_json(run_dir, step, capsys) -> dict:
    from ckptlab.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["replay", "--run", str(run_dir), "--step", str(step), "--json"])
    assert done.value.code == 0
    return json.loads(capsys.readouterr().out)


def test_bf16_with_accumulation_replays_bit_for_bit(tmp_path, capsys):
    """bf16=True: accelerate's autocast wraps the model's forward. build() prepares the model
    as train() does, so replay runs the same bfloat16 forward: every loss equal to the bit."""
    trainer = Trainer(model=hm.model(), args=hm.fresh(hm.BF16_ARGS), train_dataset=hm.Sequences(fault="nan"))
    ckt.record(trainer, tmp_path / "run", build_fn=hm.build_bf16, sample_id_key="idx", ckpt_every=3)
    with pytest.raises(ckptlab.NonFiniteLoss):
        trainer.train()
    doc = replay_json(tmp_path / "run", ACCUM_STEP, capsys)
    assert doc["root_step"] == ACCUM_STEP and doc["reproduced"] and doc["deterministic"] and doc["bit_exact"]
    assert (doc["samples"][0]["micro_batch"], doc["samples"][0]["sample_id"]) == (ACCUM_MICRO, hm.FAULT_SAMPLE)
    steps = ckptlab.replay(tmp_path / "run", ACCUM_STEP, from_step=0, trace=False, counterfactuals=False).steps
    assert [c.step for c in steps] == list(range(ACCUM_STEP + 1))
    # bit for bit, not close (before: ~2e-5 apart, with the forward replayed in float32)
    assert [repr((c.loss, c.grad_norm)) for c in steps] == [
        repr((c.recorded_loss, c.recorded_grad_norm)) for c in steps
    ]


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf-fp16")
    trainer = hm.CpuFp16Trainer(model=hm.model(), args=hm.fresh(hm.FP16_ARGS), train_dataset=hm.Sequences(fault="nan"))
    ckt.record(trainer, tmp / "run", build_fn=hm.build_fp16, sample_id_key="idx", ckpt_every=5)
    with pytest.raises(ckptlab.NonFiniteLoss) as e:
        trainer.train()
    assert e.value.step == FAULT_STEP
    return tmp / "run"


def test_fp16_scaler_skips_are_recorded_as_skipped_and_replayed_with_the_scale(fp16_run):
    """The Trainer's default fused AdamW: the GradScaler hands it the inf flag and it skips
    the update itself. The first steps overflow at the initial scale: skipped, not faults."""
    run = ckptlab.open_run(fp16_run)
    m = run.metrics()
    assert [int(s) for s in m.step[m.scaler_skipped]][:2] == [0, 1]
    scales = [s["grad_scale"] for s in m.scalars]
    assert scales[:3] == [hm.FP16_INIT_SCALE, hm.FP16_INIT_SCALE / 2, hm.FP16_INIT_SCALE / 4]
    assert [(e["step"], e["kind"]) for e in run.events()] == [(FAULT_STEP, "nonfinite_loss")]
    report = ckptlab.replay(fp16_run, FAULT_STEP, from_step=0, trace=False, counterfactuals=False)
    assert [c.step for c in report.steps] == list(range(FAULT_STEP + 1)) and report.bit_exact
    assert [c.grad_scale for c in report.steps] == scales  # the scaler's state, step by step
    assert all(c.match for c in report.steps[:-1])


def test_fp16_replay_names_the_nan_sample(fp16_run, capsys):
    doc = replay_json(fp16_run, FAULT_STEP, capsys)
    assert doc["root_step"] == FAULT_STEP and doc["reproduced"] and doc["deterministic"] and doc["bit_exact"]
    assert doc["start_checkpoint"] == 5  # the scaler's state came back from checkpoint 5
    assert doc["origin"]["kind"] == "data"
    assert [(s["row"], s["sample_id"]) for s in doc["samples"]] == [(FAULT_ROW, hm.FAULT_SAMPLE)]


def test_fp16_skipped_step_leaves_the_lr_schedule_and_replays(tmp_path):
    """A non-fused optimizer: the scaler skips its step, and the Trainer does not step the LR
    schedule after it (warm-up stays at 0); replay does the same."""
    trainer = hm.CpuFp16Trainer(model=hm.model(), args=hm.fresh(hm.FP16_UNFUSED_ARGS), train_dataset=hm.Sequences())
    ckt.record(trainer, tmp_path / "run", build_fn=hm.build_fp16_unfused, sample_id_key="idx", ckpt_every=100)
    trainer.train()
    m = ckptlab.open_run(tmp_path / "run").metrics()
    assert m.scaler_skipped[:2].tolist() == [True, True] and m.lr[:3, 0].tolist() == [0.0, 0.0, 0.0]
    assert m.lr[3, 0] > 0  # the first update that happened moved the schedule on
    report = ckptlab.replay(tmp_path / "run", 3, from_step=0, trace=False, counterfactuals=False)
    assert len(report.steps) == 4 and all(c.match for c in report.steps) and report.bit_exact


def test_whole_model_in_float32_undoes_accelerates_autocast():
    """The precision counterfactual's last resort, the whole model in float32: the Trainer's
    bf16 autocast lives in accelerate's wrapper around the model's forward, which would turn
    it back on inside; the float32 run goes around it."""
    from ckptlab.replayer.precision import in_float32

    model = hm.build_bf16()[0]
    seen = []
    model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    sample = hm.Sequences()[0]
    inputs = {"inputs_embeds": sample["inputs_embeds"][None], "labels": sample["labels"][None]}
    with in_float32(model, ""):
        model(**inputs)
    model(**inputs)  # restored: accelerate's autocast again
    assert seen == [torch.float32, torch.bfloat16]
