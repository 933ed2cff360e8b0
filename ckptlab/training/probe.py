"""Measure one training step's health from hooks, so the user's `step_fn` needs no change.

    probe = StepProbe(model, optimizer)
    probe.begin(measure_update=True)
    loss = step_fn(model, optimizer, batch)
    pending = probe.end(loss)         # device work queued, nothing read yet
    health = pending.result()         # loss, grad norms, lr, update ratios, ...
    probe.close()

Nothing here waits for the device until `result()`: every number is computed on the device
and copied (non-blocking, into pinned host memory on CUDA) at `end`, so the Recorder can read
step N's health when step N+1 ends while the host keeps running ahead of the GPU. On the CPU
the "copy" is the tensor itself, and `result()` is the same code reading it.

Where each number is computed, and why there:
- per-parameter gradient norms at the end of each backward pass (one callback per backward,
  queued by the first gradient hook that fires; one batched `torch._foreach_norm` over all
  gradients): that is the gradient *before* the user's `clip_grad_norm_` (after clipping the
  global norm is always <= max_norm, which hides every explosion). With gradient accumulation
  the last backward before the optimizer step holds the accumulated gradient, which is kept;
  each micro-batch costs one batched call, not a kernel per parameter. A loop that knows
  which backward is its last says so (`accumulating(optimizer, True)` before the others,
  `False` before the last): then only the last backward is measured, one call per step.
- learning rates, the norms of the pre-update weights and (for ||dw||, every `health_every`
  steps) a fixed sample of them in the optimizer's step pre-hook: the lr this update used
  and the weights it started from. By default the update norm is estimated from a strided
  sample of at most UPDATE_SAMPLE elements per tensor (`update_ratio="sampled"`, extra memory
  <= MEMORY_SHARE of the parameter bytes); "exact" copies every parameter (+1x their bytes).
- a GradScaler's scale at `begin` and at `end`, as device tensors: hook gradients are
  scaled; norms are divided by it when read. A step the scaler skipped (non-finite
  gradients: the optimizer did not step, or a fused optimizer that the scaler hands its
  inf flag stepped without updating, and the scale backed off) is `scaler_skipped`:
  routine in float16 training, not a fault.

The Recorder and replay use this same class through training/step.py, so replayed numbers
compare bit for bit (the Recorder may read them a step later, replay reads them at once: the
same values).
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from ckptlab.errors import RecordError
from ckptlab.run.records import NO_GRAD
from ckptlab.training.state import unwrap
from ckptlab.training.world import World, is_sharded, local


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
    # float32[P]: the norms before the update, kept only when some were not finite (the weights
    # went bad before this step's update: outside the step, or in a step that did not step)
    weight_norm_before: np.ndarray | None = None
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
        for key in ("param_nonfinite", "update_ratio", "weight_norm", "weight_norm_before"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


# The update-ratio sample: at most this many elements per tensor, and in all at most this share
# of the parameter bytes (a small model gets fewer per tensor). Against the exact ratio, 4096
# elements per matrix gave a median error of 0.7% (max 2.2%) per tensor on an 8M-parameter
# MLP, 512 gave 1-3% (max 5%): docs/performance.md, tests/training/test_probe.py. ||w|| is exact.
UPDATE_SAMPLE = 4096
MEMORY_SHARE = 0.01
UPDATE_MODES = ("sampled", "exact")


def loss_tensor(loss) -> torch.Tensor:
    """What `step_fn` returned as a 1-element float32 tensor on its device (no device sync);
    a clear error for anything but a scalar."""
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise RecordError(f"step_fn returned a tensor of shape {tuple(loss.shape)}; return the scalar loss")
        return loss.detach().reshape(1).float()
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return torch.tensor([float(loss)], dtype=torch.float32)
    raise RecordError(f"step_fn must return the loss (a scalar tensor), got {type(loss).__name__}")


def loss_value(loss) -> float:
    """The float of what `step_fn` returned (reads the device)."""
    return float(loss_tensor(loss).item())


def named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters in a stable order, tied ones once (the order the run's arrays use)."""
    return list(unwrap(model).named_parameters())


class PendingHealth:
    """One step's measurements, on their way to the host. `result()` waits for the copy (on
    CUDA: an event recorded after it, normally long done a step later) and turns the numbers
    into a StepHealth."""

    def __init__(self, probe: StepProbe, values: torch.Tensor, event, parts: dict, meta: dict):
        self._probe, self._values, self._event, self._parts, self._meta = probe, values, event, parts, meta
        self._health: StepHealth | None = None

    def result(self, *, grads_live: bool = False) -> StepHealth:
        """`grads_live`: the step's gradients are still on the parameters (read right after
        the step), so a GPU run can count the non-finite elements of a non-finite norm."""
        if self._health is None:
            if self._event is not None and not self._event.query():
                self._event.synchronize()  # the device is behind by more than a step: wait
            self._health = self._probe._health(self._values.numpy(), self._parts, self._meta, grads_live)
            self._values = self._event = None
        return self._health


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
    """Hooks on one model/optimizer; `world` (ckptlab.training.world.World) when running distributed.
    `update_ratio`: "sampled" (default) or "exact" (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler=None,
        world: World | None = None,
        *,
        update_ratio: str = "sampled",
    ):
        if update_ratio not in UPDATE_MODES:
            raise RecordError(f"update_ratio must be 'sampled' or 'exact', not {update_ratio!r}")
        named = named_parameters(model)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        # Where a step's norms can be stacked as they are (all parameters on one device), and
        # whether gradients are DTensors whose local shard is what this rank measures.
        self._one_device = len({p.device for p in self.params}) <= 1
        self._sharded = any(is_sharded(p) for p in self.params)
        self.optimizer = optimizer
        self.scaler = scaler
        self.world = world or World()
        self.update_mode = update_ratio
        self._active = False
        self._queued = False
        self._plans: list | None = None
        self._handles: list = []
        self.attach()
        self._reset(False)

    def attach(self) -> None:
        """Put the hooks on the parameters and the optimizer (done by the constructor; again
        after `close()`)."""
        if self._handles:
            return
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params if p.requires_grad]
        self._handles.append(self.optimizer.register_step_pre_hook(self._on_pre_step))
        self._handles.append(self.optimizer.register_step_post_hook(self._on_post_step))
        _PROBES[self.optimizer] = self

    def close(self) -> None:
        """Take the hooks off (`attach()` puts them back)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if _PROBES.get(self.optimizer) is self:
            del _PROBES[self.optimizer]

    def _reset(self, measure_update: bool) -> None:
        # The last measured backward: which parameters had a gradient (ascending indices) and
        # their norms, one vector on one device (float32).
        self._grad_idx: list[int] = []
        self._grad_norms: torch.Tensor | None = None
        self._nonfinite: dict[int, int] = {}  # counted where it costs no sync (CPU)
        self._lr: list[float] | None = None
        self._before = None  # (norms of the weights, their sample or copy) before the update
        self._before_norms = None  # only the norms before the update (a step with bad gradients)
        self._bad_grads = False  # the last backward's gradients were not all finite (known on the CPU)
        self._stepped = False
        self._measure_update = measure_update
        self._accumulating = False  # see accumulating()

    # --- hooks ------------------------------------------------------------------------------

    def _on_grad(self, p: torch.Tensor) -> None:
        """A gradient was accumulated: have the backward pass call us once when it ends."""
        if self._active and not self._accumulating and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        """All gradients of this backward are in: their norms, in one batched call. The last
        backward before the optimizer step (and any clipping) wins."""
        self._queued = False
        if not self._active:
            return
        idx = [i for i, p in enumerate(self.params) if p.grad is not None]
        grads = self._detached([self.params[i].grad for i in idx])
        norms = _norms(grads)
        self._grad_idx, self._grad_norms = idx, self._stack(norms)
        self._nonfinite = {}
        # Counting is free on the CPU (and a sync on a GPU, where it waits for `result()`).
        # (A sum of norms is finite when all are; an overflow only sends us to the exact test.)
        self._bad_grads = False
        if grads and self._grad_norms.device.type == "cpu" and not math.isfinite(sum(self._grad_norms.tolist())):
            self._bad_grads = bool(not torch.isfinite(self._grad_norms).all())
            for i, g, n in zip(idx, grads, norms):
                if not torch.isfinite(n):
                    self._nonfinite[i] = _count_nonfinite(g)

    def _on_pre_step(self, optimizer, args, kwargs) -> None:
        if not self._active:
            return
        self._lr = [float(g["lr"]) for g in optimizer.param_groups]
        if self._measure_update:
            with torch.no_grad():
                weights = [local(p.detach()) for p in self.params]
                self._before = (_norms(weights), self._take(weights))
        elif self._bad_grads and not self.world.distributed:
            # Non-finite gradients (seen on the CPU without a sync): were the weights already
            # bad before this update? The record can then name them when the fault does not
            # reproduce (a weight changed outside the recorded step). One rank only: the ranks'
            # rows must have the same layout when combined.
            with torch.no_grad():
                self._before_norms = _norms([local(p.detach()) for p in self.params])

    def _on_post_step(self, optimizer, args, kwargs) -> None:
        if self._active:
            self._stepped = True

    # --- the update-ratio sample ------------------------------------------------------------

    def _take(self, weights: list[torch.Tensor]):
        """What ||w_after - w_before|| needs of the weights before the update: a copy of every
        parameter ("exact"), or the same fixed strided sample of each ("sampled")."""
        if self.update_mode == "exact":
            return [w.clone() for w in weights]
        if self._plans is None or len(self._plans) != len(weights):
            self._plans = sample_plans([w.numel() for w in weights], [w.element_size() for w in weights])
        return [_sample(w, plan).clone() for w, plan in zip(weights, self._plans)]

    def _update_norms(self, weights: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per parameter, ||w_after - w_before|| ("exact"), or that norm over the sample
        (scaled up when read: `_update_scales`)."""
        _, before = self._before
        if self.update_mode == "exact":  # one difference at a time: +1x the largest tensor, not all
            return [torch.linalg.vector_norm(a - b, dtype=torch.float32) for a, b in zip(weights, before)]
        return _norms(torch._foreach_sub([_sample(w, p) for w, p in zip(weights, self._plans)], before))

    def _update_scales(self) -> np.ndarray:
        """What turns the squared update norm of each sample into the whole tensor's."""
        if self.update_mode == "exact":
            return np.ones(len(self.params))
        return np.array([plan.scale for plan in self._plans], dtype=np.float64)

    # --- one step -------------------------------------------------------------------------------

    def begin(self, *, measure_update: bool = False) -> None:
        self._reset(measure_update)
        self._scale = self._scale_now()
        self._t0 = time.perf_counter()
        self._active = True

    def _scale_now(self) -> torch.Tensor | None:
        """The GradScaler's scale as a 0-d float32 tensor (its own, on its device: reading it
        as a float would sync), or None without an enabled scaler."""
        if self.scaler is None or not self.scaler.is_enabled():
            return None
        get = getattr(self.scaler, "_get_scale_async", None)
        scale = get() if get is not None else None
        if scale is None:  # not yet created (before the first scale()) or an old scaler
            return torch.tensor(float(self.scaler.get_scale()))
        return scale.detach().reshape(()).float().clone()

    def abort(self) -> None:
        """Stop measuring (the step failed, or `end` is done): hooks ignore what comes next."""
        self._active = False
        self._before = self._before_norms = None

    def end(self, loss) -> PendingHealth:
        """Finish the step: queue its measurements' copy to the host and return at once.
        Combining with the other ranks happens in `result()` (all ranks read in step order)."""
        value = loss_tensor(loss)
        self._active = False
        step_time = time.perf_counter() - self._t0  # host time: the device may still be working
        idx, grad_norms = self._gradient_norms()
        meta: dict = {}
        parts: dict[str, slice] = {}  # name -> where its numbers sit in the one vector copied
        pieces: list[torch.Tensor] = []

        def add(name: str, scalars: list[torch.Tensor] | torch.Tensor) -> None:
            start = parts[next(reversed(parts))].stop if parts else 0
            if isinstance(scalars, torch.Tensor):  # already one vector
                pieces.append(scalars)
            else:
                pieces.append(self._stack(scalars) if scalars else torch.zeros(0))
            parts[name] = slice(start, start + len(scalars))

        add("loss", value)
        add("grad", grad_norms)
        if self._scale is not None:
            add("scale", [self._scale])
            add("scale_after", [self._scale_now()])  # after the step's scaler.update()
        if self._before is not None:
            with torch.no_grad():
                weights = [local(p.detach()) for p in self.params]
                add("w", _norms(weights))
                add("b", self._before[0])
                if self._stepped:
                    add("d", self._update_norms(weights))
                    meta["d_scale"] = self._update_scales()
        if self._before_norms is not None:
            add("b0", self._before_norms)
        self._before = self._before_norms = None
        values, event = _to_host(pieces)
        meta |= {
            "idx": idx,
            "nonfinite": dict(self._nonfinite),
            "lr": self._lr if self._lr is not None else [float(g["lr"]) for g in self.optimizer.param_groups],
            "stepped": self._stepped,
            "step_time": step_time,
        }
        return PendingHealth(self, values, event, parts, meta)

    def _gradient_norms(self) -> tuple[list[int], torch.Tensor]:
        """The parameters with a gradient (ascending) and its norm, as one vector: those the
        last backward measured, and any gradient that arrived without a backward (e.g.
        assigned by hand), read as it is now."""
        idx, norms = self._grad_idx, self._grad_norms
        measured = set(idx)
        late = [i for i, p in enumerate(self.params) if p.grad is not None and i not in measured]
        if not late:
            return idx, norms if norms is not None else torch.zeros(0)
        by_index = dict(zip(idx, norms.unbind() if norms is not None else []))
        by_index.update(zip(late, _norms(self._detached([self.params[i].grad for i in late]))))
        idx = sorted(by_index)
        return idx, self._stack([by_index[i] for i in idx])

    def _detached(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Gradients as the norms take them: this rank's shard of a DTensor, and detached
        when a backward with create_graph made them part of a graph (else they are as is)."""
        if any(g.requires_grad for g in grads):
            grads = [g.detach() for g in grads]
        return [local(g) for g in grads] if self._sharded else grads

    def _stack(self, scalars: list[torch.Tensor]) -> torch.Tensor:
        """0-d tensors as one vector, on the first accelerator among their devices."""
        return torch.stack(scalars if self._one_device else _on_one_device(scalars))

    def _health(self, values: np.ndarray, parts: dict, meta: dict, grads_live: bool) -> StepHealth:
        """This rank's numbers, combined with the other ranks' (one small all_gather when
        distributed), as the step's health. Host arithmetic only."""
        P = len(self.params)
        value = float(values[parts["loss"]][0])
        scale = float(values[parts["scale"]][0]) if "scale" in parts else None
        grad_sq, nonfinite = self._local_grads(values[parts["grad"]], meta, scale, grads_live)
        has_update = "w" in parts
        updates = None
        if has_update:
            d_sq = values[parts["d"]].astype(np.float64) ** 2 * meta["d_scale"] if "d" in parts else np.zeros(P)
            updates = [values[parts["w"]].astype(np.float64) ** 2, d_sq, values[parts["b"]].astype(np.float64) ** 2]
        ranks = None  # distributed: (the mean loss, each rank's loss, each rank's local gradient norm)
        total = grad_sq.sum() if not self.world.distributed and len(meta["idx"]) == P > 0 else math.nan
        if math.isfinite(total):
            # One rank, every parameter with a gradient, every norm finite (the usual step): what
            # the general case computes, in fewer calls (its masks select all, its counts are 0).
            norms = np.sqrt(grad_sq).astype(np.float32)
            grad_norm, update_sq = math.sqrt(total), updates
            nonfinite_all = np.zeros(P, dtype=np.int64) if not np.isfinite(norms).all() else None
            counted = 0
        else:
            if self.world.distributed:
                any_grad, combined, nonfinite_all, update_sq, ranks = self._combine_ranks(
                    value, grad_sq, nonfinite, updates
                )
            else:  # one rank: the same numbers without the rows (the mean of one row is that row)
                any_grad = ~(grad_sq < 0)  # NO_GRAD is negative; a NaN norm was measured (and is kept)
                combined = np.where(any_grad, grad_sq, 0.0)
                # -1: non-finite, but the gradient was gone before it could be counted (a deferred
                # read on a GPU); it counts as at least one element in the total.
                nonfinite_all = np.where(nonfinite < 0, -1, np.where(nonfinite > 0, nonfinite, 0)).astype(np.int64)
                update_sq = updates
            norms = np.where(any_grad, np.sqrt(combined), NO_GRAD).astype(np.float32)
            present = combined[any_grad]
            grad_norm = float(np.sqrt(present.sum())) if present.size else float("nan")
            counted = int(np.abs(nonfinite_all).sum())
            if not (nonfinite_all.any() or not np.isfinite(norms).all()):
                nonfinite_all = None  # recorded only for a step with something non-finite
        health = StepHealth(
            loss=ranks[0] if ranks is not None else value,
            grad_norm=grad_norm,
            param_grad_norm=norms,
            nonfinite_grads=counted,
            param_nonfinite=nonfinite_all,
            lr=meta["lr"],
            stepped=meta["stepped"],
            grad_scale=scale,
            step_time=meta["step_time"],
            scaler_skipped=self._scaler_skipped(meta["stepped"], scale, values, parts),
        )
        if ranks is not None:
            _, health.rank_loss, health.rank_grad_norm = ranks
        if update_sq is not None:
            w_sq, d_sq, b_sq = update_sq
            health.weight_norm = np.sqrt(w_sq).astype(np.float32)
            d, b = np.sqrt(d_sq), np.sqrt(b_sq)
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(b > 0, d / b, np.where(d > 0, np.inf, 0.0))
                # NaN where the weights (or the update) were not finite: not "no update"
                health.update_ratio = np.where(np.isnan(b) | np.isnan(d), np.nan, ratio).astype(np.float32)
            health.update_ratio_global = float(np.sqrt(d_sq.sum()) / max(np.sqrt(b_sq.sum()), 1e-300))
        before = np.sqrt(update_sq[2]) if update_sq is not None else values[parts["b0"]] if "b0" in parts else None
        if before is not None and not np.isfinite(before).all():
            health.weight_norm_before = np.asarray(before, dtype=np.float32)
        return health

    def _combine_ranks(self, value: float, grad_sq: np.ndarray, nonfinite: np.ndarray, updates):
        """Every rank's numbers (one small all_gather) combined: (which parameters have a
        gradient on any rank, the squared gradient norms, the non-finite counts, the squared
        weight / update / pre-update weight norms or None, (the ranks' mean loss, each rank's
        loss, each rank's local gradient norm))."""
        P = len(self.params)
        # One row per rank: [loss, has_update, grad_sq(P), nonfinite(P), w_sq(P), d_sq(P), b_sq(P)]
        row = np.concatenate([[value, updates is not None], grad_sq, nonfinite, *(updates or [np.zeros(P)] * 3)])
        rows = self.world.gather(row)
        got = ~(rows[:, 2 : 2 + P] < 0)  # NO_GRAD rows are negative; NaN ones were measured
        grad_sq_all = np.where(got, rows[:, 2 : 2 + P], 0.0)
        combined = self.world.combine(grad_sq_all)
        counts = rows[:, 2 + P : 2 + 2 * P]
        # -1: non-finite, but the gradient was gone before it could be counted (a deferred read
        # on a GPU); it counts as at least one element in the total.
        unknown = (counts < 0).any(axis=0)
        nonfinite_all = np.where(unknown, -1, np.where(counts > 0, counts, 0).sum(axis=0)).astype(np.int64)
        update_sq = None
        if rows[0, 1]:
            update_sq = [self.world.combine(rows[:, 2 + k * P : 2 + (k + 1) * P]) for k in (2, 3, 4)]
        ranks = float(rows[:, 0].mean()), rows[:, 0].tolist(), np.sqrt(grad_sq_all.sum(axis=1)).tolist()
        return got.any(axis=0), combined, nonfinite_all, update_sq, ranks

    def _scaler_skipped(self, stepped: bool, scale: float | None, values: np.ndarray, parts: dict) -> bool:
        """The GradScaler skipped this step: `scaler.update()` backed the scale off (what it does,
        and only does, after finding inf/NaN gradients), and the optimizer did not step -- or
        it did, but is one (fused AdamW: the HF Trainer's default) that `scaler.step` calls with
        the inf flag, to skip the update itself."""
        if scale is None or "scale_after" not in parts or not values[parts["scale_after"]][0] < scale:
            return False
        return not stepped or bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))

    def _local_grads(self, norms: np.ndarray, meta: dict, scale: float | None, grads_live: bool):
        """This rank's squared gradient norm per parameter (NO_GRAD: none) and non-finite counts."""
        P = len(self.params)
        idx = meta["idx"]
        values = norms.astype(np.float64)
        if scale:
            values = values / scale
        if len(idx) == P:  # every parameter has a gradient (idx is ascending, without repeats)
            sq = values * values
        else:
            sq = np.full(P, NO_GRAD, dtype=np.float64)
            sq[idx] = values * values
        nonfinite = np.zeros(P, dtype=np.float64)
        if math.isfinite(sq.sum()):  # the common case, in one call (an overflow only means: look)
            return sq, nonfinite
        for i in np.flatnonzero(~np.isfinite(sq)).tolist():  # (NO_GRAD is finite: only measured ones)
            known = meta["nonfinite"].get(i)
            nonfinite[i] = known if known is not None else (self._count_now(i) if grads_live else -1)
        return sq, nonfinite

    def _count_now(self, i: int) -> int:
        g = self.params[i].grad
        return _count_nonfinite(local(g)) if g is not None else -1


# --- device helpers ---------------------------------------------------------------------------


def _norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """float32 L2 norm of each tensor: one batched kernel per device and dtype where possible
    (sparse gradients one by one, from their values)."""
    if not tensors:
        return []
    if any(t.is_sparse for t in tensors):
        return [
            torch.linalg.vector_norm(t.coalesce().values() if t.is_sparse else t, dtype=torch.float32) for t in tensors
        ]
    # On the CPU, float32 tensors without dtype=: the same bits, ~30% less kernel time (a GPU
    # launches either way: no loop over the tensors there)
    if tensors[0].device.type == "cpu" and all(t.dtype == torch.float32 for t in tensors):
        return list(torch._foreach_norm(tensors, 2))
    return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))


def _on_one_device(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors on one device (a model spread over devices): the first accelerator's."""
    first = next((t.device for t in tensors if t.device.type != "cpu"), tensors[0].device)
    return [t if t.device == first else t.to(first, non_blocking=True) for t in tensors]


def _count_nonfinite(g: torch.Tensor) -> int:
    if g.is_sparse:
        g = g.coalesce().values()
    return int((~torch.isfinite(g)).sum())


def _to_host(pieces: list[torch.Tensor]) -> tuple[torch.Tensor, object]:
    """A step's numbers (1-d tensors) as one float32 vector on the host, and the CUDA event after
    whose completion it may be read (None on the CPU: nothing to wait for)."""
    # Gather on the device (a loss returned as a float, or a CPU scale, moves up: never a
    # non-blocking copy down into memory that is read before it lands).
    on = _on_one_device(pieces)
    first = on[0].device
    values = torch.cat([p if p.dtype == torch.float32 else p.float() for p in on])
    if first.type != "cuda":
        return values.cpu(), None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)  # on `first`'s current stream
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(first))
    return host, event


@dataclass(frozen=True)
class SamplePlan:
    """Elements offset, offset+stride, ... (count of them) of a flattened tensor; `scale`
    turns the sample's sum of squares into an estimate of the whole tensor's."""

    offset: int
    stride: int
    count: int
    scale: float


def sample_plans(numels: list[int], itemsizes: list[int]) -> list[SamplePlan]:
    """A fixed strided sample per tensor, the same on every call (record and replay compare
    bit for bit): at most UPDATE_SAMPLE elements, halved until all samples together hold at
    most MEMORY_SHARE of the parameter bytes (never fewer than 64 per tensor). The stride is
    a prime, so a sample of a matrix walks across its columns instead of down one of them."""
    budget = MEMORY_SHARE * sum(n * s for n, s in zip(numels, itemsizes))
    k = UPDATE_SAMPLE
    while k > 64 and sum(min(n, k) * s for n, s in zip(numels, itemsizes)) > budget:
        k //= 2
    rng = np.random.default_rng(0)
    plans = []
    for n in numels:
        count = min(n, k)
        stride = _prime_at_most(max(n // count, 1)) if count < n else 1
        offset = int(rng.integers(0, n - (count - 1) * stride)) if n else 0
        plans.append(SamplePlan(offset, stride, count, n / count if count else 0.0))
    return plans


def _sample(w: torch.Tensor, plan: SamplePlan) -> torch.Tensor:
    flat = w.reshape(-1)  # a view for a contiguous parameter
    return flat[plan.offset : plan.offset + (plan.count - 1) * plan.stride + 1 : plan.stride]


def _prime_at_most(n: int) -> int:
    """The largest prime <= n (1 for n < 2)."""
    for c in range(n, 1, -1):
        if all(c % d for d in range(2, int(c**0.5) + 1)):
            return c
    return 1
