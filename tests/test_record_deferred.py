"""The Recorder's deferred health read (the default on a GPU, tested here on the CPU with
health_read="deferred"): step n's health is written when step n+1 ends, an anomaly is still
recorded against its own step, NonFiniteLoss comes at most one step late, and nothing pending
is lost at a checkpoint, at close, after a failed step or at interpreter exit."""

import math
import weakref

import numpy as np
import pytest
import torch

import ckptlab
from ckptlab.run.writer import RunWriter

from . import models


def nan_batches(n: int, bad: int):
    out = [b for b, _ in models.mlp_batches(n)]
    out[bad] = (torch.full((4, 8), math.nan), torch.zeros(4, 1))
    return out


def recorder(run_dir, **kw):
    model, opt = models.build_mlp()
    kw.setdefault("health_read", "deferred")
    return ckptlab.Recorder(run_dir, model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp, **kw)


def test_health_is_written_one_step_later_and_equals_the_immediate_read(tmp_path):
    metrics = {}
    for mode in ("deferred", "immediate"):
        with recorder(tmp_path / mode, health_read=mode, health_every=1) as rec:
            for b, _ in models.mlp_batches(5):
                rec.step(b)
            steps = ckptlab.open_run(tmp_path / mode).metrics().step.tolist()
            assert steps == list(range(4 if mode == "deferred" else 5))
        assert ckptlab.open_run(tmp_path / mode).manifest["config"]["health_read"] == mode
        metrics[mode] = ckptlab.open_run(tmp_path / mode).metrics()
    a, b = metrics["deferred"], metrics["immediate"]
    assert a.step.tolist() == b.step.tolist() == [0, 1, 2, 3, 4]  # close() wrote the last one
    for key in ("loss", "grad_norm", "param_grad_norm", "update_ratio", "weight_norm"):
        assert np.array_equal(getattr(a, key), getattr(b, key), equal_nan=True), key


def test_nonfinite_loss_is_raised_one_step_late_naming_its_own_step(run_dir):
    with recorder(run_dir) as rec:
        batches = nan_batches(5, bad=2)
        rec.step(batches[0])
        rec.step(batches[1])
        rec.step(batches[2])  # the NaN step itself returns
        with pytest.raises(ckptlab.NonFiniteLoss) as e:
            rec.step(batches[3])
    assert e.value.step == 2 and "--step 2" in str(e.value)
    run = ckptlab.open_run(run_dir)
    assert run.metrics().step.tolist() == [0, 1, 2, 3]  # the step after it is recorded too
    assert math.isnan(run.metrics().loss[2])
    assert {(ev["step"], ev["kind"]) for ev in run.events()} >= {(2, "nonfinite_loss"), (2, "nonfinite_grad")}


def test_a_nonfinite_last_step_is_recorded_at_close_without_raising(run_dir):
    seen = []
    with recorder(run_dir, on_anomaly=lambda step, events: seen.append(step)) as rec:
        for b in nan_batches(3, bad=2):
            rec.step(b)
    run = ckptlab.open_run(run_dir)
    assert math.isnan(run.metrics().loss[-1]) and seen == [2]


def test_pending_health_is_written_before_a_checkpoint_and_after_a_failed_step(run_dir):
    def failing(model, optimizer, batch):
        raise RuntimeError("boom")

    with recorder(run_dir, ckpt_every=2) as rec:
        for b, _ in models.mlp_batches(2):
            rec.step(b)
        rec.step(next(models.mlp_batches(1))[0])  # step 2 checkpoints first: steps 0, 1 settled
        assert ckptlab.open_run(run_dir).metrics().step.tolist() == [0, 1]
        rec.step_fn = failing
        with pytest.raises(RuntimeError, match="boom"):
            rec.step(next(models.mlp_batches(1))[0])
        assert ckptlab.open_run(run_dir).metrics().step.tolist() == [0, 1, 2]


def test_a_deferred_run_replays_bit_for_bit_and_finds_the_planted_fault(run_dir):
    with recorder(run_dir, ckpt_every=3, on_nonfinite="record", on_anomaly=None) as rec:
        for b in nan_batches(6, bad=4):
            rec.step(b)
    report = ckptlab.replay(run_dir, 4)
    assert report.deterministic and report.reproduced and report.root_step == 4
    assert report.origin.kind == "data"


def test_the_checkpoint_snapshot_is_released_once_committed(run_dir, monkeypatch):
    held = []
    submit = RunWriter.submit_checkpoint

    def keep_ref(self, captured, retention):
        held.append(weakref.ref(next(iter(captured.model.values()))))
        return submit(self, captured, retention)

    monkeypatch.setattr(RunWriter, "submit_checkpoint", keep_ref)
    with recorder(run_dir, ckpt_every=2) as rec:
        for b, _ in models.mlp_batches(3):
            rec.step(b)
        rec.flush()
        assert len(held) == 2 and all(ref() is None for ref in held)


def test_health_still_pending_at_interpreter_exit_is_written(run_dir):
    rec = recorder(run_dir)
    for b, _ in models.mlp_batches(3):
        rec.step(b)
    assert ckptlab.open_run(run_dir).metrics().step.tolist() == [0, 1]
    rec._exit_hook()  # what atexit runs when the script ends without close()
    assert ckptlab.open_run(run_dir).metrics().step.tolist() == [0, 1, 2]
    rec.close()


def test_the_options_are_checked_and_the_manifest_says_which_were_used(tmp_path):
    for bad, match in (
        ({"update_ratio": "approx"}, "update_ratio must be"),
        ({"health_read": "x"}, "health_read must"),
    ):
        with pytest.raises(ckptlab.RecordError, match=match):
            recorder(tmp_path / "bad", **bad)
    for options, expected in (
        ({"health_read": "auto"}, {"update_ratio": "sampled", "health_read": "immediate"}),  # auto on a CPU model
        ({"update_ratio": "exact"}, {"update_ratio": "exact", "health_read": "deferred"}),
    ):
        run_dir = tmp_path / options.get("update_ratio", "auto")
        with recorder(run_dir, **options) as rec:
            rec.step(next(models.mlp_batches(1))[0])
        config = ckptlab.open_run(run_dir).manifest["config"]
        assert {k: config[k] for k in expected} == expected
