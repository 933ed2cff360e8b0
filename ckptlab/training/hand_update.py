"""A loop without an optimizer object: the weights are updated by hand in `step_fn`
(`p.data.add_(p.grad, alpha=-lr)`), as in the classic word-language-model example.

    model = Net()
    rec = ckptlab.Recorder("runs/lm", model, None, lr=20.0, step_fn=step, build_fn=build)
    update = rec.optimizer                    # a HandUpdate: step_fn gets it as `optimizer`

    def step(model, update, batch):           # module level
        ...
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-update.lr)   # the learning rate from the HandUpdate
        model.zero_grad()
        return loss

    rec.optimizer.lr /= 4.0                   # the loop anneals it between steps

`HandUpdate` is a `torch.optim.Optimizer` whose `step()` does nothing (the user's code updates
the weights); it exists to hold the learning rate in `param_groups`, where a torch optimizer
keeps it: checkpoints carry it, replay restores it, the probe records it with every step, and
an LR scheduler can drive it. A learning rate that is not given is unknown (`lr=None`):
recorded as NaN ("not known"), and `update.lr` raises, so a loop cannot read a made-up value.

The probe (training/probe.py) measures a HandUpdate's step differently from a torch optimizer's,
whose hooks say when the update happens: the weights before it are taken when the step begins,
the update when it ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ckptlab.errors import RecordError


class HandUpdate(torch.optim.Optimizer):
    """Holds the learning rate of a hand-written update; `step()` does nothing.

    Args:
        params: the parameters the loop updates (e.g. `model.parameters()`).
        lr: the learning rate the loop uses, or None when ckptlab is not told it (unknown).
    """

    def __init__(self, params: Iterable, lr: float | None = None):
        super().__init__(params, {"lr": _checked(lr)})
        # The loop updates at every step, though `step()` is never called: an LR scheduler
        # stepped after it is in the right order (torch warns when it sees no step first).
        self._opt_called = True

    @property
    def lr(self) -> float:
        """The learning rate of the first parameter group: the one the loop must read, so that
        replay (which restores it from the record) updates with the same value."""
        lr = self.param_groups[0]["lr"]
        if lr is None:
            raise RecordError(
                "the learning rate of this HandUpdate is unknown",
                hint="give it when recording: Recorder(..., optimizer=None, lr=0.1), or set update.lr = 0.1",
            )
        return float(lr)

    @lr.setter
    def lr(self, value: float) -> None:
        for group in self.param_groups:
            group["lr"] = _checked(value)

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """Nothing to do: the loop's own code updates the weights. Runs `closure` if given."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()


def is_hand_update(optimizer) -> bool:
    return isinstance(optimizer, HandUpdate)


def group_lrs(optimizer) -> list[float]:
    """Each parameter group's learning rate as a float; NaN where it is unknown (None)."""
    return [float("nan") if g.get("lr") is None else float(g["lr"]) for g in optimizer.param_groups]


def _checked(lr) -> float | None:
    if lr is None:
        return None
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        raise RecordError(f"lr must be a number (or None: unknown), not {type(lr).__name__}")
    return float(lr)
