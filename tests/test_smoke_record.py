"""Smoke: a run records, opens, and reads back exactly (deeper tests live in tests/run/)."""

import math

import torch

import ckptlab
from tests import models


def test_record_and_read_back(run_dir):
    batches = list(models.mlp_batches(30))
    losses = models.record_run(run_dir, models.build_mlp, models.step_mlp, batches, ckpt_every=10, keep_last=5)
    run = ckptlab.open_run(run_dir)
    assert run.steps == list(range(30))
    assert run.checkpoints == [0, 10, 20]
    batch, ids = run.batch(17)
    assert torch.equal(batch[0], batches[17][0][0]) and ids == batches[17][1]
    m = run.metrics()
    assert m.loss.tolist() == losses
    assert all(math.isfinite(x) for x in m.grad_norm)
    assert m.param_names == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def test_lm_with_tied_weights_and_scheduler(run_dir):
    losses = models.record_run(run_dir, models.build_lm, models.step_lm, models.lm_batches(12), ckpt_every=5)
    run = ckptlab.open_run(run_dir)
    tensors, aliases = run.checkpoint(10).load_model()
    assert aliases == {"lm_head.weight": "wte.weight"}
    assert run.metrics().lr[0, 0] < run.metrics().lr[5, 0]  # warm-up recorded per step
    assert len(losses) == 12
