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
- per-parameter gradient norms once per optimizer step, with no call from the user's loop: at
  the first of (a) the start of torch's gradient clipping (`clip_grad_norm_`,
  `clip_grad_value_`, `get_total_norm`, `clip_grads_with_norm_`, however they were imported),
  (b) the start of a `GradScaler.unscale_`, (c) the optimizer's step pre-hook, (d) a
  `zero_grad` (of the optimizer or the module) in place of the step, (e) the step's `end`, after the last backward pass: that is the accumulated gradient *before* the user's
  clipping (after clipping the global norm is always <= max_norm, which hides every
  explosion), in one batched `torch._foreach_norm` over all gradients, however many
  micro-batches (one backward or k, `no_sync()`, clipped by torch, by hand, or not at all).
  Each backward pass's end (one callback per backward, queued by the first gradient hook that
  fires) notes which gradient tensors it left and their version counters. A loop that
  changes the gradients in place between its last backward and those points (clipping by
  hand, `p.grad /= k`) is caught by that note: the first step of each probe measures at the
  end of every backward pass (as a loop that changes gradients needs) and checks the note at
  the measuring point; only a loop that left the gradients as its backward did is measured
  lazily from its second step on. A later step that changes them anyway is measured after
  the change (once) and the probe measures every backward from then on. The values are the
  same bits either way (the same tensors, unchanged, in the same call); a replay's probe takes
  up what the recording's had learned at its checkpoint (`learned`), so that one step too
  compares bit for bit. `accumulating(optimizer, on)`
  (the Lightning and Hugging Face integrations call it) still skips the backward passes that
  a loop knows are not its last.
- learning rates, the norms of the pre-update weights and (for ||dw||, every `health_every`
  steps) a fixed sample of them in the optimizer's step pre-hook: the lr this update used
  and the weights it started from. By default the update norm is estimated from a strided
  sample of at most UPDATE_SAMPLE elements per tensor (`update_ratio="sampled"`, extra memory
  <= MEMORY_SHARE of the parameter bytes: training/update_sample.py); "exact" copies every
  parameter (+1x their bytes). On those steps, also which parameters' optimizer second moment
  is empty (an Adam first update to come: training/first_update.py), as device flags.
- DeepSpeed's engine with ZeRO: its averaged gradients never reach `p.grad`; each rank's
  parts are measured when its optimizer's step begins (`_zero_step`, training/zero.py).
- a hand-written update (`optimizer` is a training/hand_update.py HandUpdate, whose `step()`
  does nothing): no hook says when the weights change, so the learning rates and the weights
  before the update (on the steps that measure it) are taken at `begin`, the update at `end`.
  `stepped` is whether the weights moved, on the steps that measure the update; on the others,
  whether the step made gradients (a hand update follows them; measuring whether the weights
  moved would cost a pass over them every step).
- on the first `watch` steps of a probe (the Recorder's first steps of a session), the norms of
  the weights at `begin` and at `end`, when a torch optimizer's step never ran: weights that
  moved without it say the optimizer given is not the one that trains (`PendingHealth.watched`);
  and whatever ran, those of the parameters that no optimizer given holds: one that had a
  gradient and moved says another optimizer trains it (`PendingHealth.moved_outside`).
- several optimizers (an OptimizerSet: training/optimizer_set.py): each one's parameters'
  gradient norms as its own step found them, its groups' learning rates at its step, the
  weights before the update at the first of their steps (training/member_steps.py).
- a GradScaler's scale at `begin` and at `end`, as device tensors: hook gradients are
  scaled; norms are divided by it when read. A step the scaler skipped (non-finite
  gradients: the optimizer did not step, or a fused optimizer that the scaler hands its
  inf flag stepped without updating, and the scale backed off) is `scaler_skipped`:
  routine in float16 training, not a fault.

The Recorder and replay use this same class through training/step.py, so replayed numbers
compare bit for bit (the Recorder may read them a step later, replay reads them at once: the
same values).

This module holds the hooks and the step's bookkeeping; the batched norms and the copy to the
host are training/norms.py, the host arithmetic that makes the StepHealth record is
training/health.py.
"""

from __future__ import annotations

import math
import operator
import time
import weakref
from collections.abc import Callable

import torch

from ckptlab.errors import RecordError
from ckptlab.training import fsdp1, grad_points, zero
from ckptlab.training.first_update import empty_flags
from ckptlab.training.hand_update import group_lrs, is_hand_update
from ckptlab.training.member_steps import MemberSteps, outside_optimizer
from ckptlab.training.norms import (
    batched_norms,
    count_nonfinite,
    on_one_device,
    out_of_sight,
    scale_now,
    to_host,
)
from ckptlab.training.optimizer_set import OptimizerSet
from ckptlab.training.pending import PendingHealth
from ckptlab.training.update_before import held_weights, take_before, weight_norms
from ckptlab.training.update_sample import UPDATE_MODES, take_sample, update_scales
from ckptlab.training.world import World, is_sharded, local
from ckptlab.training.wrappers import own_name, unwrap


def loss_tensor(loss) -> torch.Tensor:
    """What `step_fn` returned as a 1-element float32 tensor on its device (no device sync);
    a clear error for anything but a scalar. None, a step that returned no loss (a Lightning
    `training_step` that returns nothing): NaN in the vector the probe copies, the step's
    health saying "not known" (`StepProbe.end`, training/health.py)."""
    if loss is None:
        return torch.full((1,), math.nan)
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise RecordError(f"step_fn returned a tensor of shape {tuple(loss.shape)}; return the scalar loss")
        value = loss.detach().reshape(1)
        return value if value.dtype == torch.float32 else value.float()
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return torch.tensor([float(loss)], dtype=torch.float32)
    raise RecordError(f"step_fn must return the loss (a scalar tensor), got {type(loss).__name__}")


def loss_value(loss) -> float:
    """The float of what `step_fn` returned (reads the device)."""
    return float(loss_tensor(loss).item())


def named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters in a stable order, tied ones once (the order the run's arrays use), by the
    model's own names."""
    return [(own_name(n), p) for n, p in unwrap(model).named_parameters()]


def same_norms_now(measured, norms_of=None, idx=None) -> bool:
    """Once per probe (its first step): do the gradients still have the norms their backward
    left (`measured`: the gradients, their versions, their norms)? Version counters miss a
    write that bypasses them (`p.grad.data`, DDP's all-reduce into its buckets with
    `gradient_as_bucket_view=True`): then a lazy measurement would see other numbers than
    this one, so the probe stays eager. `norms_of(idx, grads)`: how the probe measures them,
    when not `batched_norms` (a sharded fold's; `idx`: the measured gradients' parameters)."""
    if measured is None or not measured[0]:
        return True
    grads, _, _, stacked = measured
    norms = batched_norms(list(grads)) if norms_of is None else norms_of(idx, list(grads))
    return bool(torch.equal(torch.stack(norms), stacked))


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_GRAD, _VERSION = operator.attrgetter("grad"), operator.attrgetter("_version")


def _versions(grads: list) -> list[int]:
    """Each gradient's version counter (-1: no gradient)."""
    try:  # (every parameter has one: read at C level, no Python frame per item)
        return list(map(_VERSION, grads))
    except AttributeError:  # (None has no version)
        pass
    return [-1 if g is None else g._version for g in grads]


def detached(grads: list[torch.Tensor], sharded: bool) -> list[torch.Tensor]:
    """Gradients as the norms take them: this rank's shard of a DTensor (`sharded`), and
    detached when a backward with create_graph made them part of a graph (else as they are)."""
    if any(map(_REQUIRES_GRAD, grads)):
        grads = [g.detach() for g in grads]
    return [local(g) for g in grads] if sharded else grads


# The live probe on each optimizer: a step function that accumulates gradients reaches it here.
_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def accumulating(optimizer, on: bool) -> None:
    """Gradient accumulation: whether the backward about to run leaves the step's gradients
    unfinished (True: its norms would be overwritten, so the hooks skip them) or completes them
    (False: measured). Each step starts with every backward measured. Not needed since the
    probe measures once per optimizer step by itself; a loop that says so skips the notes of
    the backward passes it marks (the Lightning and Hugging Face integrations call it)."""
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
        # The names the step's health arrays are indexed by: the whole model's in a pipeline
        # (every stage's, training/pipeline.py), else the model's own.
        self.all_names = world.stages.names if world is not None and world.stages is not None else self.names
        self.params = [p for _, p in named]
        # Where a step's norms can be stacked as they are (all parameters on one device), and
        # whether gradients are DTensors whose local shard is what this rank measures.
        self._one_device = len({p.device for p in self.params}) <= 1
        self._cpu = all(p.device.type == "cpu" for p in self.params)
        self._sharded = any(is_sharded(p) for p in self.params)
        # What autograd accumulates into, where that is not the parameters: FSDP1's flat
        # parameters (the model's own are views, whose hooks never fire: training/fsdp1.py).
        self._leaves = fsdp1.flat_params(model)
        self.optimizer = optimizer
        self.scaler = scaler
        self.world = world or World()
        self.update_mode = update_ratio
        self.hand = is_hand_update(optimizer)  # a hand-written update (module docstring)
        self._engine = zero.engine_of(model)  # DeepSpeed's, with ZeRO (module docstring)
        if self._engine is not None:
            grad_points.install_zero(type(self._engine.optimizer))
        self.watch = 0  # steps left whose weights are compared at begin and end (module docstring)
        # Several optimizers: each one's part of a step (training/member_steps.py); and the
        # parameters none holds, watched on the watched steps.
        self._members = MemberSteps(optimizer, self.params) if isinstance(optimizer, OptimizerSet) else None
        # A sharded fold's norms(idx, grads) of params[idx]'s, as the recorded shards measured them (turns.py)
        self.grad_norms: Callable[[list[int], list[torch.Tensor]], list[torch.Tensor]] | None = None
        self._outside = () if self.hand else tuple(outside_optimizer(optimizer, self.params))
        self._active = False
        self._queued = False
        self._plans: list | None = None
        self._handles: list = []
        # When the gradient norms are taken (module docstring): "learn" (this probe's first step
        # with a backward: at the end of every backward, checking that nothing changed them
        # after it), "lazy" (once per step, at the first measuring point), "eager" (at the end of
        # every backward: the loop changes gradients after its backward).
        self.grad_mode = "learn"
        self._reuse = True  # whether a backward's note may reuse an earlier one's tensors (_on_backward_end)
        grad_points.install()
        self.attach()
        self._reset(False)

    def attach(self) -> None:
        """Put the hooks on the parameters and the optimizer (done by the constructor; again
        after `close()`)."""
        if self._handles:
            return
        # (ZeRO's gradients are gone from `p.grad` by the backward's end: before_zero_step)
        leaves = [*(p for p in self.params if p.requires_grad), *self._leaves] if self._engine is None else []
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in leaves]
        self._handles.append(self.optimizer.register_step_pre_hook(self._on_pre_step))
        self._handles.append(self.optimizer.register_step_post_hook(self._on_post_step))
        _PROBES[self.optimizer] = self

    def close(self) -> None:
        """Take the hooks off (`attach()` puts them back)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        grad_points.leave(self)
        if _PROBES.get(self.optimizer) is self:
            del _PROBES[self.optimizer]

    def _reset(self, measure_update: bool) -> None:
        # The last measured backward: which parameters had a gradient (ascending indices) and
        # their norms, one vector on one device (float32).
        self._grad_idx: list[int] = []
        self._grad_norms: torch.Tensor | None = None
        self._nonfinite: dict[int, int] = {}  # counted where it costs no sync (CPU)
        self._lr: list[float] | None = None
        # (norms of the weights, their sample or copy) before the update
        self._before: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        # only the norms before the update (a step with bad gradients)
        self._before_norms: list[torch.Tensor] | None = None
        self._begin_norms: list[torch.Tensor] | None = None  # a watched step's weights at begin
        self._empty: torch.Tensor | None = None  # second moments empty before the update (first_update.py)
        self._bad_grads = False  # the last backward's gradients were not all finite (known on the CPU)
        self._stepped = False
        if self._members is not None:  # several optimizers: what each one's step found
            self._members.reset()
        self._measure_update = measure_update
        self._accumulating = False  # see accumulating()
        # The gradients the last noted backward left: (tensors, versions, whether every
        # parameter had one, whether the tensors are an earlier backward's of this step: see
        # _on_backward_end). None before any backward, or once measured in the lazy mode.
        self._note: tuple[list, list[int], bool, bool] | None = None
        self._checked = False  # "learn": the note was checked at a measuring point this step
        # (grads, versions, norms, the norms stacked)
        self.measured: tuple[list, list[int], list[torch.Tensor], torch.Tensor] | None = None

    # --- hooks ------------------------------------------------------------------------------

    def _on_grad(self, p: torch.Tensor) -> None:
        """A gradient was accumulated: have the backward pass call us once when it ends."""
        if self._active and not self._accumulating and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        """A backward pass ended: note the gradients it left (and in the "learn" and "eager"
        modes, measure them now). In the lazy mode, a backward after one that left every
        gradient (micro-batches) notes only the versions of those tensors, into which it
        accumulated in place (each `p.grad` costs ~1 us right after a backward). One that made
        new tensors (`create_graph=True`) shows at the measuring point: the probe learns again."""
        self._queued = False
        if not self._active:
            return
        note = self._note
        if self.grad_mode == "lazy":  # (noted only: no torch op, so no dispatch-mode check)
            if note is not None and note[2] and self._reuse:
                self._note = (note[0], list(map(_VERSION, note[0])), True, True)
            else:
                grads = list(map(_GRAD, self.params))
                versions = _versions(grads)
                self._note = (grads, versions, -1 not in versions, False)
            return
        grads = list(map(_GRAD, self.params))
        if self.grad_mode == "learn":  # (nothing checks the note in the eager mode)
            self._note = (grads, _versions(grads), False, False)
        self._measure_grads_unseen(grads)

    @out_of_sight
    def _measure_point(self) -> None:
        """Gradient clipping, unscaling or the optimizer's step is about to start: the
        gradients of the last backward are final (lazy mode: measured now); were they changed
        since that backward by something else (by hand)?"""
        if not self._active or self._note is None:
            return
        grads, versions, _, reused = self._note
        now = list(map(_GRAD, self.params))
        same = all(map(operator.is_, now, grads))
        unchanged = same and _versions(now) == versions
        if self.grad_mode == "lazy":
            self._note = None
            self._measure_grads(now)  # after a change: what is there now, and every backward from now on
            if not unchanged and reused and not same:  # (maybe the backward's new tensors: learn again)
                self._reuse, self.grad_mode = False, "learn"
            elif not unchanged:
                self.grad_mode = "eager"
        elif self.grad_mode == "learn":
            self._note = None
            self._checked = True
            if not unchanged or not same_norms_now(self.measured, self.grad_norms, self._grad_idx):
                self.grad_mode = "eager"

    def _measure_grads(self, present: list | None = None) -> None:
        """The norms of the gradients there now (`present`: each parameter's, just read), in
        one batched call."""
        if present is None:
            present = list(map(_GRAD, self.params))
        idx = [i for i, g in enumerate(present) if g is not None]
        grads = detached([present[i] for i in idx], self._sharded)
        norms = batched_norms(grads) if self.grad_norms is None else self.grad_norms(idx, grads)
        self._grad_idx, self._grad_norms = idx, self._stack(norms)
        self.measured = (grads, list(map(_VERSION, grads)), norms, self._grad_norms)
        self._nonfinite = {}
        # Counting is free on the CPU (and a sync on a GPU, where it waits for `result()`).
        # (A sum of norms is finite when all are; an overflow only sends us to the exact test.)
        self._bad_grads = False
        if grads and self._grad_norms.device.type == "cpu" and not math.isfinite(sum(self._grad_norms.tolist())):
            self._bad_grads = bool(not torch.isfinite(self._grad_norms).all())
            for i, g, n in zip(idx, grads, norms):
                if not torch.isfinite(n):
                    self._nonfinite[i] = count_nonfinite(g)

    _measure_grads_unseen = out_of_sight(_measure_grads)  # (from a hook with no check of its own)

    @out_of_sight
    def _on_pre_step(self, optimizer, args, kwargs) -> None:
        if not self._active or self._engine is not None:  # (ZeRO: before_zero_step took it all)
            return
        if self._note is not None:  # (else nothing to measure: skip the call)
            self._measure_point()
        if self.hand:  # (a HandUpdate's step does nothing: its lr and weights were taken at begin)
            return
        if self._members is not None:  # one of several optimizers: its own part (member_steps.py)
            return self._members.pre_step(self, optimizer)
        self._lr = group_lrs(optimizer)
        if self._measure_update:
            take_before(self)
            # (FSDP1's state is of this rank's views, often empty: it says nothing of the whole)
            self._empty = empty_flags(optimizer, self.params) if not self._leaves else None
        elif self._bad_grads and not self.world.distributed:
            # Non-finite gradients (seen on the CPU without a sync): were the weights already
            # bad before this update? The record can then name them when the fault does not
            # reproduce (a weight changed outside the recorded step). One rank only: the ranks'
            # rows must have the same layout when combined.
            self._before_norms = weight_norms(self)

    def _on_post_step(self, optimizer, args, kwargs) -> None:
        if self._active and not self.hand:
            self._stepped = True

    def before_zero_step(self, optimizer) -> None:
        """DeepSpeed's ZeRO optimizer is about to step (training/grad_points.py): `_zero_step`."""
        _zero_step(self, optimizer)

    # --- one step -------------------------------------------------------------------------------

    def begin(self, *, measure_update: bool = False) -> None:
        self._reset(measure_update)
        self._scale = scale_now(self.scaler)
        if self.hand:  # the update happens somewhere in step_fn: what it starts from is here
            self._lr = group_lrs(self.optimizer)
            if measure_update:
                take_before(self)
        elif self.watch > 0:
            self._begin_norms = weight_norms(self)
        self._t0 = time.perf_counter()
        self._active = True
        grad_points.enter(self)

    def abort(self) -> None:
        """Stop measuring (the step failed, or `end` is done): hooks ignore what comes next."""
        self._active = False
        grad_points.leave(self)
        self._before = self._before_norms = self._begin_norms = None

    @out_of_sight
    def end(self, loss) -> PendingHealth:
        """Finish the step: queue its measurements' copy to the host and return at once.
        Combining with the other ranks happens in `result()` (all ranks read in step order)."""
        plain = self._cpu and type(loss) is torch.Tensor and loss.dtype is torch.float32 and loss.numel() == 1
        value = None if plain else loss_tensor(loss)  # (a plain loss is read as a float below)
        if self._note is not None:  # no optimizer step (or clipping) after the last backward
            self._measure_point()
        if self.grad_mode == "learn" and self._checked:
            self.grad_mode = "lazy"  # nothing changed the gradients after their backward
        self._active = False
        grad_points.leave(self)
        step_time = time.perf_counter() - self._t0  # host time: the device may still be working
        idx, grad_norms = _gradient_norms(self)
        if plain and _usual(self):  # the loss and the gradient norms only: no vector made here
            usual = {"loss": slice(0, 1), "grad": slice(1, 1 + len(idx))}
            plain_meta = _step_meta(self, idx, self._stepped, step_time)
            if self.watch > 0:  # a watched step that stepped: counted, nothing to add
                _watched(self, None, plain_meta)
            return PendingHealth(self, (loss.item(), grad_norms), None, usual, plain_meta)
        if value is None:
            value = loss_tensor(loss)
        meta: dict = {"no_loss": True} if loss is None else {}  # (not known, which NaN would not say: health.py)
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
            after = scale_now(self.scaler)  # after the step's scaler.update()
            assert after is not None, "an enabled scaler (it gave _scale) stays enabled"
            add("scale_after", [after])
        stepped: bool | None = self._stepped
        if self.hand:  # measured: whether the weights moved (read_health); else whether gradients came
            stepped = None if self._before is not None else bool(idx)
        if self._before is not None:
            with torch.no_grad():
                weights = held_weights(self)
                add("w", batched_norms(weights))
                add("b", self._before[0])
                if self._stepped or self.hand:
                    add("d", _update_norms(self, weights))
                    meta["d_scale"] = update_scales(self.update_mode, self._plans, len(self.params))
        if self._empty is not None:
            add("e", self._empty)
        if self._before_norms is not None:
            add("b0", self._before_norms)
        if self.watch > 0 and not self.hand:
            _watched(self, add, meta)
        self._before = self._before_norms = self._begin_norms = self._empty = None
        values, event = to_host(pieces)
        return PendingHealth(self, values, event, parts, meta | _step_meta(self, idx, stepped, step_time))

    def _stack(self, scalars: list[torch.Tensor]) -> torch.Tensor:
        """0-d tensors as one vector, on the first accelerator among their devices."""
        return torch.stack(scalars if self._one_device else on_one_device(scalars))


@out_of_sight
def _zero_step(probe: StepProbe, optimizer) -> None:
    """DeepSpeed's ZeRO optimizer is about to step: its averaged, unclipped gradients, this
    rank's parts, are measured now (the backward passes left no `p.grad`); and what the torch
    optimizer's pre-step hook takes for any other optimizer, the learning rates of all groups
    (DeepSpeed steps it one group at a time) and the weights before the update."""
    if not probe._active or probe._engine is None or optimizer is not probe._engine.optimizer:
        return
    probe._measure_grads(zero.local_grads(probe._engine, probe.params))
    probe._lr = group_lrs(optimizer)
    if probe._measure_update:
        take_before(probe)


def _gradient_norms(probe: StepProbe) -> tuple[list[int], torch.Tensor]:
    """The parameters with a gradient (ascending) and its norm, as one vector: those the last
    backward measured (with several optimizers, each one's parameters as its step found them:
    training/member_steps.py), and any gradient that arrived without a backward (e.g. assigned
    by hand), read as it is now."""
    idx, norms = probe._grad_idx, probe._grad_norms
    if probe._members is not None:
        idx, norms = probe._members.own_norms(probe, idx, norms)
    measured = set(idx)
    late = [(i, p.grad) for i, p in enumerate(probe.params) if p.grad is not None and i not in measured]
    if not late:
        return idx, norms if norms is not None else torch.zeros(0)
    by_index = dict(zip(idx, norms.unbind() if norms is not None else []))
    late_idx, late_grads = [i for i, _ in late], detached([g for _, g in late], probe._sharded)
    norms_of = probe.grad_norms or (lambda _, grads: batched_norms(grads))
    by_index.update(zip(late_idx, norms_of(late_idx, late_grads)))
    idx = sorted(by_index)
    return idx, probe._stack([by_index[i] for i in idx])


def _update_norms(probe: StepProbe, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per parameter, ||w_after - w_before|| ("exact"), or that norm over the sample (scaled up
    when read: `update_scales`)."""
    assert probe._before is not None, "called on a step that measures its update, after _on_pre_step"
    _, before = probe._before
    if probe.update_mode == "exact":  # one difference at a time: +1x the largest tensor, not all
        return [torch.linalg.vector_norm(a - b, dtype=torch.float32) for a, b in zip(weights, before)]
    assert probe._plans is not None, "made by _take, for the sample in _before"
    return batched_norms(list(torch._foreach_sub([take_sample(w, p) for w, p in zip(weights, probe._plans)], before)))


GRAD_MODES = ("learn", "lazy", "eager")


def learned(probe: StepProbe) -> dict:
    """What the probe has learned of the loop, saved with each checkpoint: a replay from it
    measures as the recording did (a fresh probe, learning, measures the first step that
    changes its gradients after its backward before the change; a lazy one after it)."""
    return {"grad_mode": probe.grad_mode, "reuse": probe._reuse}


def resume_learned(probe: StepProbe, info: dict | None) -> None:
    """Take up what `learned` saved (None, or a checkpoint from before it was saved: learn)."""
    if isinstance(info, dict) and info.get("grad_mode") in GRAD_MODES and isinstance(info.get("reuse"), bool):
        probe.grad_mode, probe._reuse = info["grad_mode"], info["reuse"]


def _watched(probe: StepProbe, add, meta: dict) -> None:
    """A watched step's end (`StepProbe.watch`): did the weights move without the optimizer?
    (PendingHealth.watched)."""
    probe.watch -= 1
    meta["watched"] = "stepped"
    if not probe._stepped:
        assert probe._begin_norms is not None, "taken at begin on a watched step"
        add("w0", probe._begin_norms)
        add("w1", weight_norms(probe))
    if probe._outside:  # parameters in no optimizer given: did they move? (PendingHealth.moved_outside)
        assert probe._begin_norms is not None, "taken at begin on a watched step"
        meta["outside"] = probe._outside
        add("o0", [probe._begin_norms[i] for i in probe._outside])
        with torch.no_grad():
            add("o1", batched_norms([local(probe.params[i].detach()) for i in probe._outside]))


def _usual(probe: StepProbe) -> bool:
    """The step measured the loss and the gradient norms, nothing else (no GradScaler, no
    update, no weights: training/health.py `read_common`'s step)."""
    return (
        probe._scale is None
        and probe._before is None
        and probe._empty is None
        and probe._before_norms is None
        and not probe.hand
        and (probe.watch <= 0 or (probe._stepped and not probe._outside))
    )


def _step_meta(probe: StepProbe, idx: list[int], stepped: bool | None, step_time: float) -> dict:
    return {
        "idx": idx,
        "nonfinite": dict(probe._nonfinite),
        "lr": probe._lr if probe._lr is not None else group_lrs(probe.optimizer),
        "stepped": stepped,  # None: whether the weights moved (a measured hand update)
        "step_time": step_time,
    }
