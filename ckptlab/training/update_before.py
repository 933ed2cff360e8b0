"""The weights before a step's update, as the probe keeps them to measure the update: their
norms, and a copy of every parameter ("exact") or the same fixed strided sample of each
("sampled": training/update_sample.py). Shared by the probe (training/probe.py) and its
several-optimizer bookkeeping (training/member_steps.py), which takes them at the step's first
optimizer step.

    take_before(probe)         # probe._before = (norms, copies or samples)
    norms = weight_norms(probe)
"""

from __future__ import annotations

import torch

from ckptlab.training import zero
from ckptlab.training.norms import batched_norms
from ckptlab.training.update_sample import sample_plans, take_sample
from ckptlab.training.world import local


def take_before(probe) -> None:
    """The weights before the update: their norms, and their sample (or copy)."""
    with torch.no_grad():
        weights = held_weights(probe)
        probe._before = (batched_norms(weights), _take(probe, weights))


def weight_norms(probe) -> list[torch.Tensor]:
    with torch.no_grad():
        return batched_norms(held_weights(probe))


def held_weights(probe) -> list[torch.Tensor]:
    """The weights as this rank holds them: a DTensor's shard, ZeRO's part of the fp32 masters."""
    if probe._engine is not None:
        return zero.local_weights(probe._engine, probe.params)
    return [local(p.detach()) for p in probe.params]


def _take(probe, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """What ||w_after - w_before|| needs of the weights before the update: a copy of every
    parameter ("exact"), or the same fixed strided sample of each ("sampled")."""
    if probe.update_mode == "exact":
        return [w.clone() for w in weights]
    if probe._plans is None or len(probe._plans) != len(weights):
        probe._plans = sample_plans([w.numel() for w in weights], [w.element_size() for w in weights])
    return [take_sample(w, plan).clone() for w, plan in zip(weights, probe._plans)]
