"""The torch optimizer and LR scheduler inside the wrappers that frameworks hand their users.

`accelerator.prepare` returns an `AcceleratedOptimizer` (and an `AcceleratedScheduler`), Lightning
hands `training_step` a `LightningOptimizer`: objects that step the user's optimizer (accelerate's
skips the step while it accumulates gradients, and goes through its GradScaler) but are not it.
A user records with the object they hold, and their `step_fn` keeps receiving it; where ckptlab
needs torch's own object (its step hooks, its state dict, its parameter groups) it asks here.

Wrappers are recognised by the attributes their frameworks document, without importing them:
`.optimizer` (accelerate, DeepSpeed) or `._optimizer` (Lightning) holding an object with
`param_groups`; `.scheduler` (accelerate; Lightning's scheduler config) holding an object with
`state_dict` and `step`. A torch optimizer or scheduler has neither and is returned as it is.
"""

from __future__ import annotations

from typing import Any

_DEPTH = 4  # wrappers inside wrappers (a DeepSpeed optimizer inside accelerate's)


def torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer that `optimizer` is or wraps (None stays None)."""
    for _ in range(_DEPTH):
        inner = _inner(optimizer, ("_optimizer", "optimizer"), ("param_groups",))
        if inner is None:
            break
        optimizer = inner
    return optimizer


def torch_scheduler(scheduler: Any) -> Any:
    """The LR scheduler that `scheduler` is or wraps (None stays None)."""
    for _ in range(_DEPTH):
        inner = _inner(scheduler, ("scheduler",), ("state_dict", "step"))
        if inner is None:
            break
        scheduler = inner
    return scheduler


def is_wrapped(optimizer: Any) -> bool:
    """`optimizer` is a framework's wrapper around a torch optimizer."""
    return optimizer is not None and torch_optimizer(optimizer) is not optimizer


def _inner(obj: Any, names: tuple[str, ...], needs: tuple[str, ...]) -> Any:
    if obj is None:
        return None
    for name in names:
        inner = getattr(obj, name, None)
        if inner is not None and inner is not obj and all(hasattr(inner, n) for n in needs):
            return inner
    return None
