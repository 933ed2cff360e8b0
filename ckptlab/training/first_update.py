"""An optimizer's first update with an empty second moment, flagged on the device.

    flags = empty_flags(optimizer, params)   # the probe's step pre-hook, on a measured step

Adam divides each gradient by the root of its running mean square (`exp_avg_sq`). A parameter
whose every gradient so far was exactly zero (a block switched on late, a gated branch) has an
`exp_avg_sq` that is all zero; one that never had a gradient has no state at all. Its first
real gradient then moves every element by about the learning rate at once, whatever the
gradient's size: a tiny-initialized weight moves by many times its norm.

The flags say, before the update, which parameters are in that state. They are computed on
the device and copied to the host with the rest of the step's health (training/probe.py): no
sync of their own. With the step's gradient and update ratio, analysis/anomalies.py
(`first_update`) tells whether such an update exploded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ckptlab.training.norms import on_one_device
from ckptlab.training.world import is_sharded

# The flag of a parameter whose second moment is empty: an all-zero exp_avg_sq, or no state
# while other parameters have one (made by their first update); 0: not empty.
ALL_ZERO, NO_STATE = 1.0, 2.0
HOW = {ALL_ZERO: "exp_avg_sq all zero", NO_STATE: "no optimizer state"}


def empty_flags(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """float32[P] on the device: each parameter's flag (ALL_ZERO, NO_STATE, else 0) as the
    update about to run finds the optimizer's state. None for an optimizer that keeps no
    `exp_avg_sq` (SGD), before the first update of all (every state is empty then), and for
    sharded state (a DTensor shard says nothing of the whole). Queues device work; reads
    nothing."""
    states = [optimizer.state.get(p) for p in params]
    moments = [st.get("exp_avg_sq") if st else None for st in states]
    present = [v for v in moments if isinstance(v, torch.Tensor)]
    if not present or any(is_sharded(v) for v in present):
        return None
    device = present[0].device
    zero, no_state = (torch.full((), x, dtype=torch.float32, device=device) for x in (0.0, NO_STATE))  # (no copy)
    flags = [no_state if not st and p.requires_grad else zero for p, st in zip(params, states)]
    held = [(i, v.detach()) for i, v in enumerate(moments) if isinstance(v, torch.Tensor) and v.numel()]
    if held:  # exp_avg_sq >= 0: all zero exactly when its largest element is 0 (one fused max)
        peaks = on_one_device([m.float() for m in torch._foreach_max([v for _, v in held])])
        for (i, _), hit in zip(held, (torch.stack(peaks) == 0).float().mul_(ALL_ZERO).unbind()):
            flags[i] = hit
    return torch.stack(on_one_device(flags))
