"""The gradients of the step that starts at a checkpoint, by replaying that one step.

    grads = checkpoint_gradients(run, 500)   # {parameter name: gradient}, before clipping

A checkpoint holds weights, not gradients (they are zeroed between steps), so the gradient
"at" checkpoint k is the one step k computes from it: replay loads checkpoint k, runs step k
with its recorded batch through the recorded step_fn, and keeps each parameter's gradient as
it is when backward finishes accumulating it -- before the user's clipping, the same point
where the Recorder measures grad norms (training/probe.py). This imports and runs the run's recorded
build_fn/step_fn, like `ckptlab replay`.
"""

from __future__ import annotations

import functools

import torch

from ckptlab.replayer.driver import Replayer
from ckptlab.run.reader import Run
from ckptlab.training.probe import named_parameters
from ckptlab.training.state import apply_env, capture_env


def checkpoint_gradients(run: Run, step: int, *, replayer: Replayer | None = None) -> dict[str, torch.Tensor]:
    """{name: gradient of step `step`} for every parameter that got one (CPU copies)."""
    saved = capture_env()  # loading a checkpoint applies its recorded thread count, flags, dtype
    r = replayer or Replayer(run)
    t = r.build()
    grads: dict[str, torch.Tensor] = {}
    handles = []
    try:
        r.load_checkpoint(t, step)
        for name, p in named_parameters(t.model):
            if p.requires_grad:
                keep = functools.partial(_keep_grad, grads, name)
                handles.append(p.register_post_accumulate_grad_hook(keep))
        r.run_step(t, r.batch(step), measure_update=False)
    finally:
        for h in handles:
            h.remove()
        r.close(t)
        apply_env(saved)
    return grads


def _keep_grad(grads: dict[str, torch.Tensor], name: str, p: torch.Tensor) -> None:
    assert p.grad is not None  # the hook runs once the step's gradient is in .grad
    grads[name] = p.grad.detach().to("cpu", copy=True)
