"""run/retention.py: storage stays proportional to ckpt_every, and what matters is never deleted."""

from __future__ import annotations

import math

import torch

import ckptlab
from ckptlab.run.layout import dir_size
from ckptlab.training.state import load_model, load_train_state, restore_rng
from tests import models


def on_disk(run_dir):
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    segments = sorted(p.name for p in (run_dir / "batches" / "rank0").iterdir())
    return checkpoints, segments


def test_storage_is_bounded_by_keep_last(run_dir):
    batches = list(models.lm_batches(80))
    built = models.build_lm()
    sizes = {}
    with ckptlab.Recorder(
        run_dir,
        built[0],
        built[1],
        step_fn=models.step_lm,
        build_fn=models.build_lm,
        scheduler=built[2],
        ckpt_every=5,
        keep_last=2,
    ) as rec:
        for n, (batch, ids) in enumerate(batches):
            rec.step(batch, sample_ids=ids)
            if n in (39, 79):
                rec.flush()  # let the background retention catch up
                sizes[n] = (dir_size(run_dir / "checkpoints"), dir_size(run_dir / "batches"))
    checkpoints, segments = on_disk(run_dir)
    assert checkpoints == ["step-000000070", "step-000000075"]
    assert segments == ["s000-000000070.log", "s000-000000075.log"]
    for later, earlier in zip(sizes[79], sizes[39]):  # 80 steps take the room of 40
        assert later <= 1.05 * earlier
    run = ckptlab.open_run(run_dir)
    assert run.steps == list(range(70, 80)) and run.checkpoints == [70, 75]
    assert run.metrics().step.tolist() == list(range(80))  # per-step health is small: all kept
    assert run.damaged == []


def test_keep_last_zero_keeps_everything(run_dir):
    models.record_run(run_dir, models.build_mlp, models.step_mlp, models.mlp_batches(12), ckpt_every=3, keep_last=0)
    run = ckptlab.open_run(run_dir)
    assert run.checkpoints == [0, 3, 6, 9] and run.steps == list(range(12))


def test_best_and_last_healthy_survive_and_the_anomaly_stays_replayable(run_dir):
    batches = list(models.mlp_batches(60))
    batches[23] = ((torch.full((4, 8), math.nan), torch.zeros(4, 1)), [-1] * 4)
    val = {9: 0.5, 14: 0.9}  # best after step 9: a checkpoint at step 10

    def validate(i, model):
        return {"val_loss": val[i]} if i in val else None

    losses = models.record_run(
        run_dir,
        models.build_mlp,
        models.step_mlp,
        batches,
        ckpt_every=5,
        keep_last=2,
        on_nonfinite="record",
        validate=validate,
    )
    run = ckptlab.open_run(run_dir)
    assert run.checkpoints == [10, 20, 50, 55]  # best, last healthy before step 23, the last two
    assert run.checkpoint(10).reason == "best" and run.checkpoint(10).commit["validation"] == {"val_loss": 0.5}
    assert run.checkpoint(20).commit["healthy"] is True and run.checkpoint(50).commit["healthy"] is False
    assert set(range(20, 24)) <= set(run.steps)

    # Replay the anomaly from the last healthy checkpoint: the same losses, the NaN included.
    model, opt = models.build_mlp()
    ckpt = run.checkpoint(20)
    load_model(model, *ckpt.load_model())
    state = ckpt.load_state()
    load_train_state(state, opt)
    restore_rng(state["rng"])
    replayed = [models.step_mlp(model, opt, run.batch(n)[0]).item() for n in range(20, 24)]
    assert replayed[:3] == losses[20:23] and math.isnan(replayed[3]) and math.isnan(losses[23])
