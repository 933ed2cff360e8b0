"""Record a Lightning Fabric training loop (litgpt's pretrain shape), and replay it bit-exactly.

    import lightning as L
    from ckptlab.integrations import fabric as ckf

    def train_step(fabric, model, optimizer, batch, is_accumulating):   # module level: the loop's body
        input_ids, targets = batch
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            loss = loss_fn(model(input_ids), targets)
            fabric.backward(loss / ACCUM)
        if not is_accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
        return loss

    def build():                                  # module level: replay rebuilds with it
        fabric = L.Fabric(accelerator="cuda", devices=2, strategy="ddp")   # as the script makes it
        model = GPT(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        return ckf.build(fabric, train_step, model, optimizer)          # fabric.launch(), fabric.setup(...)

    # the script, after fabric.launch() and model, optimizer = fabric.setup(model, optimizer):
    rec = ckf.record("runs/gpt", fabric, model, optimizer, body=train_step, build_fn=build)
    for iter_num, (ids, batch) in enumerate(loader, 1):      # loader over ckptlab.with_sample_ids(ds)
        for g in optimizer.param_groups:
            g["lr"] = get_lr(iter_num)                         # the loop's own: replay follows the record
        rec.micro_batch(batch, ids, is_accumulating=iter_num % ACCUM != 0)   # was: the body itself
    rec.close()

One recorded step is one optimizer step, as with the other frameworks (docs/integrations.md):
its first micro-batch begins it (its checkpoint when one is due, its RNG states), the loop says
which micro-batch is its last (`is_accumulating=False`, litgpt's `iter_num % accum != 0`), and
its batch is `{"micro_batches": [{"batch": ...}, ...], "micro_rows": [...], "fabric": {}}` (a
step of one micro-batch: `{"batch": ..., "fabric": {}}`), recorded before its last micro-batch
runs. Its loss is the mean of what the body returned for its micro-batches.

The body gets the Fabric object, so it calls `fabric.backward`, `fabric.no_backward_sync` and
`fabric.clip_gradients` as the loop did; `training_step`, the recorded step function, runs it
on each micro-batch of a step with `is_accumulating` true on all but the last. A learning rate
the loop sets outside the body (litgpt's `get_lr(...)` every iteration) needs nothing: replay
gives each step the rate it was recorded with (docs/replay.md, step 3). Parameters are named as
the model names them, without Fabric's `_forward_module.` (training/wrappers.py `unwrap`).

On several processes (Fabric's "ddp" strategy, under `torchrun` or Fabric's own launcher) every
rank records, as the plain Recorder records DDP (docs/distributed.md). Replay spawns the
recorded world size and makes the process group itself; `build` launches the Fabric of
`build_fn` into it, so Fabric never starts processes of its own there.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from ckptlab.analysis.batches import MICRO_BATCHES
from ckptlab.errors import RecordError, ReplayError
from ckptlab.integrations import _common
from ckptlab.record import RecordConfig, Recorder
from ckptlab.training.probe import accumulating
from ckptlab.training.wrappers import module_chain, torch_optimizer

BUILD_HINT = "return ckptlab.integrations.fabric.build(fabric, body, model, optimizer) from build_fn"
KEY = "fabric"  # how the step ends, in its recorded batch


def build(fabric, body: Callable, model: torch.nn.Module, optimizer) -> tuple:
    """`(model, optimizer)` for build_fn: `fabric.launch()` and `fabric.setup(model,
    optimizer)` as the script ran them (the model and optimizer as made, not yet set up), with
    what `training_step` needs registered beside them: the Fabric object and the loop's body.

    In a replay ckptlab has made the process group already (one process per recorded rank, or
    a group of one where the root step is explained): Fabric joins it. Its launcher would
    start the other ranks by running this process's command again, unless LOCAL_RANK says the
    processes were made for it, so that is said while it launches."""
    if any(type(m).__name__ == "_FabricModule" for m in module_chain(model)):
        raise ReplayError(
            "build(fabric, body, model, optimizer) got a model that fabric.setup already set up",
            hint="make the model and optimizer in build_fn and pass them as made: build calls fabric.launch() "
            "and fabric.setup(model, optimizer) itself",
        )
    _launch(fabric)
    model, optimizer = fabric.setup(model, optimizer)
    _common.register(optimizer, fabric=fabric, body=body)
    return model, optimizer


def _launch(fabric) -> None:
    import torch.distributed as dist

    if "LOCAL_RANK" in os.environ or not (dist.is_available() and dist.is_initialized()):
        fabric.launch()
        return
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    try:
        fabric.launch()
    finally:
        del os.environ["LOCAL_RANK"]


def record(run_dir, fabric, model, optimizer, **kwargs) -> LoopRecorder:
    """Record the loop whose body is `body(fabric, model, optimizer, batch, is_accumulating)`:
    see `LoopRecorder`."""
    return LoopRecorder(run_dir, fabric, model, optimizer, **kwargs)


class LoopRecorder(_common.PassedOn):
    """A `Recorder` on a Fabric loop: `micro_batch(batch, ids, is_accumulating=...)` runs the
    loop's body on one batch of the dataloader and records the optimizer steps they make.

    Args:
        run_dir: the run directory.
        fabric, model, optimizer: the Fabric object, and what `fabric.setup` returned.
        body: module-level `body(fabric, model, optimizer, batch, is_accumulating) -> loss`, the
            loop's body on one micro-batch: forward and `fabric.backward` (under
            `fabric.no_backward_sync(model, enabled=is_accumulating)`), and when not
            accumulating the clipping and the optimizer's step and zero_grad.
        build_fn: module-level, returns `build(fabric, body, model, optimizer)` (replay imports it).
        config, **options: how to record, as for `ckptlab.Recorder`.
    """

    def __init__(
        self,
        run_dir,
        fabric,
        model,
        optimizer,
        *,
        body: Callable,
        build_fn: Callable,
        config: RecordConfig | None = None,
        **options,
    ):
        self.fabric, self.model, self.optimizer, self.body = fabric, model, optimizer, body
        self.config = RecordConfig.of(config, **options)
        self.rec = Recorder(run_dir, model, optimizer, step_fn=training_step, build_fn=build_fn, config=self.config)
        self._micro: _common.MicroBatches | None = None  # the running step's micro-batches

    def micro_batch(self, batch, sample_ids=None, *, is_accumulating: bool = False):
        """Run the body on `batch` (one batch of the dataloader), recording; returns its loss.
        `is_accumulating`: not the step's last micro-batch (the optimizer does not step)."""
        rec = self.rec
        if not rec.in_step:
            rec.begin_step()
            self._micro = _common.MicroBatches()
        micro = self._micro
        assert micro is not None  # made as the step began, with its first micro-batch
        micro.add({"batch": batch}, sample_ids)
        accumulating(torch_optimizer(self.optimizer), is_accumulating)  # gradient norms: of the last backward
        how: dict = {KEY: {}}
        if not is_accumulating:
            micro.record(rec, how, alone=len(micro.parts) == 1)
        try:
            loss = self.body(self.fabric, self.model, self.optimizer, batch, is_accumulating)
        except BaseException:
            if not micro.recorded:  # crashed before its last micro-batch: replayable as it ran
                micro.record(rec, {KEY: {"optimizer_step": False}})
            rec.abort_step()
            raise
        if not isinstance(loss, torch.Tensor):
            error = RecordError(
                f"the loop's body returned {type(loss).__name__}, not the loss",
                path=rec.run_dir,
                hint="return the loss the body passes to fabric.backward (before dividing it for the accumulation)",
            )
            rec.abort_step(error)
            raise error
        micro.add_loss(loss)
        if not is_accumulating:
            _common.end_step(rec, micro.loss / len(micro.parts))
        return loss


def training_step(model, optimizer, batch):
    """One optimizer step of the loop, as recorded: the body (registered by `build`) on each
    micro-batch in order, accumulating on all but the last (on all, for a step recorded as it
    crashed before its last). Returns the mean of the micro-batches' losses."""
    fabric = _common.registered(optimizer, "fabric", required=True, hint=BUILD_HINT)
    body = _common.registered(optimizer, "body", required=True, hint=BUILD_HINT)
    parts = batch.get(MICRO_BATCHES) or [{"batch": batch["batch"]}]
    steps = batch[KEY].get("optimizer_step", True)
    total = None
    for i, part in enumerate(parts):
        last = steps and i == len(parts) - 1
        accumulating(torch_optimizer(optimizer), not last)
        _common.restore_micro_rng(part)
        loss = body(fabric, model, optimizer, part["batch"], not last)
        total = _common.add_losses(total, loss.detach())
    return total / len(parts)


__all__ = ["LoopRecorder", "build", "record", "training_step"]
