"""Measure one training step's health from hooks, so the user's `step_fn` needs no change.

    probe = StepProbe(model, optimizer)
    probe.begin(measure_update=True)
    loss = step_fn(model, optimizer, batch)
    health = probe.end(loss)          # loss, grad norms, lr, update ratios, ...
    probe.close()

Where each number is read, and why there:
- per-parameter gradient norms in `register_post_accumulate_grad_hook`: that is the gradient
  *before* the user's `clip_grad_norm_` (after clipping the global norm is always <= max_norm,
  which hides every explosion). With gradient accumulation the hook fires once per backward;
  the last firing holds the accumulated gradient, which is what we keep.
- learning rates and the pre-update weights in the optimizer's step pre-hook: the lr actually
  used by this update, and the weights it started from (for ||dw||/||w||, every K steps only,
  since it costs a copy of the parameters).
- a GradScaler's scale at `begin`: hook gradients are scaled; norms are divided by it.

The Recorder and replay use this same class, so replayed numbers compare bit for bit.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from ckptlab.errors import RecordError
from ckptlab.state import unwrap

NO_GRAD = -1.0  # param_grad_norm value for a parameter that got no gradient this step


@dataclass
class StepHealth:
    loss: float
    grad_norm: float  # global L2 norm over all parameters, before clipping, unscaled
    param_grad_norm: np.ndarray  # float32[P]; NO_GRAD where a parameter got no gradient
    nonfinite_grads: int  # non-finite gradient elements, all parameters
    param_nonfinite: np.ndarray | None  # int64[P], only when nonfinite_grads > 0
    lr: list[float]
    stepped: bool  # the optimizer's step ran (a GradScaler skips it on overflow)
    update_ratio: np.ndarray | None = None  # float32[P]: ||w_after - w_before|| / ||w_before||
    update_ratio_global: float | None = None  # the same over all parameters together
    weight_norm: np.ndarray | None = None  # float32[P], after the update
    grad_scale: float | None = None
    step_time: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def loss_finite(self) -> bool:
        return math.isfinite(self.loss)

    def scalars(self) -> dict:
        out = {
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "nonfinite_grads": self.nonfinite_grads,
            "lr": self.lr,
            "stepped": self.stepped,
            "step_time": self.step_time,
        }
        if self.grad_scale is not None:
            out["grad_scale"] = self.grad_scale
        if self.weight_norm is not None:
            out["nonfinite_weights"] = int((~np.isfinite(self.weight_norm)).sum())
        if self.update_ratio_global is not None:
            out["update_ratio_global"] = self.update_ratio_global
        return out

    def arrays(self) -> dict[str, np.ndarray]:
        out = {"param_grad_norm": self.param_grad_norm}
        for key in ("param_nonfinite", "update_ratio", "weight_norm"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


def loss_value(loss) -> float:
    """The float of what `step_fn` returned; a clear error for anything but a scalar."""
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise RecordError(f"step_fn returned a tensor of shape {tuple(loss.shape)}; return the scalar loss")
        return float(loss.detach().float().item())
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return float(loss)
    raise RecordError(f"step_fn must return the loss (a scalar tensor), got {type(loss).__name__}")


def named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters in a stable order, tied ones once (the order the run's arrays use)."""
    return list(unwrap(model).named_parameters())


class StepProbe:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler=None):
        named = named_parameters(model)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.optimizer = optimizer
        self.scaler = scaler
        self._active = False
        self._handles = [
            p.register_post_accumulate_grad_hook(partial(self._on_grad, i))
            for i, p in enumerate(self.params)
            if p.requires_grad
        ]
        self._handles.append(optimizer.register_step_pre_hook(self._on_pre_step))
        self._handles.append(optimizer.register_step_post_hook(self._on_post_step))
        self._reset(False)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _reset(self, measure_update: bool) -> None:
        self._norms: list[torch.Tensor | None] = [None] * len(self.params)
        self._nonfinite: dict[int, int] = {}
        self._lr: list[float] | None = None
        self._before: list[torch.Tensor] | None = None
        self._stepped = False
        self._measure_update = measure_update

    # --- hooks (cheap: one norm kernel per parameter per backward) --------------------------

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        if not self._active or p.grad is None:
            return
        g = p.grad
        if g.is_sparse:
            g = g.coalesce().values()
        norm = torch.linalg.vector_norm(g, dtype=torch.float32)
        self._norms[i] = norm
        # On the CPU the check is free; on a GPU it would sync per parameter, so there the
        # count waits for `end()` (and then sees the gradient after any clipping).
        if g.device.type == "cpu" and not torch.isfinite(norm):
            self._nonfinite[i] = int((~torch.isfinite(g)).sum())

    def _on_pre_step(self, optimizer, args, kwargs) -> None:
        if not self._active:
            return
        self._lr = [float(g["lr"]) for g in optimizer.param_groups]
        if self._measure_update:
            self._before = [p.detach().clone() for p in self.params]

    def _on_post_step(self, optimizer, args, kwargs) -> None:
        if self._active:
            self._stepped = True

    # --- one step -------------------------------------------------------------------------------

    def begin(self, *, measure_update: bool = False) -> None:
        self._reset(measure_update)
        self._scale = float(self.scaler.get_scale()) if self.scaler is not None and self.scaler.is_enabled() else None
        self._t0 = time.perf_counter()
        self._active = True

    def end(self, loss) -> StepHealth:
        value = loss_value(loss)  # syncs the device: step_time includes the work
        step_time = time.perf_counter() - self._t0
        self._active = False
        norms = self._param_grad_norms()
        finite = np.isfinite(norms)
        nonfinite = None
        if not finite.all():
            nonfinite = np.zeros(len(self.params), dtype=np.int64)
            for i in np.flatnonzero(~finite):
                nonfinite[i] = self._nonfinite.get(int(i), self._count_now(int(i)))
        present = norms[norms != NO_GRAD].astype(np.float64)
        grad_norm = float(np.sqrt(np.sum(present * present))) if present.size else float("nan")
        health = StepHealth(
            loss=value,
            grad_norm=grad_norm,
            param_grad_norm=norms,
            nonfinite_grads=int(nonfinite.sum()) if nonfinite is not None else 0,
            param_nonfinite=nonfinite,
            lr=self._lr if self._lr is not None else [float(g["lr"]) for g in self.optimizer.param_groups],
            stepped=self._stepped,
            grad_scale=self._scale,
            step_time=step_time,
        )
        if self._before is not None:
            health.update_ratio, health.weight_norm, health.update_ratio_global = self._update_stats()
        self._before = None
        return health

    def _param_grad_norms(self) -> np.ndarray:
        out = np.full(len(self.params), NO_GRAD, dtype=np.float32)
        idx = [i for i, n in enumerate(self._norms) if n is not None]
        # A gradient that arrived without the hook (e.g. assigned by hand): read it as it is now.
        for i, p in enumerate(self.params):
            if self._norms[i] is None and p.grad is not None:
                self._norms[i] = torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float32)
                idx.append(i)
        if idx:
            got = [self._norms[i] for i in idx]
            if len({t.device for t in got}) > 1:  # model spread over devices
                got = [t.to("cpu") for t in got]
            values = torch.stack(got).cpu().numpy()  # one device sync for all parameters
            if self._scale:
                values = values / np.float32(self._scale)
            out[idx] = values
        return out

    def _count_now(self, i: int) -> int:
        g = self.params[i].grad
        return int((~torch.isfinite(g)).sum()) if g is not None else -1

    def _update_stats(self) -> tuple[np.ndarray, np.ndarray, float]:
        with torch.no_grad():
            after = [p.detach() for p in self.params]
            w_norm = torch.stack([torch.linalg.vector_norm(p, dtype=torch.float32) for p in after])
            if self._stepped:
                d_norm = torch.stack(
                    [torch.linalg.vector_norm(a - b, dtype=torch.float32) for a, b in zip(after, self._before)]
                )
            else:
                d_norm = torch.zeros_like(w_norm)
            b_norm = torch.stack([torch.linalg.vector_norm(b, dtype=torch.float32) for b in self._before])
            ratio = torch.where(b_norm > 0, d_norm / b_norm, torch.where(d_norm > 0, torch.inf, 0.0))
            total = torch.linalg.vector_norm(d_norm.double()) / torch.linalg.vector_norm(b_norm.double()).clamp_min(1e-300)
        return ratio.cpu().numpy().astype(np.float32), w_norm.cpu().numpy().astype(np.float32), float(total)
