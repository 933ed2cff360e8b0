"""The Lightning callback records a real Trainer's run; replay re-runs its steps bit for bit
and names the planted sample (and, for an overflow, the layer)."""

import json
import warnings

import pytest

pytest.importorskip("lightning")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import ckptlab  # noqa: E402
from ckptlab.integrations import lightning as ckl  # noqa: E402
from ckptlab.run.records import NO_GRAD  # noqa: E402
from tests.integrations import lit_models as lm  # noqa: E402

# Lightning's own deprecation noise (torch pytree API), and the refusal test's missing val loader.
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec"),
    pytest.mark.filterwarnings("ignore:.*no `val_dataloader`.*"),
]

FAULT_STEP = lm.FAULT_SAMPLE // lm.BATCH  # 9
FAULT_ROW = lm.FAULT_SAMPLE % lm.BATCH  # 1


def fit(tmp_path, fault, **callback_kw):
    run_dir = tmp_path / "run"
    cb = ckl.CkptlabCallback(run_dir, build_fn=lm.build, sample_ids="idx", ckpt_every=5, **callback_kw)
    train, val = lm.loaders(fault)
    trainer = lm.trainer(tmp_path, callbacks=[cb])
    torch.manual_seed(0)  # the same initial weights every time: where an overflow lands depends on them
    if fault is None:
        trainer.fit(lm.LitMLP(), train, val)
    else:
        with pytest.raises(ckptlab.NonFiniteLoss) as e:
            trainer.fit(lm.LitMLP(), train, val)
        assert e.value.step == FAULT_STEP
    return run_dir


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    return fit(tmp_path_factory.mktemp("lit-nan"), "nan")


def test_records_batches_ids_health_validation_and_checkpoints(nan_run):
    run = ckptlab.open_run(nan_run)
    assert run.steps == list(range(FAULT_STEP + 1))
    batch, ids = run.batch(FAULT_STEP)
    assert ids == [36, 37, 38, 39]
    assert batch["batch_idx"] == FAULT_STEP and batch["batch"]["x"].shape == (4, 8)
    assert batch["lightning"] == {
        "epoch": 0,
        "gradient_clip_val": 1.0,
        "gradient_clip_algorithm": None,
        "scheduler_step": True,
        "precision": "32-true",
    }
    assert [v["step"] for v in run.validation()] == [4, 8]  # after 4 and 8 steps
    assert set(run.validation()[0]["metrics"]) == {"val_loss"}
    assert {4, 5} <= set(run.checkpoints)  # the first validation is the best so far; 5 is periodic
    m = run.metrics()
    assert (m.grad_norm[:FAULT_STEP] > 0).all() and m.lr[1, 0] > m.lr[0, 0]  # warm-up stepped by the trainer
    assert {e["kind"] for e in run.events()} >= {"nonfinite_loss"}
    # where each step's time went, from the callback's begin_step/end_step (record/system.py)
    assert (m.samples == 4).all() and (m.wall_time > 0).all() and (m.mem_peak > 0).all()
    assert np.isnan(m.data_wait[0]) and (m.data_wait[1:] >= 0).all()  # (Lightning's turn between two steps)
    assert m.ckpt_time[5] > 0  # periodic checkpoint


def test_replay_names_the_nan_sample_bit_exactly(nan_run):
    report = ckptlab.replay(nan_run, FAULT_STEP)
    assert report.reproduced and report.deterministic
    assert report.root_step == FAULT_STEP
    assert report.origin.kind == "data" and report.origin.module is None  # it arrived in the batch
    assert [(s.row, s.sample_id) for s in report.samples] == [(FAULT_ROW, lm.FAULT_SAMPLE)]
    assert report.counterfactuals[0].fault is False


def test_every_step_replays_bit_for_bit(nan_run):
    """From the first retained checkpoint: dropout's RNG, clipping and the scheduler's warm-up
    all as the trainer ran them, and the same numbers on a second replay."""
    first = ckptlab.replay(nan_run, FAULT_STEP, from_step=4, trace=False, counterfactuals=False)  # 4: best val
    assert [c.step for c in first.steps] == list(range(4, FAULT_STEP + 1))
    assert all(c.match for c in first.steps) and first.deterministic
    again = ckptlab.replay(nan_run, FAULT_STEP, from_step=4, trace=False, counterfactuals=False)
    assert [repr((c.loss, c.grad_norm)) for c in again.steps] == [repr((c.loss, c.grad_norm)) for c in first.steps]


def test_replay_names_the_layer_an_absurd_sample_overflows(tmp_path):
    report = ckptlab.replay(fit(tmp_path, "overflow"), FAULT_STEP)
    assert report.reproduced and report.deterministic and report.root_step == FAULT_STEP
    assert report.origin.module == "fc1" and report.origin.op == "aten.addmm.default"
    assert report.origin.phase == "forward"  # though it ran inside optimizer.step(closure)
    assert [s.sample_id for s in report.samples] == [lm.FAULT_SAMPLE]


def test_an_exception_of_the_users_hook_is_the_steps_own_on_replay(tmp_path, cli):
    """`on_after_backward` raises on the NaN sample's gradients: replay's trainerless step runs
    the hook through ckptlab's shim, and the exception is still the user's step raising (traced
    to the sample), not ckptlab's internal error."""
    run_dir = tmp_path / "run"
    cb = ckl.CkptlabCallback(run_dir, build_fn=lm.build_checked, sample_ids="idx", ckpt_every=5)
    train, val = lm.loaders("nan")
    torch.manual_seed(0)
    with pytest.raises(FloatingPointError):
        lm.trainer(tmp_path, callbacks=[cb]).fit(lm.LitChecked(), train, val)
    done = cli("replay", "--run", run_dir, "--step", FAULT_STEP, "--json")
    assert done.code == 0, done.err
    doc = done.json()
    assert doc["root_step"] == FAULT_STEP and doc["origin"]["kind"] == "data"
    assert doc["origin"]["raised"]["error"] == "FloatingPointError: non-finite gradient"
    assert [s["sample_id"] for s in doc["samples"]] == [lm.FAULT_SAMPLE]


def test_on_anomaly_reaches_the_recorder(tmp_path):
    seen = []
    fit(tmp_path, "nan", on_anomaly=lambda step, events: seen.append((step, [e["kind"] for e in events])))
    assert seen and seen[0][0] == FAULT_STEP and "nonfinite_loss" in seen[0][1]


# --- gradient accumulation ---------------------------------------------------------------------

ACCUM = 2  # micro-batches per optimizer step
ACCUM_STEP, ACCUM_MICRO = divmod(lm.FAULT_SAMPLE // lm.BATCH, ACCUM)  # step 4, its micro-batch 1


@pytest.fixture(scope="module")
def accum_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lit-accum")
    cb = ckl.CkptlabCallback(tmp / "run", build_fn=lm.build, sample_ids="idx", ckpt_every=3)
    train, _ = lm.loaders("nan")
    torch.manual_seed(0)
    with pytest.raises(ckptlab.NonFiniteLoss) as e:
        lm.trainer(tmp, callbacks=[cb], accumulate_grad_batches=ACCUM, limit_val_batches=0).fit(lm.LitMLP(), train)
    assert e.value.step == ACCUM_STEP  # one recorded step per optimizer step
    return tmp / "run"


def test_accumulation_records_one_step_per_optimizer_step_with_its_micro_batches(accum_run):
    run = ckptlab.open_run(accum_run)
    assert run.steps == list(range(ACCUM_STEP + 1))
    batch, ids = run.batch(ACCUM_STEP)
    assert ids == list(range(32, 40)) and batch["micro_rows"] == [4, 4]
    assert [p["batch_idx"] for p in batch["micro_batches"]] == [8, 9]
    assert batch["lightning"]["accumulate_grad_batches"] == ACCUM
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
        "sample_id": lm.FAULT_SAMPLE,
    }
    assert len(doc["samples"]) == 1 and f"micro-batch {ACCUM_MICRO} row {FAULT_ROW}" in doc["verdict"]
    culprit = doc["culprit"]  # rows said as the samples say them: within their micro-batch
    assert culprit["micro_batches"] == [ACCUM_MICRO] and culprit["rows"] == [FAULT_ROW]
    assert culprit["sample_ids"] == [lm.FAULT_SAMPLE]
    assert doc["counterfactuals"][0]["fault"] is False  # without that row, the step is healthy
    steps = ckptlab.replay(accum_run, ACCUM_STEP, from_step=0, trace=False, counterfactuals=False).steps
    assert [c.step for c in steps] == list(range(ACCUM_STEP + 1)) and all(c.match for c in steps)


def test_dirty_scans_each_micro_batch_of_an_accumulated_step(accum_run):
    from ckptlab.analysis.dirty import scan

    top = scan(ckptlab.open_run(accum_run)).flagged[0]
    assert (top.step, top.row, top.sample_id, top.reason) == (ACCUM_STEP, 4 + FAULT_ROW, lm.FAULT_SAMPLE, "nonfinite")


def test_a_step_that_raises_before_its_last_micro_batch_keeps_the_micro_batches_that_ran(tmp_path):
    class RaisesOn37(lm.LitMLP):
        def training_step(self, batch, batch_idx):
            if lm.FAULT_SAMPLE in batch["idx"].tolist():
                raise RuntimeError("bad sample")
            return super().training_step(batch, batch_idx)

    cb = ckl.CkptlabCallback(tmp_path / "run", build_fn=lm.build, sample_ids="idx")
    train, _ = lm.loaders()
    with pytest.raises(RuntimeError, match="bad sample"):  # batch 9: the first of step 3's three
        lm.trainer(tmp_path, callbacks=[cb], accumulate_grad_batches=3, limit_val_batches=0).fit(RaisesOn37(), train)
    batch, ids = ckptlab.open_run(tmp_path / "run").batch(3)
    assert batch["micro_rows"] == [4] and ids == [36, 37, 38, 39]
    assert batch["lightning"]["optimizer_step"] is False  # replay runs it without the update
    (event,) = ckptlab.open_run(tmp_path / "run").events()  # on_exception hands the error on
    assert event["step"] == 3 and event["error"] == "RuntimeError: bad sample"
    assert event["call"] == "training_step" and event["source"].startswith("test_lightning.py:")


def test_accumulation_across_an_epoch_end_and_validations_replays_bit_for_bit(tmp_path):
    """16 batches an epoch, 3 per step: the epoch's last step has one micro-batch (still divided
    by 3, as Lightning does), and the next epoch starts a fresh accumulation. Validation runs
    every 4 batches, between two micro-batches of a step (it draws a DataLoader seed from the
    RNG), and its best-so-far checkpoints are taken there: replay from each is exact too."""
    cb = ckl.CkptlabCallback(tmp_path / "run", build_fn=lm.build, sample_ids="idx", ckpt_every=100)
    train, val = lm.loaders()
    torch.manual_seed(0)
    lm.trainer(tmp_path, callbacks=[cb], accumulate_grad_batches=3, max_steps=8).fit(lm.LitMLP(), train, val)
    run = ckptlab.open_run(tmp_path / "run")
    assert [run.batch(s)[0]["micro_rows"] for s in (4, 5, 6)] == [[4, 4, 4], [4], [4, 4, 4]]
    assert "rng" in run.batch(1)[0]["micro_batches"][1]  # validation after batch 4 moved the RNG
    assert len(run.checkpoints) > 1
    for start in run.checkpoints:
        report = ckptlab.replay(tmp_path / "run", 7, from_step=start, trace=False, counterfactuals=False)
        assert [c.step for c in report.steps] == list(range(start, 8)) and all(c.match for c in report.steps)


def test_callback_takes_the_recorders_options_and_refuses_unknown_ones(tmp_path):
    cb = ckl.CkptlabCallback(
        tmp_path / "run", build_fn=lm.build, config=ckptlab.RecordConfig(keep_last=5), ckpt_every=3
    )
    assert (cb.config.keep_last, cb.config.ckpt_every) == (5, 3)
    assert (cb.config.step_scheduler, cb.config.restore) == (False, False)  # the trainer does both
    with pytest.raises(ckptlab.RecordError, match="unknown Recorder option"):
        ckl.CkptlabCallback(tmp_path / "run", build_fn=lm.build, ckpt_evry=3)


def test_bf16_mixed_records_and_replays_bit_exactly(tmp_path):
    """precision="bf16-mixed": the recorded step runs under the trainer's CPU bfloat16
    autocast, and replay applies the same autocast, bit for bit."""
    run_dir = tmp_path / "run"
    cb = ckl.CkptlabCallback(run_dir, build_fn=lm.build, sample_ids="idx", ckpt_every=5)
    train, val = lm.loaders("nan")
    torch.manual_seed(0)
    with pytest.raises(ckptlab.NonFiniteLoss):
        lm.trainer(tmp_path, callbacks=[cb], precision="bf16-mixed").fit(lm.LitMLP(), train, val)
    assert ckptlab.open_run(run_dir).batch(FAULT_STEP)[0]["lightning"]["precision"] == "bf16-mixed"
    report = ckptlab.replay(run_dir, FAULT_STEP, from_step=4, counterfactuals=False)
    assert report.bit_exact and len(report.steps) == FAULT_STEP - 4 + 1
    assert report.root_step == FAULT_STEP
    assert [(s.row, s.sample_id) for s in report.samples] == [(FAULT_ROW, lm.FAULT_SAMPLE)]


@pytest.mark.filterwarnings("ignore:.*lr_scheduler.step.*before.*optimizer.step")  # the first step is skipped
def test_16_mixed_with_accumulation_records_scaler_skips_and_names_a_float16_overflow(tmp_path, capsys):
    """precision="16-mixed" through Lightning's MixedPrecision plugin (the Trainer flag turns
    16-mixed into bf16-mixed on the CPU; on a GPU the flag makes this same plugin): the steps the
    GradScaler skips are recorded as skipped, replay restores the scaler's state, and a row that
    overflows float16 only is named, with its micro-batch, as a precision fault."""
    run_dir = tmp_path / "run"
    cb = ckl.CkptlabCallback(run_dir, build_fn=lm.build_fp16, sample_ids="idx", ckpt_every=3)
    train, _ = lm.loaders("fp16")
    trainer = lm.trainer(
        tmp_path, callbacks=[cb], accumulate_grad_batches=ACCUM, limit_val_batches=0, plugins=[lm.fp16_plugin()]
    )
    torch.manual_seed(0)
    with pytest.raises(ckptlab.NonFiniteLoss) as e:
        trainer.fit(lm.LitWide(), train)
    assert e.value.step == ACCUM_STEP
    run = ckptlab.open_run(run_dir)
    assert run.batch(ACCUM_STEP)[0]["lightning"]["precision"] == "16-mixed"
    m = run.metrics()
    assert [int(s) for s in m.step[m.scaler_skipped]][:3] == [0, 1, 2]  # the initial scale backs off
    assert m.scalars[0]["grad_scale"] == lm.FP16_INIT_SCALE and m.scalars[3]["grad_scale"] == lm.FP16_INIT_SCALE / 8
    assert [(e["step"], e["kind"]) for e in run.events()] == [(ACCUM_STEP, "nonfinite_loss")]  # skips are no fault

    capsys.readouterr()
    from ckptlab.cli import main

    with pytest.raises(SystemExit) as done:
        main(["replay", "--run", str(run_dir), "--step", str(ACCUM_STEP), "--json"])
    assert done.value.code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["root_step"] == ACCUM_STEP and doc["reproduced"] and doc["deterministic"] and doc["bit_exact"]
    origin = doc["origin"]
    assert (origin["kind"], origin["module"], origin["dtype"], origin["phase"]) == (
        "precision",
        "fc1",
        "float16",
        "forward",
    )
    assert doc["samples"][0] == {**doc["samples"][0], "micro_batch": ACCUM_MICRO, "row": FAULT_ROW, "sample_id": 37}
    assert "only in reduced precision" in doc["verdict"] and origin["float32_module"] == "fc1"
    steps = ckptlab.replay(run_dir, ACCUM_STEP, from_step=0, trace=False, counterfactuals=False).steps
    assert [c.step for c in steps] == list(range(ACCUM_STEP + 1)) and all(c.match for c in steps[:-1])
    assert [c.grad_scale for c in steps] == [s["grad_scale"] for s in m.scalars]  # the scaler, step by step


# --- manual optimization, two optimizers ---------------------------------------------------------------


def test_manual_optimization_with_two_optimizers_records_and_replays_bit_exactly(tmp_path):
    """A GAN under manual optimization (`self.optimizers()`, `self.manual_backward`, toggled
    optimizers, G's scheduler stepped by training_step, dropout and noise drawn in the step):
    both optimizers and G's scheduler are recorded and checkpointed, every step replays bit for
    bit, and G's learning-rate jump is named as optimizer 1's."""
    run_dir = tmp_path / "run"
    cb = ckl.CkptlabCallback(run_dir, build_fn=lm.build_gan, sample_ids="idx", ckpt_every=4)
    train, _ = lm.loaders(None)
    torch.manual_seed(0)
    trainer = lm.trainer(tmp_path, callbacks=[cb], max_steps=2 * 14, limit_val_batches=0, gradient_clip_val=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(lm.LitGAN(), train)  # (max_steps counts both optimizers' steps)
    assert not [str(w.message) for w in caught if "ckptlab" in str(w.message)]  # (no "replay will not be exact")
    run = ckptlab.open_run(run_dir)
    assert run.metrics().step.tolist() == list(range(14)) and run.batch(8)[0]["lightning"]["manual"] is True
    assert [o["key"] for o in run.manifest["optimizers"]] == [0, 1]
    assert sorted(run.checkpoint(4).load_state()["optimizer"]) == [0, 1]
    whole = ckptlab.replay(run_dir, 8, from_step=4, trace=False, counterfactuals=False)
    assert [c.step for c in whole.steps] == [4, 5, 6, 7, 8] and whole.bit_exact
    report = ckptlab.replay(run_dir, 12)
    assert report.root_step == lm.GAN_FAULT and report.bit_exact and all(c.match for c in report.steps)
    o = report.origin
    assert (o.kind, o.optimizer, o.param_group) == ("optimizer", 1, 0) and o.parameter.startswith("G.")


# --- a training_step that returns nothing ------------------------------------------------------------


@pytest.fixture(scope="module")
def quiet_gan_run(tmp_path_factory):
    """LitGAN's run with a training_step that returns nothing (G's learning rate still jumps at
    GAN_FAULT)."""
    tmp = tmp_path_factory.mktemp("lit-quiet")
    cb = ckl.CkptlabCallback(tmp / "run", build_fn=lm.build_quiet_gan, sample_ids="idx", ckpt_every=4)
    train, _ = lm.loaders(None)
    torch.manual_seed(0)
    trainer = lm.trainer(tmp, callbacks=[cb], max_steps=2 * 14, limit_val_batches=0, gradient_clip_val=None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*grad spike")  # (the Recorder's alert of the planted jump)
        trainer.fit(lm.QuietGAN(), train)
    return tmp / "run"


def test_a_manual_step_that_returns_nothing_is_recorded_with_its_loss_not_known(quiet_gan_run, capsys):
    """Every step is recorded (its optimizers stepped), its loss null: not a NaN, so neither the
    Recorder nor report calls it a non-finite loss, and report and info say so."""
    from ckptlab.analysis.health import diagnose
    from ckptlab.cli import main

    run = ckptlab.open_run(quiet_gan_run)
    m = run.metrics()
    assert m.step.tolist() == list(range(14)) and [run.batch(s)[0]["batch_idx"] for s in (4, 13)] == [4, 13]
    assert [s["loss"] for s in m.scalars] == [None] * 14 and not m.loss_known.any()
    assert m.stepped.all() and (m.grad_norm > 0).all()  # measured as ever: gradients, learning rates
    assert "nonfinite_loss" not in {e["kind"] for e in run.events()}
    report = diagnose(run, weights=False)
    assert "explosion" not in {f.kind for f in report.findings} and report.curve.first is None
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["report", "--run", str(quiet_gan_run)])
    out = capsys.readouterr().out
    assert "loss        not known: the steps returned none" in out and "!" not in out.split("\n")[1]
    with pytest.raises(SystemExit):
        main(["info", "--run", str(quiet_gan_run), "--json", "--no-verify"])
    assert json.loads(capsys.readouterr().out)["steps"]["loss_not_known"] == [[0, 13]]


def test_a_manual_step_that_returns_nothing_replays_bit_exactly_and_its_fault_is_found(quiet_gan_run, capsys):
    """Replay goes through the steps without a loss bit for bit (loss and recorded loss both
    null), and finds G's learning-rate jump from the gradients and updates alone."""
    from ckptlab.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["replay", "--run", str(quiet_gan_run), "--step", "12", "--json"])
    assert done.value.code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["root_step"] == lm.GAN_FAULT and doc["reproduced"] and doc["bit_exact"]
    assert [(c["loss"], c["recorded_loss"], c["match"]) for c in doc["steps"]] == [(None, None, True)] * 5
    assert (doc["origin"]["kind"], doc["origin"]["optimizer"]) == ("optimizer", 1)


@pytest.fixture(scope="module")
def skips_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lit-skips")
    cb = ckl.CkptlabCallback(tmp / "run", build_fn=lm.build_skips, sample_ids="idx", ckpt_every=lm.SKIPPED)
    train, _ = lm.loaders(None)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*`training_step` returned `None`")
        lm.trainer(tmp, callbacks=[cb], max_steps=10, limit_val_batches=0).fit(lm.LitSkips(), train)
    return tmp / "run"


def test_an_automatic_step_that_returns_none_is_recorded_and_the_recording_goes_on(skips_run):
    """Lightning skips the backward of a batch whose training_step returns None (here at a
    checkpoint's step): it is recorded as a step without a loss or a gradient, the steps after
    it follow one batch each, and replay goes through it bit for bit (dropout's RNG and the
    scheduler's step, as the trainer ran them)."""
    run = ckptlab.open_run(skips_run)
    m = run.metrics()
    assert m.step.tolist() == list(range(10)) == [run.batch(s)[0]["batch_idx"] for s in run.steps]
    assert m.loss_known.tolist() == [s != lm.SKIPPED for s in range(10)]
    assert (m.param_grad_norm[lm.SKIPPED] == NO_GRAD).all() and run.events() == []
    report = ckptlab.replay(skips_run, 9, from_step=0, trace=False, counterfactuals=False)
    assert report.bit_exact and [c.step for c in report.steps] == list(range(10))
    assert all(c.match for c in report.steps) and report.steps[lm.SKIPPED].loss is None
