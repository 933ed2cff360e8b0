"""Record a Hugging Face Trainer run with ckptlab, and replay it bit-exactly.

    # train.py                                           pip install -e ".[transformers]"
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from ckptlab.integrations import transformers as ckt

    ARGS = TrainingArguments("out", max_steps=10_000, gradient_accumulation_steps=8, max_grad_norm=1.0,
                             bf16=True, report_to="none")

    def build():                          # module level: replay imports it by name
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, vocab_size=512))
        return ckt.build(model, ARGS)     # the Trainer's own optimizer and LR scheduler

    if __name__ == "__main__":
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, vocab_size=512))
        trainer = Trainer(model=model, args=ARGS, train_dataset=ds)
        ckt.record(trainer, "runs/hf", build_fn=build, sample_id_key="idx", ckpt_every=500)
        trainer.train()
    # then: ckptlab replay --run runs/hf --step 5432

HF callbacks are not given the batch or the loss, so `record` (or `CkptlabCallback.attach`)
also wraps `trainer.training_step`. What is recorded from which hook:
- `on_train_begin`: the Recorder is created on the trainer's model, optimizer, LR scheduler
  and, with fp16, accelerate's GradScaler (checkpointed; the Trainer steps the scheduler, so
  `step_scheduler=False`); under `torchrun` / `accelerate launch --multi_gpu` (DDP) on every rank, as the
  plain Recorder records DDP (docs/distributed.md): rank 0 writes the run, each rank its own
  batches; under `deepspeed=` (a ZeRO config) the Recorder gets the engine `train()` made
  (`trainer.model_wrapped`) and its ZeRO optimizer, as the plain Recorder records DeepSpeed's
  engine; under FSDP2 (`fsdp=`: transformers 5's default) the sharded model, as the plain
  Recorder records FSDP2 (a multi-process FSDP1 or XLA FSDP run, or a set-up the Recorder does
  not record, is not recorded: a warning naming it; `fsdp=` that accelerate prepares as DDP,
  on the CPU, is recorded as the DDP it runs, with a warning);
- the wrapped `training_step(model, inputs, num_items_in_batch)`: `begin_step` with what it
  was called with (a checkpoint first when due); the sample ids are taken out of `inputs`
  (`sample_id_key`) before the model sees them. With `gradient_accumulation_steps` one step is
  one optimizer step: its first micro-batch begins it, and its micro-batches are recorded
  together before the last one (`accelerator.sync_gradients`) runs;
- `on_step_end` (after clipping, the optimizer step, the scheduler step and zero_grad):
  `end_step` with the loss `training_step` returned (summed over the micro-batches);
- `on_evaluate`: `log_validation` with the `eval_*` metrics (timings left out);
- `on_train_end`, or `train()` raising: close.

`training_step` below is the recorded step function: the Trainer's `training_step` (run by a
Trainer built from the same arguments, whose model and optimizer `build` prepared as `train()`
does: accelerate's bf16/fp16 autocast and GradScaler; on several processes the model wrapped
in DDP, under `no_sync` but for the step's last micro-batch; under DeepSpeed the engine, whose
backward accelerate runs, and its step after the last micro-batch) on each micro-batch, then the
optimizer half of its loop: clip to `max_grad_norm`, optimizer step, scheduler step, zero_grad
(under DeepSpeed the engine has clipped and stepped: accelerate's wrappers do nothing there).
A multi-process run replays on its recorded world size (one process per rank, spawned by
`ckptlab replay`). docs/integrations.md lists what replays exactly.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, cast

import torch

from ckptlab.analysis.batches import MICRO_BATCHES
from ckptlab.errors import RecordError, install_hint
from ckptlab.integrations import _common
from ckptlab.record import RecordConfig, Recorder
from ckptlab.training.probe import accumulating
from ckptlab.training.world import unsupported
from ckptlab.training.wrappers import torch_optimizer, torch_scheduler

try:
    import transformers
    from transformers import Trainer, TrainerCallback
except ImportError:
    raise ImportError(
        "ckptlab.integrations.transformers needs transformers and accelerate: "
        + install_hint("transformers", "transformers accelerate")
    ) from None

BUILD_HINT = "return ckptlab.integrations.transformers.build(model, args) from build_fn"
# Metrics of `evaluate()` that time the evaluation rather than measure the model.
TIMING_SUFFIXES = ("_runtime", "_samples_per_second", "_steps_per_second")


class CkptlabCallback(TrainerCallback):
    """Records the run a Hugging Face Trainer drives into `run_dir` (see the module docstring).

    Args:
        run_dir: the run directory.
        build_fn: module-level `build_fn() -> (model, optimizer, scheduler)` for replay;
            usually `return ckptlab.integrations.transformers.build(model, ARGS)`.
        sample_id_key: the key of `inputs` that holds each row's dataset id (e.g. "idx"); it
            is removed before the model sees the inputs, and kept by the Trainer's column
            removal. None: no sample ids.
        config, **options: how to record, as for `ckptlab.Recorder` (`ckptlab.RecordConfig`:
            ckpt_every, health_every, keep_last, on_nonfinite, on_anomaly, val_metric, val_mode,
            keep_best, data_info, resume, trackers: "auto" logs into the W&B / MLflow run that
            `report_to` started) (val_metric: "eval_loss" by default here). The Trainer steps the LR scheduler, and
            with `resume` the Recorder restores nothing: the Trainer restores its own checkpoint.
    """

    def __init__(
        self,
        run_dir,
        *,
        build_fn: Callable,
        sample_id_key: str | None = None,
        config: RecordConfig | None = None,
        **options,
    ):
        self.run_dir, self.build_fn, self.sample_id_key = run_dir, build_fn, sample_id_key
        # The Trainer reports validation as eval_* metrics: the default metric is its eval_loss.
        base = config or RecordConfig()
        if base.val_metric == RecordConfig.val_metric:
            base = replace(base, val_metric="eval_loss")
        # The framework steps the scheduler, and on resume restores its own checkpoint.
        self.config = RecordConfig.of(base, **{**options, "step_scheduler": False, "restore": False})
        self.trainer: Trainer | None = None
        self.rec: Recorder | None = None
        self._loss: Any = None  # the running step's loss, without accumulation
        self._micro: _common.MicroBatches | None = None  # the running step's, with accumulation

    # --- set-up ---------------------------------------------------------------------------

    def attach(self, trainer: Trainer) -> CkptlabCallback:
        """Add this callback to `trainer` and wrap its `training_step`, so that each step's
        inputs and loss reach the Recorder."""
        if self.trainer is not None:
            raise RecordError("this CkptlabCallback is already attached to a Trainer")
        self.trainer = trainer
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        # Wrapping the Trainer's own methods is the point (pyproject.toml's mypy reads the Trainer as
        # Any; read as transformers types it, assigning to a method is an error).
        trainer.training_step = functools.partial(self._training_step, trainer.training_step)  # type: ignore[method-assign, unused-ignore]
        train = trainer.train

        @functools.wraps(train)
        def train_and_close(*args, **kwargs):
            try:
                return train(*args, **kwargs)
            finally:
                self.close()  # also when training raised: everything recorded reaches the disk

        trainer.train = train_and_close  # type: ignore[method-assign, unused-ignore]
        if self.sample_id_key is not None and trainer.args.remove_unused_columns:
            # The Trainer drops dataset columns its model's forward does not take; keep the ids.
            # No public way keeps one column: a collator wrapper is too late (a datasets.Dataset
            # loses its columns before any collator, any other dataset's collator is wrapped in
            # RemoveColumnsCollator, which drops them first), `label_names` would hand the ids
            # to compute_metrics as labels, callbacks never see inputs. With
            # remove_unused_columns=False nothing private is touched (docs/integrations.md).
            trainer._set_signature_columns_if_needed()
            columns = cast(list[str], trainer._signature_columns)  # a list from here on (None before)
            if self.sample_id_key not in columns:
                columns.append(self.sample_id_key)
        return self

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if self.trainer is None:
            raise RecordError(
                "CkptlabCallback is not attached",
                hint="call ckptlab.integrations.transformers.record(trainer, ...) "
                "or callback.attach(trainer) before trainer.train()",
            )
        fsdp = _fsdp_run(self.trainer)
        unreplayed = fsdp in ("FSDP1", "XLA FSDP")  # (FSDP2 is recorded as the plain Recorder records it)
        if args.world_size > 1 and unreplayed:
            # FSDP1's flat shards would be recorded in part, and replay would not run its steps.
            warnings.warn(
                f"ckptlab: recording a multi-process Trainer run under {fsdp} is not supported (FSDP2 is: "
                "transformers 5's default for fsdp=, fsdp_config={'fsdp_version': 2} on 4.x; so are DDP and "
                "DeepSpeed's ZeRO); recording nothing",
                stacklevel=2,
            )
            return
        if getattr(args, "fsdp", None) and fsdp is None and args.world_size > 1:
            warnings.warn(
                "ckptlab: the Trainer was given fsdp= but its accelerator prepared the model without FSDP "
                "(as accelerate does on the CPU): recording what it runs, DDP",
                stacklevel=2,
            )
        if unreplayed:
            warnings.warn(
                f"ckptlab: {fsdp} steps are not replayed; recording anyway (health, alerts, checkpoints and dirty "
                "work; replay will not be exact)",
                stacklevel=2,
            )
        if args.max_steps <= 0:
            warnings.warn(
                f"ckptlab: training by epochs; for an exact LR schedule in replay, build_fn must pass "
                f"num_training_steps={state.max_steps} to ckptlab.integrations.transformers.build",
                stacklevel=2,
            )
        model, optimizer = _recorded(self.trainer, model, optimizer)
        why = unsupported(model, args.world_size)
        if why:  # (a DeepSpeed set-up ckptlab does not record: fp16/bf16, ZeRO-Offload, stage 0; HSDP)
            warnings.warn(f"ckptlab: {why}; recording nothing", stacklevel=2)
            return
        self.rec = Recorder(
            self.run_dir,
            model,
            optimizer,
            step_fn=training_step,
            build_fn=self.build_fn,
            scheduler=torch_scheduler(lr_scheduler),
            scaler=self.trainer.accelerator.scaler,  # fp16 (on a GPU): the GradScaler accelerate made
            config=_common.with_trackers(self.config),  # "auto": the runs report_to= started
        )

    # --- one step -------------------------------------------------------------------------

    def _training_step(self, original, model, inputs, num_items_in_batch=None):
        if self.rec is None or self.rec.closed:
            return original(model, inputs, num_items_in_batch)
        ids = None
        if self.sample_id_key is not None:
            if self.sample_id_key not in inputs:
                raise RecordError(
                    f"sample_id_key={self.sample_id_key!r}: the Trainer's inputs have no such key",
                    hint="keep the column in the dataset and the collator",
                )
            ids = inputs.pop(self.sample_id_key)  # the model never sees it
        part = {"inputs": dict(inputs) if isinstance(inputs, Mapping) else inputs}
        how = {"transformers": {"max_grad_norm": float(self.trainer.args.max_grad_norm)}}
        if self.trainer.accelerator.num_processes > 1:  # (the loss is scaled by it: training_step)
            how["transformers"]["num_processes"] = int(self.trainer.accelerator.num_processes)
        if num_items_in_batch is not None:  # the same for every micro-batch of the step
            how["num_items_in_batch"] = num_items_in_batch
        if self.trainer.args.gradient_accumulation_steps == 1:  # one batch, one step
            self._micro = None
            self.rec.begin_step({**part, **how}, ids)
        else:
            self._accumulate(part, ids, how)
        try:
            loss = original(model, inputs, num_items_in_batch)
        except BaseException:
            if self._micro is not None and not self._micro.recorded:  # crashed before its last micro-batch
                how["transformers"]["optimizer_step"] = False
                self._micro.record(self.rec, how)
            self.rec.abort_step()  # the batch stays recorded: a crashing step can be replayed
            raise
        if self._micro is not None:
            self._micro.add_loss(loss)
        else:
            self._loss = loss
        return loss

    def _accumulate(self, part: dict, ids, how: dict) -> None:
        """Gradient accumulation: the step begins with its first micro-batch (its checkpoint and
        RNG states); its batch, the micro-batches together, is recorded before the last runs."""
        trainer, rec = self.trainer, self.rec
        assert trainer is not None and rec is not None  # _training_step comes here only while recording
        if not rec.in_step:
            rec.begin_step()
            self._micro = _common.MicroBatches()
        micro = self._micro
        assert micro is not None  # made as the step began, with its first micro-batch
        micro.add(part, ids)
        # The loop sets sync_gradients for the micro-batch after which the optimizer steps.
        last = trainer.accelerator.sync_gradients
        accumulating(rec.optimizer, not last)  # pre-clip gradient norms: measured once, on the last
        # How training_step scales each micro-batch's loss when the model does not normalize it
        # by num_items_in_batch: by the micro-batches of this step (fewer at an epoch's end).
        how["transformers"]["current_gradient_accumulation_steps"] = int(trainer.current_gradient_accumulation_steps)
        if last:
            micro.record(rec, how)

    def on_step_end(self, args, state, control, **kwargs):
        if self.rec is not None and self.rec.in_step:
            _common.end_step(self.rec, self._micro.loss if self._micro is not None else self._loss)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.rec is None or self.rec.closed or not metrics:
            return
        found = _common.scalar_metrics(metrics, lambda k: k.startswith("eval_") and not k.endswith(TIMING_SUFFIXES))
        if found:
            self.rec.log_validation(**found)

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        if self.rec is not None:
            self.rec.close()


def record(trainer: Trainer, run_dir, *, build_fn: Callable, **kwargs) -> CkptlabCallback:
    """Record `trainer`'s next `train()` into `run_dir`: `CkptlabCallback(...).attach(trainer)`."""
    return CkptlabCallback(run_dir, build_fn=build_fn, **kwargs).attach(trainer)


# --- build and replay ----------------------------------------------------------------------


def build(model, args, *, num_training_steps: int | None = None, trainer_cls: type = Trainer, **trainer_kwargs):
    """`(model, optimizer, scheduler[, scaler])` for build_fn: a `trainer_cls(model=model,
    args=args, **trainer_kwargs)` creates and prepares them as `train()` does, and is kept for
    `training_step` to run the same training step: its optimizer, then `accelerator.prepare`
    of the model and optimizer (which wraps the model's forward in the bf16/fp16 autocast, and
    the optimizer's step in the fp16 GradScaler's), then its LR scheduler. The scaler, when
    the accelerator has one (fp16 on a GPU), comes last: ckptlab checkpoints its state.

    `num_training_steps` is what the LR schedule is laid out over: `args.max_steps` unless you
    train by epochs (the callback warns with the number to pass)."""
    steps = num_training_steps if num_training_steps is not None else args.max_steps
    if steps is None or steps <= 0:
        raise ValueError("build needs num_training_steps when args.max_steps is not set (training by epochs)")
    if str(getattr(args.eval_strategy, "value", args.eval_strategy)) != "no":
        trainer_kwargs.setdefault("eval_dataset", [])  # the Trainer insists on one; replay never evaluates
    trainer = trainer_cls(model=model, args=args, **trainer_kwargs)
    if trainer.is_deepspeed_enabled:
        return _build_deepspeed(trainer, steps)
    # Trainer._prepare_for_training, in its order. Without the prepare, a bf16 run's forward
    # would replay in float32 (the autocast is accelerate's wrapper around model.forward).
    trainer.create_optimizer()
    trainer.model_wrapped, trainer.optimizer = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
    trainer.create_scheduler(num_training_steps=steps, optimizer=trainer.optimizer)
    optimizer, scaler = torch_optimizer(trainer.optimizer), trainer.accelerator.scaler
    _common.register(optimizer, trainer=trainer, scheduler=trainer.lr_scheduler)
    built = (trainer.model, optimizer, trainer.lr_scheduler)
    return (*built, scaler) if scaler is not None else built


def _build_deepspeed(trainer: Trainer, steps: int) -> tuple[Any, Any, Any]:
    """`(engine, its ZeRO optimizer, scheduler)`: the engine made as `train()` makes it under
    `deepspeed=` (Trainer._prepare_for_training): deepspeed_init fills the config's "auto"
    values and makes the optimizer (the Trainer's torch optimizer, or a stand-in for the
    config's), `accelerator.prepare` calls deepspeed.initialize, then the LR scheduler (the
    Trainer's, unless the config has one: DeepSpeed's engine steps that). The Recorder holds
    the engine and its ZeRO optimizer, as the callback records them."""
    from transformers.integrations.deepspeed import deepspeed_init

    trainer.optimizer, trainer.lr_scheduler = deepspeed_init(trainer, num_training_steps=steps)
    if type(trainer.lr_scheduler).__name__ == "DummyScheduler":  # the config's scheduler
        engine, trainer.optimizer, trainer.lr_scheduler = trainer.accelerator.prepare(
            trainer.model, trainer.optimizer, trainer.lr_scheduler
        )
    else:
        engine, trainer.optimizer = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
    trainer.create_scheduler(num_training_steps=steps)  # (keeps one that is already there)
    trainer.model_wrapped = trainer.deepspeed = engine
    _common.register(engine.optimizer, trainer=trainer, scheduler=trainer.lr_scheduler)
    return engine, engine.optimizer, trainer.lr_scheduler


def training_step(model, optimizer, batch):
    """One optimizer step of the Trainer's loop, as recorded, for each of its batches (one; or,
    with gradient_accumulation_steps, its micro-batches in order):

    loss = trainer.training_step(model, inputs, num_items_in_batch)   # forward + backward
    then, after the last: clip to max_grad_norm (or measure with an infinite bound, as the
    Trainer does at 0), which unscales fp16 gradients first; the accelerated optimizer's step
    (with fp16, the GradScaler's step and update, which skips it on inf/NaN gradients);
    lr_scheduler.step() unless that step was skipped (and not ReduceLROnPlateau);
    model.zero_grad(). Returns the loss (with accumulation, the sum of the micro-batches').
    """
    trainer = _common.registered(optimizer, "trainer", required=True, hint=BUILD_HINT)
    scheduler = _common.registered(optimizer, "scheduler", required=False, hint=BUILD_HINT)
    accelerator = trainer.accelerator
    cfg = batch["transformers"]
    parts = batch.get(MICRO_BATCHES) or [{"inputs": batch["inputs"]}]
    steps = cfg.get("optimizer_step", True)  # False: a step recorded as it crashed, before its last micro-batch
    # Set by the Trainer's loop for each optimizer step: how many micro-batches it has.
    trainer.current_gradient_accumulation_steps = cfg.get("current_gradient_accumulation_steps", 1)
    wrapped = _wrapped(trainer, model)
    total = None
    for i, part in enumerate(parts):
        last = steps and i == len(parts) - 1
        accumulating(optimizer, not last)  # the probe measures the last backward
        # The loop marks the micro-batch after which the optimizer steps; the accelerated
        # optimizer does nothing on the others (the flag is process-wide: set it every time).
        accelerator.gradient_state._set_sync_gradients(last)
        _common.restore_micro_rng(part)  # when something between micro-batches moved them
        # As the loop: DDP all-reduces the gradients of the last micro-batch only (no_sync
        # before it; one process: no wrapper, nothing to sync). DeepSpeed's engine is told by
        # accelerator.backward instead: its backward ends the step (engine.step) on the last.
        deepspeed = trainer.is_deepspeed_enabled
        sync = contextlib.nullcontext if last or deepspeed else functools.partial(accelerator.no_sync, wrapped)
        with sync(), _counting(accelerator, cfg.get("num_processes")):
            loss = trainer.training_step(wrapped, part["inputs"], batch.get("num_items_in_batch"))
        total = _common.add_losses(total, loss)
    if not steps:
        return total
    # Trainer._clip_grad_norm / _get_grad_norm: with max_grad_norm <= 0 it still "clips" to
    # inf, which multiplies every gradient by 1 -- or by NaN when the norm is NaN.
    max_grad_norm = cfg["max_grad_norm"]
    accelerator.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm > 0 else float("inf"))
    trainer.optimizer.step()  # accelerate's wrapper around `optimizer` (build prepared it)
    skipped = accelerator.optimizer_step_was_skipped  # the GradScaler found inf/NaN gradients
    if scheduler is not None and not skipped and not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scheduler.step()
    model.zero_grad()
    return total


def _wrapped(trainer, model):
    """The model the Trainer's loop runs: `model` as `accelerator.prepare` wrapped it in `build`
    (DDP, on more than one process), or `model` itself (one process; or another model given)."""
    wrapped = trainer.model_wrapped
    return wrapped if wrapped is model or getattr(wrapped, "module", None) is model else model


@contextlib.contextmanager
def _counting(accelerator, recorded: int | None):
    """accelerate counting the recorded processes. With `average_tokens_across_devices` the
    Trainer's compute_loss multiplies each rank's loss by the process count (each rank's
    `num_items_in_batch` counts every rank's tokens): where replay explains a multi-process
    run's root step, in a process group of one, the rank's loss is then the recorded one."""
    state = accelerator.state
    if recorded is None or recorded == state.num_processes:
        yield
        return
    counted, state.num_processes = state.num_processes, recorded
    try:
        yield
    finally:
        state.num_processes = counted


def _recorded(trainer: Trainer, model, optimizer) -> tuple[Any, Any]:
    """What the Recorder records: under DeepSpeed the engine the Trainer made in `train()`
    (`model_wrapped`) and its ZeRO optimizer (inside accelerate's wrapper), which hold the
    training state (training/zero.py); else the model and the torch optimizer."""
    engine = getattr(trainer, "deepspeed", None)
    if getattr(trainer, "is_deepspeed_enabled", False) and engine is not None:
        return engine, engine.optimizer
    return model, torch_optimizer(optimizer)


def _fsdp_run(trainer) -> str | None:
    """The FSDP the Trainer runs ("FSDP2", "FSDP1", or "XLA FSDP"): what its accelerator
    prepares, not what `args.fsdp` asks for (on the CPU accelerate prepares DDP instead, saying
    nothing); None without FSDP."""
    if getattr(trainer, "is_fsdp_xla_enabled", False):
        return "XLA FSDP"
    if not getattr(trainer, "is_fsdp_enabled", False):
        return None
    plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "fsdp_plugin", None)
    return "FSDP2" if getattr(plugin, "fsdp_version", 1) == 2 else "FSDP1"


__all__ = ["CkptlabCallback", "build", "record", "training_step", "transformers"]
