"""A loss spike caused by one sample whose content looks normal: the static scan passes it,
the dynamic scan flags the step, and attribution by replay names the sample."""

import torch

import ckptlab
from ckptlab.analysis.dirty import scan
from ckptlab.replayer import attribute_rows
from tests import models

SPIKE_STEP, ROW = 60, 3


def batches(n=80, rows=8):
    g = torch.Generator().manual_seed(5)
    for s in range(n):
        x = torch.randn(rows, 8, generator=g)
        y = x[:, :1] * 0.5 + 0.1 * torch.randn(rows, 1, generator=g)
        if s == SPIKE_STEP:
            y[ROW] = -y[ROW].sign() * 2.5  # a wrong label of ordinary size: no field value stands out
        yield (x, y), [1000 * s + r for r in range(rows)]


def test_attribution_names_a_normal_looking_sample(run_dir):
    models.record_run(run_dir, models.build_mlp, models.step_mlp, batches(), ckpt_every=20, keep_last=5)
    run = ckptlab.open_run(run_dir)
    static_only = scan(run)
    assert not [f for f in static_only.flagged if f.row is not None and f.step == SPIKE_STEP]  # looks normal
    assert any(f.step == SPIKE_STEP and f.reason == "loss_spike" for f in static_only.flagged)

    report = scan(run, attribute=attribute_rows)
    named = [(f.step, f.row, f.sample_id) for f in report.flagged if f.reason == "attributed"]
    assert named == [(SPIKE_STEP, ROW, 1000 * SPIKE_STEP + ROW)]
    assert report.skip_ids == [1000 * SPIKE_STEP + ROW]
