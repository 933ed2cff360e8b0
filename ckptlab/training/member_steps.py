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

This runs at every optimizer step and every step's end, so its Python work is per member, not
per parameter: a member's step keeps a reference to the measurement it found (the probe's
index list, norms vector and non-finite counts: each measurement makes new ones), and the
step's end does nothing when every member found the last one (one backward before all the
optimizer steps, as Muon beside AdamW steps), else takes each earlier one's values for its
member's parameters with one `torch.where` over the norms vector (docs/performance.md: 600
parameter tensors, one backward, 2 SGD steps).

`outside_optimizer` also finds the parameters that no optimizer given holds: on the Recorder's
first steps, those that got a gradient and moved anyway say that an optimizer the Recorder was
not told about trains them (record/health.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ckptlab.training import zero
from ckptlab.training.first_update import empty_flags
from ckptlab.training.hand_update import group_lrs
from ckptlab.training.update_before import take_before, weight_norms

# A measurement as a member's step found it: the probe's (_grad_idx, _grad_norms, _nonfinite).
Seen = tuple[list[int], torch.Tensor, dict[int, int]]


class MemberSteps:
    """Where each member of an OptimizerSet sits: its parameters (indices into the probe's
    `params`) and its groups (a slice of the set's `param_groups`); and in the running step,
    the measurements each member's steps found (`reset` at the step's begin)."""

    def __init__(self, optimizers, params: Sequence[torch.Tensor]):
        index = {id(p): i for i, p in enumerate(params)}
        self._count = len(params)
        self._groups: dict[int, tuple[int, int]] = {}
        self._owned: dict[int, np.ndarray] = {}  # id(member) -> bool[P]: the parameters it holds
        self._masks: dict[tuple[int, torch.device], torch.Tensor] = {}  # the same on a device, made once
        for m, (_, first, stop) in zip(optimizers.members, optimizers.spans()):
            owned = np.zeros(self._count, dtype=bool)
            owned[[index[id(p)] for g in m.param_groups for p in g["params"] if id(p) in index]] = True
            self._owned[id(m)], self._groups[id(m)] = owned, (first, stop)
        # id(member) -> the measurements its steps found this step, in order (one, unless it
        # stepped again after a measurement that missed some parameter's gradient)
        self._seen: dict[int, list[Seen]] = {}

    def reset(self) -> None:
        """A step begins: no member has stepped."""
        self._seen = {}

    def pre_step(self, probe, member) -> None:
        """`member` is about to step (the probe has measured what its checks call for)."""
        norms = probe._grad_norms
        if norms is not None:  # its parameters' norms are this measurement's (a reference, not a copy)
            seen = self._seen.get(id(member))
            found = (probe._grad_idx, norms, probe._nonfinite)
            if seen is None or len(found[0]) == self._count:  # (every parameter's gradient: it alone counts)
                self._seen[id(member)] = [found]
            elif seen[-1][1] is not norms:  # (a parameter missing here keeps an earlier step's norm)
                seen.append(found)
        lrs = probe._lr if probe._lr is not None else group_lrs(probe.optimizer)
        first, stop = self._groups.get(id(member), (0, 0))
        lrs[first:stop] = group_lrs(member)
        probe._lr = lrs
        if probe._measure_update:
            if probe._before is None:  # (the step's first optimizer step: see the module docstring)
                take_before(probe)
                probe._empty = empty_flags(probe.optimizer, probe.params)
        elif probe._bad_grads and not probe.world.distributed and probe._before_norms is None:
            probe._before_norms = weight_norms(probe)

    def own_norms(self, probe, idx: list[int], norms: torch.Tensor | None) -> tuple[list[int], torch.Tensor | None]:
        """The step's gradient norms (`idx`, `norms`: the last measurement) with each member's
        parameters' as its own step found them, and their non-finite counts (`probe._nonfinite`)."""
        earlier = [(key, seen) for key, seen in self._seen.items() if len(seen) > 1 or seen[0][1] is not norms]
        if not earlier or norms is None:  # (a step's first measurement comes before any optimizer step)
            return idx, norms
        out, present = self._dense(idx, norms)
        nonfinite = dict(probe._nonfinite)  # (a copy: the members' references keep what they found)
        for key, seen in earlier:
            for their_idx, theirs, counts in seen:
                there_norms, there = self._dense(their_idx, theirs)
                take = self._owned[key] if there is None else self._owned[key] & there
                mask = self._mask(key, out.device) if there is None else torch.from_numpy(take).to(out.device)
                out = torch.where(mask, there_norms, out)
                if present is not None:
                    present |= take
                _take_counts(nonfinite, take, counts)
        probe._nonfinite = nonfinite
        if present is None:  # every parameter has a gradient
            return idx, out
        at = np.flatnonzero(present)
        return at.tolist(), out.index_select(0, torch.from_numpy(at).to(out.device))

    def _dense(self, idx: list[int], norms: torch.Tensor) -> tuple[torch.Tensor, np.ndarray | None]:
        """A measurement as one norm per parameter (0 where it had no gradient) and where it
        had one (None: everywhere, and the norms are the measurement's own vector)."""
        if len(idx) == self._count:
            return norms, None
        at = np.asarray(idx, dtype=np.int64)
        present = np.zeros(self._count, dtype=bool)
        present[at] = True
        dense = norms.new_zeros(self._count).index_copy_(0, torch.from_numpy(at).to(norms.device), norms)
        return dense, present

    def _mask(self, key: int, device: torch.device) -> torch.Tensor:
        mask = self._masks.get((key, device))
        if mask is None:
            mask = self._masks[(key, device)] = torch.from_numpy(self._owned[key]).to(device)
        return mask


def _take_counts(nonfinite: dict[int, int], take: np.ndarray, counts: dict[int, int]) -> None:
    """The non-finite counts of the parameters `take` marks as an earlier measurement counted
    them (`counts`): both dicts hold only the non-finite ones, usually none."""
    for i in [i for i in nonfinite if take[i]]:
        del nonfinite[i]
    nonfinite.update((i, c) for i, c in counts.items() if take[i])


def outside_optimizer(optimizer, params: Sequence[torch.Tensor]) -> list[int]:
    """The parameters that can train (requires_grad) but no group of `optimizer` holds (a ZeRO
    optimizer's torch optimizer holds flat partitions of the parameters it trains: training/zero.py)."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return [i for i, p in enumerate(params) if p.requires_grad and id(p) not in held and not zero.managed(p)]
