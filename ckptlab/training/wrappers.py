"""The torch optimizer and LR scheduler inside the wrappers that frameworks hand their users.

`accelerator.prepare` returns an `AcceleratedOptimizer` (and an `AcceleratedScheduler`), Lightning
hands `training_step` a `LightningOptimizer`: objects that step the user's optimizer (accelerate's
skips the step while it accumulates gradients, and goes through its GradScaler) but are not it.
A user records with the object they hold, and their `step_fn` keeps receiving it; where ckptlab
needs torch's own object (its step hooks, its state dict, its parameter groups) it asks here.

Wrappers are recognised by the attributes their frameworks document, without importing them:
`._optimizer` (Lightning) or `.optimizer` (accelerate, DeepSpeed) holding an object with
`param_groups`; `.scheduler` (accelerate; Lightning's scheduler config) holding an object with
`state_dict` and `step`. An optimizer that is one in its own right (it has torch's step hooks
of its own, e.g. a Lookahead built on `torch.optim.Optimizer` around a base optimizer) and a
torch LR scheduler are never unwrapped: their own state is part of the training state.
"""

from __future__ import annotations

from typing import Any

import torch

_DEPTH = 4  # wrappers inside wrappers (a DeepSpeed optimizer inside accelerate's)
_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer that `optimizer` is or wraps (None stays None)."""
    for _ in range(_DEPTH):
        inner = _inner(optimizer, "_optimizer", ("param_groups",))  # Lightning's LightningOptimizer
        if inner is None and not _own_hooks(optimizer):
            inner = _inner(optimizer, "optimizer", ("param_groups",))
        if inner is None:
            break
        optimizer = inner
    return optimizer


def torch_scheduler(scheduler: Any) -> Any:
    """The LR scheduler that `scheduler` is or wraps (None stays None)."""
    for _ in range(_DEPTH):
        inner = None if isinstance(scheduler, _SCHEDULERS) else _inner(scheduler, "scheduler", ("state_dict", "step"))
        if inner is None:
            break
        scheduler = inner
    return scheduler


def _own_hooks(optimizer: Any) -> bool:
    """An optimizer in its own right: `torch.optim.Optimizer.__init__` gave it its hook tables
    (accelerate's wrapper subclasses Optimizer without calling it)."""
    return "_optimizer_step_pre_hooks" in getattr(optimizer, "__dict__", {})


def _inner(obj: Any, name: str, needs: tuple[str, ...]) -> Any:
    inner = getattr(obj, name, None) if obj is not None else None
    if inner is not None and inner is not obj and all(hasattr(inner, n) for n in needs):
        return inner
    return None
