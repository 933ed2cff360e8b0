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
  the last firing holds the accumulated gradient, which is what we keep. A loop that knows
  which backward is its last says so (`accumulating(optimizer, True)` before the others,
  `False` before the last): the hooks then measure the last backward only, not every one.
- learning rates and the pre-update weights in the optimizer's step pre-hook: the lr actually
  used by this update, and the weights it started from (for ||dw||/||w||, every K steps only,
  since it costs a copy of the parameters).
- a GradScaler's scale at `begin`: hook gradients are scaled; norms are divided by it. A step
  the scaler skipped (non-finite gradients: the optimizer did not step and the scale backed
  off) is `scaler_skipped`: routine in float16 training, not a fault.

The Recorder and replay use this same class through training/step.py, so replayed numbers
compare bit for bit.
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from ckptlab.errors import RecordError
from ckptlab.run.records import NO_GRAD
from ckptlab.training.state import unwrap
from ckptlab.training.world import World, local


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
    rank_loss: list[float] | None = None  # distributed: each rank's own loss (`loss` is their mean)
    rank_grad_norm: list[float] | None = None  # distributed: each rank's local gradient norm
    scaler_skipped: bool = False  # a GradScaler found non-finite gradients and skipped the update

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
        if self.scaler_skipped:
            out["scaler_skipped"] = True
        if self.weight_norm is not None:
            out["nonfinite_weights"] = int((~np.isfinite(self.weight_norm)).sum())
        if self.update_ratio_global is not None:
            out["update_ratio_global"] = self.update_ratio_global
        if self.rank_loss is not None:
            out["rank_loss"] = self.rank_loss
            out["rank_grad_norm"] = self.rank_grad_norm
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


# The live probe on each optimizer: a step function that accumulates gradients reaches it here.
_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def accumulating(optimizer, on: bool) -> None:
    """Gradient accumulation: whether the backward about to run leaves the step's gradients
    unfinished (True: its norms would be overwritten, so the hooks skip them) or completes them
    (False: measured). Each step starts with every backward measured."""
    probe = _PROBES.get(optimizer)
    if probe is not None:
        probe._accumulating = on


class StepProbe:
    """Hooks on one model/optimizer; `world` (ckptlab.training.world.World) when running distributed."""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler=None, world: World | None = None
    ):
        named = named_parameters(model)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.optimizer = optimizer
        self.scaler = scaler
        self.world = world or World()
        self._active = False
        self._handles = [
            p.register_post_accumulate_grad_hook(partial(self._on_grad, i))
            for i, p in enumerate(self.params)
            if p.requires_grad
        ]
        self._handles.append(optimizer.register_step_pre_hook(self._on_pre_step))
        self._handles.append(optimizer.register_step_post_hook(self._on_post_step))
        _PROBES[optimizer] = self
        self._reset(False)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if _PROBES.get(self.optimizer) is self:
            del _PROBES[self.optimizer]

    def _reset(self, measure_update: bool) -> None:
        self._norms: list[torch.Tensor | None] = [None] * len(self.params)
        self._nonfinite: dict[int, int] = {}
        self._lr: list[float] | None = None
        self._before: list[torch.Tensor] | None = None
        self._stepped = False
        self._measure_update = measure_update
        self._accumulating = False  # see accumulating()

    # --- hooks (cheap: one norm kernel per parameter per backward) --------------------------

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        if not self._active or self._accumulating or p.grad is None:
            return
        g = local(p.grad)
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
            self._before = [local(p.detach()).clone() for p in self.params]

    def _on_post_step(self, optimizer, args, kwargs) -> None:
        if self._active:
            self._stepped = True

    # --- one step -------------------------------------------------------------------------------

    def begin(self, *, measure_update: bool = False) -> None:
        self._reset(measure_update)
        self._scale = float(self.scaler.get_scale()) if self.scaler is not None and self.scaler.is_enabled() else None
        self._t0 = time.perf_counter()
        self._active = True

    def abort(self) -> None:
        """Stop measuring (the step failed, or `end` is done): hooks ignore what comes next."""
        self._active = False
        self._before = None

    def end(self, loss) -> StepHealth:
        """Finish the step: this rank's measurements, combined with the other ranks' (one
        small all_gather when distributed), as the step's health."""
        value = loss_value(loss)  # syncs the device: step_time includes the work
        step_time = time.perf_counter() - self._t0
        self._active = False
        P = len(self.params)
        grad_sq, nonfinite = self._local_grads()
        updates = self._local_updates() if self._before is not None else None
        self._before = None
        # One row per rank: [loss, has_update, grad_sq(P), nonfinite(P), w_sq(P), d_sq(P), b_sq(P)]
        row = np.concatenate([[value, updates is not None], grad_sq, nonfinite, *(updates or [np.zeros(P)] * 3)])
        rows = self.world.gather(row)
        got = rows[:, 2 : 2 + P] >= 0  # NO_GRAD rows are negative
        grad_sq_all = np.where(got, rows[:, 2 : 2 + P], 0.0)
        combined = self.world.combine(grad_sq_all)
        any_grad = got.any(axis=0)
        norms = np.where(any_grad, np.sqrt(combined), NO_GRAD).astype(np.float32)
        nonfinite_all = rows[:, 2 + P : 2 + 2 * P].sum(axis=0).astype(np.int64)
        present = combined[any_grad]
        health = StepHealth(
            loss=float(rows[:, 0].mean()) if self.world.distributed else value,
            grad_norm=float(np.sqrt(present.sum())) if present.size else float("nan"),
            param_grad_norm=norms,
            nonfinite_grads=int(nonfinite_all.sum()),
            param_nonfinite=nonfinite_all if nonfinite_all.any() or not np.isfinite(norms).all() else None,
            lr=self._lr if self._lr is not None else [float(g["lr"]) for g in self.optimizer.param_groups],
            stepped=self._stepped,
            grad_scale=self._scale,
            step_time=step_time,
            scaler_skipped=self._scaler_skipped(),
        )
        if self.world.distributed:
            health.rank_loss = rows[:, 0].tolist()
            health.rank_grad_norm = np.sqrt(grad_sq_all.sum(axis=1)).tolist()
        if rows[0, 1]:
            w_sq, d_sq, b_sq = (self.world.combine(rows[:, 2 + k * P : 2 + (k + 1) * P]) for k in (2, 3, 4))
            health.weight_norm = np.sqrt(w_sq).astype(np.float32)
            d, b = np.sqrt(d_sq), np.sqrt(b_sq)
            with np.errstate(divide="ignore", invalid="ignore"):
                health.update_ratio = np.where(b > 0, d / b, np.where(d > 0, np.inf, 0.0)).astype(np.float32)
            health.update_ratio_global = float(np.sqrt(d_sq.sum()) / max(np.sqrt(b_sq.sum()), 1e-300))
        return health

    def _scaler_skipped(self) -> bool:
        """The GradScaler skipped this step: the optimizer did not step, and `scaler.update()`
        backed the scale off (what it does, and only does, after finding inf/NaN gradients)."""
        return self._scale is not None and not self._stepped and float(self.scaler.get_scale()) < self._scale

    def _local_grads(self) -> tuple[np.ndarray, np.ndarray]:
        """This rank's squared gradient norm per parameter (NO_GRAD: none) and non-finite counts."""
        P = len(self.params)
        sq = np.full(P, NO_GRAD, dtype=np.float64)
        # A gradient that arrived without the hook (e.g. assigned by hand): read it as it is now.
        for i, p in enumerate(self.params):
            if self._norms[i] is None and p.grad is not None:
                self._norms[i] = torch.linalg.vector_norm(local(p.grad.detach()), dtype=torch.float32)
        idx = [i for i, n in enumerate(self._norms) if n is not None]
        if idx:
            got = [self._norms[i] for i in idx]
            if len({t.device for t in got}) > 1:  # model spread over devices
                got = [t.to("cpu") for t in got]
            values = torch.stack(got).cpu().numpy().astype(np.float64)  # one device sync for all
            if self._scale:
                values = values / self._scale
            sq[idx] = values * values
        nonfinite = np.zeros(P, dtype=np.float64)
        for i in idx:
            if not np.isfinite(sq[i]):
                nonfinite[i] = self._nonfinite.get(i, self._count_now(i))
        return sq, nonfinite

    def _count_now(self, i: int) -> int:
        g = self.params[i].grad
        return int((~torch.isfinite(local(g))).sum()) if g is not None else -1

    def _local_updates(self) -> list[np.ndarray]:
        """Squared norms of this rank's weights after the update, the update, and the weights
        before it (of the local shards, when sharded)."""
        with torch.no_grad():
            after = [local(p.detach()) for p in self.params]
            w = torch.stack([torch.linalg.vector_norm(p, dtype=torch.float32) for p in after])
            if self._stepped:
                d = torch.stack(
                    [torch.linalg.vector_norm(a - b, dtype=torch.float32) for a, b in zip(after, self._before)]
                )
            else:
                d = torch.zeros_like(w)
            b = torch.stack([torch.linalg.vector_norm(x, dtype=torch.float32) for x in self._before])
        return [x.cpu().numpy().astype(np.float64) ** 2 for x in (w, d, b)]
