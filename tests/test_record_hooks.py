"""Recorder hooks for loops it does not drive (begin_step/end_step) and anomaly alerts."""

import logging
import subprocess
import sys

import pytest
import torch

import ckptlab
from tests import fault_models as fm
from tests import models


def test_begin_end_step_records_what_step_records(tmp_path):
    batches = list(models.mlp_batches(8))
    driven = models.record_run(tmp_path / "a", models.build_mlp, models.step_mlp, batches, ckpt_every=4)
    model, opt = models.build_mlp()
    external = []
    with ckptlab.Recorder(
        tmp_path / "b", model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp, ckpt_every=4
    ) as rec:
        for batch, ids in batches:  # a framework runs the step; ckptlab only watches
            n = rec.begin_step(batch, sample_ids=ids)
            loss = models.step_mlp(model, opt, batch)
            health = rec.end_step(loss)
            assert health.loss == loss.item() and n == len(external)
            external.append(loss.item())
    assert external == driven
    a, b = ckptlab.open_run(tmp_path / "a").metrics(), ckptlab.open_run(tmp_path / "b").metrics()
    assert a.grad_norm.tolist() == b.grad_norm.tolist()
    assert ckptlab.replay(tmp_path / "b", 7).deterministic


def test_misuse_of_begin_end_is_a_clear_error(run_dir):
    model, opt = models.build_mlp()
    ((batch, ids),) = list(models.mlp_batches(1))
    with ckptlab.Recorder(run_dir, model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp) as rec:
        with pytest.raises(ckptlab.RecordError, match="end_step called without begin_step"):
            rec.end_step(1.0)
        rec.begin_step(batch, ids)
        with pytest.raises(ckptlab.RecordError, match="twice"):
            rec.begin_step(batch, ids)


def test_on_anomaly_callback_and_default_warning(tmp_path, caplog):
    seen = []
    fm._record(
        tmp_path / "cb",
        fm.build_mlp,
        fm.step_mlp,
        _nan_at(27),
        on_anomaly=lambda step, events: seen.append((step, [e["kind"] for e in events])),
    )
    assert seen[0][0] == 27 and "nonfinite_loss" in seen[0][1]
    fm._record(tmp_path / "warn", fm.build_mlp, fm.step_mlp, _nan_at(27))
    (alert,) = [r for r in caplog.records if r.name.startswith("ckptlab.")]
    assert alert.levelno == logging.WARNING  # what Python prints on stderr with no logging configured
    err = alert.getMessage()
    assert "step 27: nonfinite loss" in err and f"ckptlab replay --run {tmp_path / 'warn'} --step 27" in err


def test_the_default_alert_reaches_stderr_with_no_logging_configured(tmp_path):
    code = "from ckptlab.record.health import _warn_anomaly; _warn_anomaly('RUN')(27, [{'kind': 'nonfinite_loss'}])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "ckptlab: step 27: nonfinite loss; explain it with ckptlab replay --run RUN --step 27" in done.stderr


def _nan_at(step):
    for s in range(40):
        x, y = fm._xy(s)
        if s == step:
            x[0, 0] = float("nan")
        yield x, y


def test_accumulated_step_measures_the_pre_clip_norm_once_on_the_last_backward(run_dir, monkeypatch):
    """Gradient accumulation with begin_step() and record_batch(): the batch is recorded late
    (with the RNG states of the step's start), and the gradient norms are those of the summed
    gradient before clipping, measured on the last micro-batch's backward only."""
    from ckptlab.training import probe
    from ckptlab.training.probe import accumulating

    model, opt = models.build_mlp()
    micro = [b for b, _ in models.mlp_batches(4)]
    norms = []
    real_norm = torch.linalg.vector_norm
    with ckptlab.Recorder(run_dir, model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp) as rec:
        rec.begin_step()  # no batch yet: the micro-batches arrive one by one
        batched = probe.batched_norms  # the probe's one batched norm call per measured backward
        monkeypatch.setattr(probe, "batched_norms", lambda ts: norms.append(len(ts)) or batched(ts))
        for i, (x, y) in enumerate(micro):
            accumulating(opt, i < len(micro) - 1)
            if i == len(micro) - 1:
                rec.record_batch({"micro_batches": micro, "micro_rows": [4] * 4}, list(range(16)))
            (torch.nn.functional.mse_loss(model(x), y) / len(micro)).backward()
        monkeypatch.setattr(probe, "batched_norms", batched)
        expected = real_norm(torch.stack([real_norm(p.grad) for p in model.parameters()])).item()
        assert norms == [len(list(model.parameters()))]  # every gradient once: the last backward only
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        opt.step()
        health = rec.end_step(torch.tensor(1.0))
    assert health.grad_norm == pytest.approx(expected, rel=1e-6) and expected > 1e-3  # before the clip
    batch, ids = ckptlab.open_run(run_dir).batch(0)
    assert batch["micro_rows"] == [4] * 4 and ids == list(range(16))


def test_record_batch_needs_a_step_begun_without_one(run_dir):
    model, opt = models.build_mlp()
    ((batch, ids),) = list(models.mlp_batches(1))
    with ckptlab.Recorder(run_dir, model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp) as rec:
        with pytest.raises(ckptlab.RecordError, match="record_batch needs a step"):
            rec.record_batch(batch, ids)
        rec.begin_step()
        with pytest.raises(ckptlab.RecordError, match="before record_batch"):
            rec.end_step(1.0)


def test_a_checkpoint_before_record_batch_gives_the_batch_the_states_its_step_began_in(run_dir):
    """A step begun without its batch, whose RNG states did not change since the last step (so
    none were due), checkpoints mid-step (a best validation) after drawing random numbers: the
    batch, recorded after that, carries the states the step began in, not the ones at the
    checkpoint, so a replay from there starts right."""
    model, opt = models.build_mlp()
    batches = list(models.mlp_batches(3))
    with ckptlab.Recorder(run_dir, model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp) as rec:
        for i, (batch, ids) in enumerate(batches):
            rec.begin_step()
            began = torch.get_rng_state()
            if i == 2:
                torch.rand(5)  # the validation's data loading draws
                rec.log_validation(val_loss=1.0 / (i + 1))  # a new best: checkpointed here, mid-step
            rec.record_batch(batch, ids)
            rec.end_step(models.step_mlp(model, opt, batch))
    run = ckptlab.open_run(run_dir)
    assert 2 in run.checkpoints
    assert run.batch_record(1).rng is None  # unchanged since step 0 ended: nothing recorded
    assert torch.equal(run.batch_record(2).rng["torch"], began)


def test_a_loop_that_goes_on_after_abort_step_records_its_next_steps_cleanly(run_dir):
    """A step aborted at a checkpoint's step, with its batch recorded, keeps its number (a step
    that never returned, as a resumed session counts it): the next opens after it. One aborted
    before its batch was recorded begins again under its number, in the segments already open.
    Neither writes a second batch under one number, nor fails to open a segment twice."""
    model, opt = models.build_mlp()
    batches = list(models.mlp_batches(4))
    with ckptlab.Recorder(run_dir, model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp, ckpt_every=2) as rec:
        rec.begin_step(*batches[0])
        try:
            raise RuntimeError("a bad batch")  # (the loop's own, caught: it goes on)
        except RuntimeError:
            rec.abort_step()  # step 0: its batch stays
        for n, (batch, ids) in enumerate(batches[1:], 1):
            if n == 2:  # a checkpoint's step, aborted before its batch came
                rec.begin_step()
                rec.abort_step()
            assert rec.begin_step(batch, ids) == n
            rec.end_step(models.step_mlp(model, opt, batch))
    run = ckptlab.open_run(run_dir)
    assert run.steps == [0, 1, 2, 3] and run.metrics().step.tolist() == [1, 2, 3]
    assert [run.batch(s)[1] for s in run.steps] == [ids for _, ids in batches]
    assert [(e["step"], e["error"]) for e in run.events()] == [(0, "RuntimeError: a bad batch")]
    assert run.checkpoints == [0, 2] and run.problems == []
