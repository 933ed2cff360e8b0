"""FSDP2 in a fold (turns.py): where the recorded ranks' shards lie in a process's shard, the
rows of the ranks whose turns step no optimizer, and the model's FSDP2 modules."""

from __future__ import annotations

import numpy as np
import torch


def fsdp_modules(model) -> list:
    """The FSDP2 modules (`fully_shard`) in `model`."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # (a torch without FSDP2)
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def recorded_shards(
    param, grad: torch.Tensor, world: int, procs: int, proc: int
) -> list[tuple[int | None, torch.Tensor]]:
    """The recorded ranks' shards within `grad`, process `proc`'s shard (of `procs`) of
    `param`'s gradient, as (recorded rank, view): FSDP2 splits a dimension of n into chunks of
    ceil(n / ranks), as torch.chunk does. [(None, grad)] for a parameter that is not sharded
    (every recorded rank held it whole)."""
    from torch.distributed.tensor import Shard

    shard = next((p for p in getattr(param, "placements", ()) if isinstance(p, Shard)), None)
    if shard is None:
        return [(None, grad)]
    d = shard.dim
    n = param.shape[d]
    start = min(proc * -(-n // procs), n)
    stop = start + grad.shape[d]
    step = -(-n // world)
    cuts = [start, *(b for b in range(step, n, step) if start < b < stop), stop]
    return [(a // step, grad.narrow(d, a - start, b - a)) for a, b in zip(cuts, cuts[1:]) if b > a]


def loss_only(other: np.ndarray, lead: np.ndarray) -> np.ndarray:
    """Another rank's row in a sharded fold: its turn's loss, and no part of the gradients,
    weights or updates (the leads' shards add up to them whole)."""
    out = np.zeros_like(lead)
    out[[0, 2]] = other[[0, 2]]  # (loss, has_loss)
    out[1] = lead[1]  # (has_update)
    return out
