"""A loop that clips its gradients by hand on one step only (a spike guard written out), long
after the probe learned that the loop leaves its gradients alone: tests/training/test_probe_learned.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests import fault_models as fm

CLIP_AT = 10  # a checkpoint step (ckpt_every=10): a replay from it starts on the clipped step


def build():
    return fm.build_sgd_mlp()


def batch(step: int):
    x, y = fm._xy(step)
    return x, y, torch.tensor(step)


def step(model, opt, batch):
    x, y, at = batch
    loss = F.mse_loss(model(x), y)
    loss.backward()
    if int(at) == CLIP_AT:  # by hand, in place, after the backward: no torch clipping call
        for p in model.parameters():
            p.grad.mul_(0.01)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss
