"""A step with several optimizers (training/optimizer_set.py), measured as each of them saw it.

A GAN's step_fn runs D's backward and D's step, then G's backward (which adds to D's gradients
too) and G's step. The probe (training/probe.py) hooks every member's step, and each member's
step is where its own parameters' numbers are taken:
- their gradient norms: the probe's last measurement before that member's step (its pre-step
  hook, after the probe's usual checks there), kept for the step's record although a later
  backward measures the parameters again: D's recorded norms are the gradients D stepped with,
  not those plus G's loss; a parameter in no optimizer keeps the step's last measurement;
- the learning rates of its groups, at its pre-step: each the rate its update used;
- the weights before the update (their norms, and the sample of them an update ratio needs)
  and which second moments are empty, for every parameter at the step's first optimizer step:
  until its own optimizer steps, nothing but that step changes a parameter (members hold
  disjoint parameters), so each parameter's update ratio is its own optimizer's update.

`outside_optimizer` also finds the parameters that no optimizer given holds: on the Recorder's
first steps, those that got a gradient and moved anyway say that an optimizer the Recorder was
not told about trains them (record/health.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ckptlab.training.first_update import empty_flags
from ckptlab.training.hand_update import group_lrs


class MemberSteps:
    """Where each member of an OptimizerSet sits: its parameters (indices into the probe's
    `params`) and its groups (a slice of the set's `param_groups`)."""

    def __init__(self, optimizers, params: Sequence[torch.Tensor]):
        index = {id(p): i for i, p in enumerate(params)}
        self._params: dict[int, list[int]] = {}
        self._groups: dict[int, tuple[int, int]] = {}
        start = 0
        for m in optimizers.members:
            owned = [index[id(p)] for g in m.param_groups for p in g["params"] if id(p) in index]
            self._params[id(m)] = owned
            self._groups[id(m)] = (start, start + len(m.param_groups))
            start += len(m.param_groups)

    def pre_step(self, probe, member) -> None:
        """`member` is about to step (the probe has measured what its checks call for)."""
        norms = probe._grad_norms
        if norms is not None:  # its parameters' norms, as this step finds them
            at = {i: k for k, i in enumerate(probe._grad_idx)}
            for i in self._params.get(id(member), ()):
                k = at.get(i)
                if k is not None:
                    probe._pinned[i] = (norms[k], probe._nonfinite.get(i))
        lrs = probe._lr if probe._lr is not None else group_lrs(probe.optimizer)
        first, stop = self._groups.get(id(member), (0, 0))
        lrs[first:stop] = group_lrs(member)
        probe._lr = lrs
        if probe._measure_update:
            if probe._before is None:  # (the step's first optimizer step: see the module docstring)
                probe._take_before()
                probe._empty = empty_flags(probe.optimizer, probe.params)
        elif probe._bad_grads and not probe.world.distributed and probe._before_norms is None:
            probe._before_norms = probe._weight_norms()


def pinned_norms(probe, idx: list[int], norms: torch.Tensor | None) -> tuple[list[int], torch.Tensor | None]:
    """The step's gradient norms (`idx`, `norms`: the last measurement) with each member's
    parameters' as its own step found them (`probe._pinned`), and their non-finite counts."""
    by_index = dict(zip(idx, norms.unbind() if norms is not None else []))
    for i, (norm, count) in probe._pinned.items():
        by_index[i] = norm
        if count is None:
            probe._nonfinite.pop(i, None)
        else:
            probe._nonfinite[i] = count
    idx = sorted(by_index)
    return idx, probe._stack([by_index[i] for i in idx])


def outside_optimizer(optimizer, params: Sequence[torch.Tensor]) -> list[int]:
    """The parameters that can train (requires_grad) but no group of `optimizer` holds."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return [i for i, p in enumerate(params) if p.requires_grad and id(p) not in held]
