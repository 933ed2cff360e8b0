"""Several optimizers, and their LR schedulers, as the one optimizer ckptlab measures and saves.

A GAN's step updates D with one optimizer and G with another; recent LLM trainers run Muon on
the matrices and AdamW on the rest. The user gives them as they hold them, a list or a dict:

    rec = ckptlab.Recorder(run, model, {"d": opt_d, "g": opt_g}, scheduler={"d": None, "g": sched_g}, ...)

    def step(model, optimizers, batch):       # step_fn gets them as given: the dict
        ...; optimizers["d"].step(); ...; optimizers["g"].step()

Everywhere ckptlab needs *the* optimizer (the probe's step hooks and learning rates, the
checkpoints, replay's learning rates and optimizer state) it holds an `OptimizerSet` of them:
`param_groups` is every member's groups in order (the same dict objects: setting a group's
`lr` sets the member's), `state` finds a parameter in its member's state, `state_dict()` is
keyed by the member's key (its index in a list, its key in a dict), step hooks go on every
member. A `SchedulerSet` does the same for the schedulers (one per optimizer, None where it
has none). A single optimizer stays itself: nothing here touches that path.

A member's key, its class and its groups are in the run's manifest (`describe`), so that a
learning rate or a parameter is named by its optimizer (`optimizer_key`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ckptlab.errors import RecordError
from ckptlab.training import zero
from ckptlab.training.wrappers import torch_optimizer, torch_scheduler

Key = int | str  # a member's index in the list it was given in, or its key in the dict


def given_several(obj) -> bool:
    """Several objects given as one: a list, a tuple or a dict."""
    return isinstance(obj, (list, tuple, dict))


def _entries(given) -> list[tuple[Key, Any]]:
    return list(given.items()) if isinstance(given, dict) else list(enumerate(given))


def key_text(key: Key | None) -> str:
    """How a member is named in a sentence: optimizer `g`, optimizer `1`."""
    return f"`{key}`"


class _Handles:
    """The step hooks registered on every member: removed together."""

    def __init__(self, handles: list):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class _States(Mapping):
    """`optimizer.state` over the members: a parameter's state in its member's."""

    def __init__(self, members: list):
        self._members = members

    def __getitem__(self, param):
        for m in self._members:
            if param in m.state:
                return m.state[param]
        raise KeyError(param)

    def __iter__(self) -> Iterator:
        for m in self._members:
            yield from m.state

    def __len__(self) -> int:
        return sum(len(m.state) for m in self._members)


class OptimizerSet:
    """The optimizers a user gave as a list or a dict (`given`, what step_fn receives), as one
    optimizer for ckptlab (the module docstring). `keys[i]` names `members[i]`, the torch
    optimizer inside what was given (training/wrappers.py)."""

    def __init__(self, given):
        entries = _entries(given)
        if not entries:
            raise RecordError("optimizer is an empty list: give the optimizers that step the weights")
        if isinstance(given, dict) and not all(isinstance(k, str) and k for k in given):
            raise RecordError("the keys of an optimizer dict must be non-empty strings (they name the optimizers)")
        self.given = given
        self.keys: list[Key] = [k for k, _ in entries]
        self.members: list = []
        for key, opt in entries:
            inner = torch_optimizer(opt)
            if not hasattr(inner, "param_groups"):
                raise RecordError(
                    f"optimizer {key_text(key)} is {type(opt).__name__}, not a torch.optim.Optimizer",
                    hint="every entry must be an optimizer that steps some of the weights",
                )
            self.members.append(inner)
        _check_disjoint(self.keys, self.members)

    @property
    def param_groups(self) -> list[dict]:
        return [g for m in self.members for g in m.param_groups]

    @property
    def state(self) -> _States:
        return _States(self.members)

    def spans(self) -> list[tuple[Key, int, int]]:
        """(key, first, stop) of each member's groups in `param_groups`."""
        out, start = [], 0
        for key, m in zip(self.keys, self.members):
            out.append((key, start, start + len(m.param_groups)))
            start += len(m.param_groups)
        return out

    def state_dict(self) -> dict:
        return {key: m.state_dict() for key, m in zip(self.keys, self.members)}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or sorted(map(str, state)) != sorted(map(str, self.keys)):
            held = list(state) if isinstance(state, dict) else "one optimizer"
            raise ValueError(f"the checkpoint holds the optimizers {held}, not {self.keys}")
        for key, m in zip(self.keys, self.members):
            m.load_state_dict(state[key])

    def register_step_pre_hook(self, hook) -> _Handles:
        return _Handles([m.register_step_pre_hook(hook) for m in self.members])

    def register_step_post_hook(self, hook) -> _Handles:
        return _Handles([m.register_step_post_hook(hook) for m in self.members])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for m in self.members:
            m.zero_grad(set_to_none=set_to_none)


def _check_disjoint(keys: list[Key], members: list) -> None:
    owner: dict[int, Key] = {}
    for key, m in zip(keys, members):
        for group in m.param_groups:
            for p in group["params"]:
                other = owner.setdefault(id(p), key)
                if other != key:
                    raise RecordError(
                        f"optimizers {key_text(other)} and {key_text(key)} hold the same parameter "
                        f"(shape {tuple(p.shape)}): each parameter must be stepped by one optimizer"
                    )


class SchedulerSet:
    """One LR scheduler per optimizer of an OptimizerSet (None where it has none), given in
    the same shape; `step()` steps each, the state is keyed as the optimizers'."""

    def __init__(self, given, optimizers: OptimizerSet):
        entries = _entries(given)
        keys = [k for k, _ in entries]
        if isinstance(given, dict) != isinstance(optimizers.given, dict):
            raise RecordError(
                f"scheduler= is a {type(given).__name__} and optimizer= a {type(optimizers.given).__name__}: "
                "give the schedulers in the optimizers' shape (None where one has none)"
            )
        if sorted(map(str, keys)) != sorted(map(str, optimizers.keys)):
            raise RecordError(
                f"scheduler= names {keys}, the optimizers are {optimizers.keys}: give one scheduler per "
                "optimizer, in the same shape (None where one has none)"
            )
        self.given = given
        self.entries = [(k, s) for k, s in entries if s is not None]  # (key, the scheduler as given)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def step(self) -> None:
        for _, s in self.entries:
            s.step()

    def state_dict(self) -> dict:
        return {key: torch_scheduler(s).state_dict() for key, s in self.entries}

    def load_state_dict(self, state: dict) -> None:
        for key, s in self.entries:
            if key not in state:
                raise ValueError(f"the checkpoint holds no LR scheduler for optimizer {key_text(key)}")
            torch_scheduler(s).load_state_dict(state[key])


def combined(optimizer, scheduler):
    """(optimizer, scheduler) as ckptlab holds them: an OptimizerSet and a SchedulerSet (or
    None) for optimizers given as a list or a dict; anything else as it is. Idempotent."""
    if isinstance(optimizer, OptimizerSet):
        return optimizer, scheduler
    if not given_several(optimizer):
        if given_several(scheduler):
            raise RecordError(
                f"scheduler= is a {type(scheduler).__name__}, but there is one optimizer: give its scheduler alone"
            )
        return optimizer, scheduler
    optimizers = OptimizerSet(optimizer)
    if scheduler is None or isinstance(scheduler, SchedulerSet):
        return optimizers, scheduler
    if not given_several(scheduler):
        raise RecordError(
            f"scheduler= is one {type(scheduler).__name__} for {len(optimizers.keys)} optimizers: give a "
            f"{type(optimizer).__name__} of them, one per optimizer (None where one has none)"
        )
    schedulers = SchedulerSet(scheduler, optimizers)
    return optimizers, schedulers if schedulers else None


def schedulers_of(scheduler) -> list[tuple[Key | None, Any]]:
    """(key, torch scheduler) of each scheduler ckptlab steps: (None, it) for one alone."""
    if scheduler is None:
        return []
    if isinstance(scheduler, SchedulerSet):
        return [(k, torch_scheduler(s)) for k, s in scheduler.entries]
    return [(None, torch_scheduler(scheduler))]


# --- what the manifest says of them ---------------------------------------------------------------


def describe(optimizer, params: list[torch.Tensor]) -> tuple[list[dict], list[int | None]]:
    """The manifest's `optimizers` ([{key, class, groups}]: key null for one optimizer given
    alone) and each parameter's group (its index in the steps' `lr` lists; None: in none)."""
    spans: list[tuple[Key | None, int, int]]
    if isinstance(optimizer, OptimizerSet):
        spans = list(optimizer.spans())
        members = optimizer.members
    else:
        inner = torch_optimizer(optimizer)
        spans = [(None, 0, len(inner.param_groups))]
        members = [inner]
    optimizers = [
        {"key": key, "class": type(m).__name__, "groups": list(range(first, stop))}
        for (key, first, stop), m in zip(spans, members)
    ]
    group_of: dict[int, int] = {}
    held = zero.model_groups(optimizer) or [g["params"] for g in torch_optimizer(optimizer).param_groups]
    for g, group in enumerate(held):
        for p in group:
            group_of.setdefault(id(p), g)
    return optimizers, [group_of.get(id(p)) for p in params]
