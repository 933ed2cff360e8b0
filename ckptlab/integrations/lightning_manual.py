"""Replay of a Lightning step under manual optimization (`self.automatic_optimization = False`):
the module's own `training_step` drives its optimizers, as a GAN's does:

    def training_step(self, batch, batch_idx):
        opt_d, opt_g = self.optimizers()
        ...; opt_d.zero_grad(); self.manual_backward(loss_d); opt_d.step()
        ...; opt_g.zero_grad(); self.manual_backward(loss_g); opt_g.step()
        return loss_d + loss_g              # the step's loss, as ckptlab records it (or nothing: not known)

Replay has no Trainer. What training_step asks of it goes through the module's own seam for
running without one, `LightningModule._fabric` (the hook Lightning gives Fabric), held by
`ReplayedTrainer` for the step: `self.optimizers()` are the replayed optimizers, each in a
LightningOptimizer whose `step()` runs the torch optimizer's step with a closure that calls
`on_before_optimizer_step`, as the trainer's strategy and precision plugin do; and
`self.manual_backward(loss)` is `on_before_backward`, the module's `backward`, and
`on_after_backward`, as the strategy's backward. `self.lr_schedulers()` are the schedulers
`build(...)` made (the module steps them itself: the trainer never does under manual
optimization), `toggle_optimizer` sees the optimizers, and `self.log` goes nowhere. The step
runs under the precision's autocast, as the trainer's strategy runs it.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

from ckptlab.training.crash import call_through
from ckptlab.training.wrappers import torch_optimizer


class ReplayedTrainer:
    """What a module's manual-optimization training_step reaches of its trainer, in replay
    (see the module docstring): set as the module's `_fabric` while the step runs.
    `lightning_optimizer`: Lightning's LightningOptimizer class (of whichever of its two
    packages is installed)."""

    def __init__(self, module, optimizers: list, schedulers: list, lightning_optimizer: type):
        self.module = module
        self.optimizers = [torch_optimizer(o) for o in optimizers]  # (toggle_optimizer reads them)
        self.lr_scheduler_configs = [SimpleNamespace(scheduler=s) for s in schedulers]
        self.wrapped = []
        for opt in self.optimizers:
            lit = lightning_optimizer(opt)
            lit._strategy = self  # (its step() hands the torch optimizer to optimizer_step below)
            self.wrapped.append(lit)

    @property
    def lightning_module(self):
        return self.module

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """The strategy's and precision plugin's optimizer_step: the torch optimizer's step,
        whose closure runs the user's closure, then `on_before_optimizer_step`."""

        def wrapped():
            result = call_through(closure)  # (the user's code: its exceptions are its own)
            call_through(self.module.on_before_optimizer_step, optimizer)
            return result

        return call_through(optimizer.step, closure=wrapped, **kwargs)

    def backward(self, loss, *args, **kwargs) -> None:
        """`self.manual_backward(loss)`: the strategy's backward, hooks included. The module's
        own `backward` runs with no seam set (its default would come back here)."""
        m = self.module
        call_through(m.on_before_backward, loss)  # (the user's hooks: their exceptions are theirs)
        seam, m._fabric = m._fabric, None
        try:
            call_through(m.backward, loss, *args, **kwargs)
        finally:
            m._fabric = seam
        call_through(m.on_after_backward)

    def log_dict(self, metrics=None, **kwargs) -> None:
        """`self.log` in replay: nowhere (the record has what training logged)."""

    @contextlib.contextmanager
    def attached(self):
        m = self.module
        seam, opts = m._fabric, m._fabric_optimizers
        m._fabric, m._fabric_optimizers = self, self.wrapped
        try:
            yield
        finally:
            m._fabric, m._fabric_optimizers = seam, opts


def as_list(optimizer) -> list:
    """The optimizers a manual step was given (one, a list, or a dict), in order."""
    if isinstance(optimizer, dict):
        return list(optimizer.values())
    return list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
