"""Record an `accelerate` training loop (the Hugging Face `*_no_trainer.py` examples), and replay
it bit-exactly.

    from ckptlab.integrations import accelerate as cka

    def train_step(accelerator, model, optimizer, lr_scheduler, batch):   # module level: the loop's body
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        return loss

    def build():                                 # module level: replay rebuilds with it
        accelerator = Accelerator(gradient_accumulation_steps=8)
        model, optimizer, lr_scheduler = ...    # made as the script makes them
        return cka.build(accelerator, train_step, *accelerator.prepare(model, optimizer, lr_scheduler))

    # the script, after accelerator.prepare(...):
    rec = cka.record("runs/clm", accelerator, model, optimizer, lr_scheduler, body=train_step,
                     build_fn=build, sample_id_key="sample_id")
    for epoch in range(num_epochs):
        for batch in train_dataloader:
            loss = rec.micro_batch(batch)       # runs train_step on it, recording
    rec.close()

One recorded step is one optimizer step, as with the frameworks (docs/integrations.md): its
first micro-batch begins it (its checkpoint when one is due, its RNG states), its batch is
`{"micro_batches": [{"batch": ...}, ...], "micro_rows": [...], "accelerate":
{"gradient_accumulation_steps": k}}` (without accumulation `{"batch": ..., "accelerate": ...}`),
recorded before its last micro-batch runs, and its loss is the sum of the micro-batches' losses
divided by k, as `accelerator.backward` divides them. Which micro-batch is the last is
accelerate's own rule, read before the body runs: every k-th (its `accelerator.step` counter),
or the dataloader's last batch; the body must run inside `accelerator.accumulate(model)`, which
applies that rule (checked after each micro-batch).

`training_step` is the recorded step function: the body on each micro-batch of the step, with
accelerate's counter set so that `accumulate` syncs on the last one only (the accelerated
optimizer steps and the accelerated scheduler steps there, as in the loop).

On several processes (DDP under `torchrun` or `accelerate launch --multi_gpu`) every rank records, as the plain
Recorder records DDP (docs/distributed.md): rank 0 writes the run, each rank its own
micro-batches. Replay spawns the recorded world size; `build_fn`'s `accelerator.prepare` wraps
the model in DDP there, and `accumulate` skips the all-reduce (`no_sync`) as in the loop.

Under DeepSpeed (`Accelerator(deepspeed_plugin=...)`) `prepare` returns the engine and its ZeRO
optimizer in a wrapper of accelerate's: the Recorder records the engine and that ZeRO optimizer
(as the plain Recorder records DeepSpeed's engine: training/zero.py), `build` returns them the
same way, and the body gets accelerate's wrapper, as in the loop (registered beside them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ckptlab.analysis.batches import MICRO_BATCHES
from ckptlab.errors import RecordError, ReplayError
from ckptlab.integrations import _common
from ckptlab.record import RecordConfig, Recorder
from ckptlab.training import zero
from ckptlab.training.probe import accumulating
from ckptlab.training.wrappers import torch_optimizer

BUILD_HINT = (
    "return ckptlab.integrations.accelerate.build(accelerator, body, model, optimizer, lr_scheduler) from build_fn"
)
KEY = "accelerate"  # how the step ends, in its recorded batch


def build(accelerator, body: Callable, model, optimizer, lr_scheduler=None):
    """`(model, optimizer, lr_scheduler[, scaler])` for build_fn, as `accelerator.prepare`
    returned them, with what `training_step` needs registered beside them: the accelerator and
    the loop's body. The scaler, when the accelerator has one (fp16 on a GPU), comes last:
    ckptlab checkpoints its state."""
    recorded = _recorded(model, optimizer)  # (DeepSpeed: the engine's ZeRO optimizer; the body gets the loop's)
    _common.register(recorded, accelerator=accelerator, body=body, scheduler=lr_scheduler, loop_optimizer=optimizer)
    scaler = accelerator.scaler
    return (model, recorded, lr_scheduler, scaler) if scaler is not None else (model, recorded, lr_scheduler)


def record(run_dir, accelerator, model, optimizer, lr_scheduler=None, **kwargs) -> LoopRecorder:
    """Record the loop whose body is `body(accelerator, model, optimizer, lr_scheduler, batch)`:
    see `LoopRecorder`."""
    return LoopRecorder(run_dir, accelerator, model, optimizer, lr_scheduler, **kwargs)


class LoopRecorder(_common.PassedOn):
    """A `Recorder` on an accelerate loop: `micro_batch(batch)` runs the loop's body on one
    batch of the dataloader and records the optimizer steps they make.

    Args:
        run_dir: the run directory.
        accelerator, model, optimizer, lr_scheduler: as `accelerator.prepare` returned them
            (the optimizer and scheduler are accelerate's wrappers: the body steps them).
        body: module-level `body(accelerator, model, optimizer, lr_scheduler, batch) -> loss`,
            the loop's body on one micro-batch, inside `with accelerator.accumulate(model)`.
        build_fn: module-level, returns `build(accelerator, body, ...)` (replay imports it).
        sample_id_key: the key of a dict batch that holds each row's dataset id
            (`ckptlab.with_sample_ids(ds, key=...)`); removed before the body sees the batch.
        config, **options: how to record, as for `ckptlab.Recorder`. The body steps the LR
            scheduler (`step_scheduler=False`).
    """

    def __init__(
        self,
        run_dir,
        accelerator,
        model,
        optimizer,
        lr_scheduler=None,
        *,
        body: Callable,
        build_fn: Callable,
        sample_id_key: str | None = None,
        config: RecordConfig | None = None,
        **options,
    ):
        self.accelerator, self.model, self.optimizer, self.lr_scheduler = accelerator, model, optimizer, lr_scheduler
        self.body, self.sample_id_key = body, sample_id_key
        self.config = RecordConfig.of(config, **{**options, "step_scheduler": False})
        self.rec = Recorder(
            run_dir,
            model,
            _recorded(model, optimizer),
            step_fn=training_step,
            build_fn=build_fn,
            scheduler=lr_scheduler,
            scaler=accelerator.scaler,
            config=self.config,
        )
        self._micro: _common.MicroBatches | None = None  # the running step's micro-batches

    def micro_batch(self, batch, sample_ids=None):
        """Run the body on `batch` (one batch of the dataloader), recording; returns its loss."""
        acc, rec = self.accelerator, self.rec
        if self.sample_id_key is not None:
            sample_ids = _pop_ids(batch, self.sample_id_key)
        k = int(acc.gradient_accumulation_steps)
        last, counter = _syncs_next(acc)
        how: dict[str, Any] = {KEY: {"gradient_accumulation_steps": k}}
        if not rec.in_step:
            rec.begin_step()
            self._micro = _common.MicroBatches()
        micro = self._micro
        assert micro is not None  # made as the step began, with its first micro-batch
        # (a copy of a dict batch: what the body pops from it stays recorded)
        micro.add({"batch": dict(batch) if type(batch) is dict else batch}, sample_ids)
        accumulating(torch_optimizer(self.optimizer), not last)  # gradient norms: of the last backward
        if last:
            _record(rec, micro, how)
        try:
            loss = self.body(acc, self.model, self.optimizer, self.lr_scheduler, batch)
        except BaseException:
            if not micro.recorded:  # crashed before its last micro-batch: replayable as it ran
                how[KEY]["optimizer_step"] = False
                _record(rec, micro, how)
            rec.abort_step()
            raise
        problem = _misfit(acc, counter, last, loss)
        if problem is not None:
            error = RecordError(problem[0], path=rec.run_dir, hint=problem[1])
            rec.abort_step(error)
            raise error
        micro.add_loss(scaled(loss, k))
        if last:
            _common.end_step(rec, micro.loss)
        return loss


def training_step(model, optimizer, batch):
    """One optimizer step of the loop, as recorded: the body (registered by `build`) on each
    micro-batch in order, accelerate's counter set so that `accelerator.accumulate` syncs
    (optimizer step, scheduler step, zero_grad in the accelerated objects) on the last only.
    Returns the sum of the micro-batches' losses, each divided by k."""
    accelerator = _common.registered(optimizer, "accelerator", required=True, hint=BUILD_HINT)
    body = _common.registered(optimizer, "body", required=True, hint=BUILD_HINT)
    lr_scheduler = _common.registered(optimizer, "scheduler", required=False, hint=BUILD_HINT)
    loop_optimizer = _common.registered(optimizer, "loop_optimizer", required=False, hint=BUILD_HINT) or optimizer
    cfg = batch[KEY]
    k = int(accelerator.gradient_accumulation_steps)
    if k != cfg["gradient_accumulation_steps"]:
        raise ReplayError(
            f"the run accumulated {cfg['gradient_accumulation_steps']} micro-batches a step, the accelerator "
            f"build_fn makes {k}",
            hint="make the Accelerator in build_fn with the recorded gradient_accumulation_steps",
        )
    parts = batch.get(MICRO_BATCHES) or [{"batch": batch["batch"]}]
    steps = cfg.get("optimizer_step", True)  # False: a step recorded as it crashed, before its last micro-batch
    total = None
    for i, part in enumerate(parts):
        last = steps and i == len(parts) - 1
        accumulating(torch_optimizer(optimizer), not last)
        # accumulate() counts: it syncs when its counter reaches a multiple of k (no dataloader
        # is active in replay, so the dataloader's end does not count).
        accelerator.step = k - 1 if last else 0
        _common.restore_micro_rng(part)
        loss = body(accelerator, model, loop_optimizer, lr_scheduler, part["batch"])
        total = _common.add_losses(total, scaled(loss, k))
    return total


def scaled(loss, k: int):
    """A micro-batch's share of its step's loss: divided by k, as `accelerator.backward` does."""
    return loss.detach() / k


def _recorded(model, optimizer):
    """The optimizer the Recorder records: under DeepSpeed the engine's ZeRO optimizer, which
    `prepare` hands the loop inside a wrapper of its own (whose step and zero_grad do nothing:
    `accelerator.backward` runs the engine's); else the one the loop holds."""
    engine = zero.engine_of(model)
    if engine is not None and getattr(optimizer, "optimizer", None) is engine.optimizer:
        return engine.optimizer
    return optimizer


def _misfit(accelerator, counter: int, last: bool, loss) -> tuple[str, str] | None:
    """(problem, hint) when the body did not run as a recorded micro-batch must: once inside
    `accelerator.accumulate`, syncing as predicted, returning its loss."""
    if accelerator.step != counter or bool(accelerator.sync_gradients) != last:
        return (
            "the loop's body did not run inside `with accelerator.accumulate(model)` once",
            "put the body's forward, backward and optimizer step under accelerator.accumulate(model)",
        )
    if not isinstance(loss, torch.Tensor):
        return (
            f"the loop's body returned {type(loss).__name__}, not the loss",
            "return the loss the body passes to accelerator.backward",
        )
    return None


def _syncs_next(accelerator) -> tuple[bool, int]:
    """(whether the next `accelerator.accumulate` syncs, its counter after it): accelerate's
    rule (`Accelerator._do_sync`), through its public state."""
    state = accelerator.gradient_state
    if state.sync_with_dataloader and state.end_of_dataloader:
        return True, 0
    counter = accelerator.step + 1
    return counter % state.num_steps == 0, counter


def _record(rec: Recorder, micro: _common.MicroBatches, how: dict) -> None:
    """The step's batch: its micro-batches, or without accumulation the one batch."""
    micro.record(rec, how, alone=how[KEY]["gradient_accumulation_steps"] == 1 and len(micro.parts) == 1)


def _pop_ids(batch, key: str):
    if not isinstance(batch, dict) or key not in batch:
        raise RecordError(
            f"sample_id_key={key!r}: the batch has no such key",
            hint=f"make the dataset with ckptlab.with_sample_ids(ds, key={key!r}) and keep the key in the collator",
        )
    return batch.pop(key)


__all__ = ["LoopRecorder", "build", "record", "training_step"]
