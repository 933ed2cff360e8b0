"""The update-ratio sample: which elements of each weight the probe keeps from before an update,
so that ||w_after - w_before|| costs a small copy instead of the whole model's ("sampled");
"exact" copies every parameter. Record and replay take the same sample (bit-identical)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# The update-ratio sample: at most this many elements per tensor, and in all at most this share
# of the parameter bytes (a small model gets fewer per tensor). Against the exact ratio, 4096
# elements per matrix gave a median error of 0.7% (max 2.2%) per tensor on an 8M-parameter
# MLP, 512 gave 1-3% (max 5%): docs/performance.md, tests/training/test_probe.py. ||w|| is exact.
UPDATE_SAMPLE = 4096
MEMORY_SHARE = 0.01
UPDATE_MODES = ("sampled", "exact")


@dataclass(frozen=True)
class SamplePlan:
    """Elements offset, offset+stride, ... (count of them) of a flattened tensor; `scale`
    turns the sample's sum of squares into an estimate of the whole tensor's."""

    offset: int
    stride: int
    count: int
    scale: float


def sample_plans(numels: list[int], itemsizes: list[int]) -> list[SamplePlan]:
    """A fixed strided sample per tensor, the same on every call (record and replay compare
    bit for bit): at most UPDATE_SAMPLE elements, halved until all samples together hold at
    most MEMORY_SHARE of the parameter bytes (never fewer than 64 per tensor). The stride is
    a prime, so a sample of a matrix walks across its columns instead of down one of them."""
    budget = MEMORY_SHARE * sum(n * s for n, s in zip(numels, itemsizes))
    k = UPDATE_SAMPLE
    while k > 64 and sum(min(n, k) * s for n, s in zip(numels, itemsizes)) > budget:
        k //= 2
    rng = np.random.default_rng(0)
    plans = []
    for n in numels:
        count = min(n, k)
        stride = _prime_at_most(max(n // count, 1)) if count < n else 1
        offset = int(rng.integers(0, n - (count - 1) * stride)) if n else 0
        plans.append(SamplePlan(offset, stride, count, n / count if count else 0.0))
    return plans


def take_sample(w: torch.Tensor, plan: SamplePlan) -> torch.Tensor:
    flat = w.reshape(-1)  # a view for a contiguous parameter
    return flat[plan.offset : plan.offset + (plan.count - 1) * plan.stride + 1 : plan.stride]


def _prime_at_most(n: int) -> int:
    """The largest prime <= n (1 for n < 2)."""
    for c in range(n, 1, -1):
        if all(c % d for d in range(2, int(c**0.5) + 1)):
            return c
    return 1


def update_scales(mode: str, plans: list | None, n: int) -> np.ndarray:
    """What turns the squared update norm of each sample into the whole tensor's (`mode`:
    "exact" or "sampled"; `plans`: the sample's, from `sample_plans`)."""
    if mode == "exact":
        return np.ones(n)
    assert plans is not None, "made with the sample"
    return np.array([plan.scale for plan in plans], dtype=np.float64)
