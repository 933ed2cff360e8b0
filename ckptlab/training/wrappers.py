"""The user's model, torch optimizer and LR scheduler inside the wrappers that frameworks hand
their users.

`accelerator.prepare` returns an `AcceleratedOptimizer` (and an `AcceleratedScheduler`), Lightning
hands `training_step` a `LightningOptimizer`, `fabric.setup` returns a `_FabricOptimizer`: objects
that step the user's optimizer (accelerate's skips the step while it accumulates gradients, and
goes through its GradScaler) but are not it.
A user records with the object they hold, and their `step_fn` keeps receiving it; where ckptlab
needs torch's own object (its step hooks, its state dict, its parameter groups) it asks here.

Wrappers are recognised by the attributes their frameworks document, without importing them:
`._optimizer` (Lightning, Fabric) or `.optimizer` (accelerate, DeepSpeed) holding an object with
`param_groups`; `.scheduler` (accelerate; Lightning's scheduler config) holding an object with
`state_dict` and `step`. An optimizer that is one in its own right (it has torch's step hooks
of its own, e.g. a Lookahead built on `torch.optim.Optimizer` around a base optimizer) and a
torch LR scheduler are never unwrapped: their own state is part of the training state.

Models likewise (`unwrap`): torch.compile's `OptimizedModule` (`._orig_mod`), DDP,
DataParallel and DeepSpeed's engine (`.module`), FSDP1's `FullyShardedDataParallel`
(`._fsdp_wrapped_module`; units nested inside are left out of names by `own_name`), Lightning
Fabric's `_FabricModule` (`._forward_module`, what its
forward runs: the model, DDP around it, or the compiled model; `._original_module`, the model
as the user passed it to `fabric.setup`), told apart by class name, in any combination (Fabric
2.6 sets a compiled model up under DDP as a `_FabricModule` around the compiled DDP around the
model; a user may compile Fabric's module). Every name ckptlab gives a parameter, module or
tensor of the model is the user's model's own, with no
wrapper's prefix (`transformer.h.0.attn.qkv.weight`, never `_forward_module.module.`...): the
probe's health records, the manifest's parameter list, checkpoints (so `ckptlab diff RUN@S`),
replay's blame and the exports all name them through `unwrap`.

A pipeline stage's schedule (torch.distributed.pipelining's ScheduleGPipe or Schedule1F1B, given
as the model: step_fn runs the step through it) holds the module that this rank trains, its
stage's `submod` (`torch_module`): the one ckptlab measures, checkpoints and names.
"""

from __future__ import annotations

from typing import Any

import torch

_DEPTH = 4  # wrappers inside wrappers (a DeepSpeed optimizer inside accelerate's)
# Modules: Fabric's module around a compiled DDP around the model is 3 deep; 8 leaves room.
_MODULE_DEPTH = 8
_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
FSDP1_WRAPPED = "_fsdp_wrapped_module"  # FSDP1's attribute for the module it wraps, a component of inner names


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


def torch_module(model: Any) -> torch.nn.Module:
    """The module that `model` is, or that the pipeline schedule given as the model runs (its
    stage's `submod`: training/pipeline.py)."""
    stage = stage_of(model) if not isinstance(model, torch.nn.Module) else None
    return stage.submod if stage is not None else model


# Single-stage pipeline schedules' base class (ScheduleGPipe, Schedule1F1B), by name.
PIPELINE_SINGLE = "torch.distributed.pipelining.schedules.PipelineScheduleSingle"


def stage_of(schedule: Any) -> Any:
    """The PipelineStage that a single-stage pipeline schedule runs (None for anything else)."""
    if not any(f"{c.__module__}.{c.__qualname__}" == PIPELINE_SINGLE for c in type(schedule).__mro__):
        return None
    return getattr(schedule, "_stage", None)


def _own_hooks(optimizer: Any) -> bool:
    """An optimizer in its own right: `torch.optim.Optimizer.__init__` gave it its hook tables
    (accelerate's wrapper subclasses Optimizer without calling it)."""
    return "_optimizer_step_pre_hooks" in getattr(optimizer, "__dict__", {})


def _inner(obj: Any, name: str, needs: tuple[str, ...]) -> Any:
    inner = getattr(obj, name, None) if obj is not None else None
    if inner is not None and inner is not obj and all(hasattr(inner, n) for n in needs):
        return inner
    return None


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside torch.compile / DDP / DataParallel / Fabric wrappers: the one
    whose names carry no wrapper's prefix."""
    for _ in range(_MODULE_DEPTH):
        inner = wrapped_module(model, running=False)
        if inner is None:
            break
        model = inner
    return model


def module_chain(model: torch.nn.Module) -> list[torch.nn.Module]:
    """`model` and the modules its forward runs through, outermost first (a Fabric module's
    `_forward_module` side: DDP, a compiled model), down to the user's module."""
    chain = [model]
    for _ in range(_MODULE_DEPTH):
        inner = wrapped_module(chain[-1], running=True)
        if inner is None:
            break
        chain.append(inner)
    return chain


def wrapped_module(model: Any, *, running: bool) -> torch.nn.Module | None:
    """The module a wrapper holds (None when `model` is no wrapper). Fabric's `_FabricModule`
    holds two: the one its forward runs (`running`: `_forward_module`) and the user's own
    (`_original_module`; the same object when nothing wraps the model in between)."""
    kind = type(model).__name__
    if kind == "OptimizedModule":
        attrs: tuple[str, ...] = ("_orig_mod",)
    elif kind in ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine"):
        attrs = ("module",)
    elif kind == "_FabricModule":
        attrs = ("_forward_module", "_original_module") if running else ("_original_module", "_forward_module")
    elif kind == "FullyShardedDataParallel":  # FSDP1 (FSDP2's fully_shard changes the model's class instead)
        attrs = (FSDP1_WRAPPED,)
    else:
        return None
    for attr in attrs:
        inner = getattr(model, attr, None)
        if isinstance(inner, torch.nn.Module) and inner is not model:
            return inner
    return None


def own_name(name: str) -> str:
    """A parameter's or module's name inside `unwrap(model)` without the components of the
    wrappers nested in it (FSDP1 units wrapped around submodules: `h.0._fsdp_wrapped_module.mlp`)."""
    if FSDP1_WRAPPED not in name:
        return name
    return ".".join(part for part in name.split(".") if part != FSDP1_WRAPPED)
