"""Record a PyTorch Lightning run with ckptlab, and replay it bit-exactly.

    # train.py                                               pip install -e ".[lightning]"
    import lightning.pytorch as pl
    from ckptlab.integrations import lightning as ckl

    def build():                          # module level: replay imports it by name
        torch.manual_seed(0)
        return ckl.build(LitModel(), precision="16-mixed")  # -> (module, optimizer[, scheduler], scaler)

    if __name__ == "__main__":
        cb = ckl.CkptlabCallback("runs/lit", build_fn=build, sample_ids="idx", ckpt_every=500)
        pl.Trainer(max_steps=10_000, accumulate_grad_batches=8, gradient_clip_val=1.0, precision="16-mixed",
                   callbacks=[cb]).fit(LitModel(), loader)
    # then: ckptlab replay --run runs/lit --step 5432

What is recorded from which hook:
- `on_train_start`: the Recorder is created on the trainer's module, optimizer, LR scheduler
  and, with 16-mixed, the precision plugin's GradScaler (checkpointed; the trainer steps the
  scheduler, so `step_scheduler=False`);
- `on_train_batch_start`: `begin_step` with the batch as `training_step` receives it (after the
  transfer to the device), its batch index, and how the trainer will finish the step (gradient
  clipping, whether the scheduler steps after it, the precision); a checkpoint first when due.
  With `accumulate_grad_batches=k` one step is one optimizer step: its first micro-batch begins
  it, and its micro-batches are recorded together before the last one runs;
- `on_train_batch_end`: `end_step` with the loss `training_step` returned (with accumulation,
  after the last micro-batch, the sum of theirs; none: a step all the same, its loss not known);
- `on_validation_end`: `log_validation` with the trainer's metrics whose names start with
  `val_prefix` (not during the sanity check);
- `on_train_end` / `on_exception`: close.

Under DDP (`strategy="ddp"`, `"ddp_spawn"`) every rank records, as the Recorder records DDP
(rank 0 the manifest, journal and checkpoints; every rank its own batches), and the replayed
step runs through a DistributedDataParallel wrapper with the recorded options. Under
ModelParallelStrategy the module shards itself in `configure_model` (FSDP2, FSDP2 x TP): every
rank records its shards as under FSDP2, and build_fn's `build(module, tensor_parallel_size=T)`
runs configure_model on the same mesh. Other multi-process strategies (Lightning's FSDP1 and
DeepSpeed strategies) are not recorded: a warning, nothing written (lightning_strategy.py).

`training_step` below is the recorded step function: it performs the trainer's automatic
optimization step (training_step, zero_grad, backward, the module's hooks, gradient clipping,
optimizer step, scheduler step; under bf16-mixed / 16-mixed autocast, with 16-mixed's loss
scaling) for one batch, or for the k micro-batches of an accumulated step; under manual
optimization the module's own training_step, which drives every optimizer the callback
recorded (lightning_manual.py). docs/integrations.md lists what replays exactly.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ckptlab.analysis.batches import MICRO_BATCHES
from ckptlab.errors import RecordError
from ckptlab.integrations import _common
from ckptlab.integrations.lightning_manual import ReplayedTrainer, as_list
from ckptlab.integrations.lightning_strategy import (  # (pl: Lightning, under either package name)
    BUILD_HINT,
    check_mesh,
    configure_model,
    ddp_wrapper,
    no_sync,
    not_recorded,
    pl,
    run_training_step,
    strategy_config,
)
from ckptlab.record import RecordConfig, Recorder
from ckptlab.training.crash import call_through
from ckptlab.training.probe import accumulating

# Precisions whose training step this module reproduces: full float32 (Lightning's default),
# bf16 autocast, and float16 autocast with its GradScaler ("16-mixed": build(..., precision=
# "16-mixed") makes the scaler, whose state is checkpointed). float64 / true-half ("64-true",
# "bf16-true") convert the module and the batch, which build_fn would have to mirror.
EXACT_PRECISIONS = {"32-true", "32", "bf16-mixed", "16-mixed"}
AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
SCALER_HINT = 'return ckptlab.integrations.lightning.build(module, precision="16-mixed") from build_fn'


class CkptlabCallback(pl.Callback):
    """Records the run a Lightning Trainer drives into `run_dir` (see the module docstring).

    Args:
        run_dir: the run directory.
        build_fn: module-level `build_fn() -> (module, optimizer[, scheduler])` for replay;
            usually `return ckptlab.integrations.lightning.build(MyModule())`.
        sample_ids: where each batch row's dataset id is: a key of a dict batch (e.g. "idx"),
            a function `batch -> ids`, or None.
        val_prefix: validation metrics are the trainer's metrics whose names start with it.
        config, **options: how to record, as for `ckptlab.Recorder` (`ckptlab.RecordConfig`:
            ckpt_every, health_every, keep_last, on_nonfinite, on_anomaly, val_metric, val_mode,
            keep_best, data_info, resume, trackers: "auto" logs into the trainer's W&B / MLflow
            logger). The trainer steps the LR scheduler, and
            with `resume` the Recorder restores nothing: the trainer restores its own checkpoint.
    """

    def __init__(
        self,
        run_dir,
        *,
        build_fn: Callable,
        sample_ids: str | Callable[[Any], Any] | None = None,
        val_prefix: str = "val",
        config: RecordConfig | None = None,
        **options,
    ):
        self.run_dir, self.build_fn, self.sample_ids, self.val_prefix = run_dir, build_fn, sample_ids, val_prefix
        # The framework steps the scheduler, and on resume restores its own checkpoint.
        self.config = RecordConfig.of(config, **{**options, "step_scheduler": False, "restore": False})
        self.rec: Recorder | None = None
        self._micro: _common.MicroBatches | None = None  # the running step's, with accumulation
        self._scheduler_count: int | None = None
        self._warned_scheduler = False

    # --- set-up ---------------------------------------------------------------------------

    def on_train_start(self, trainer, pl_module) -> None:
        why = not_recorded(trainer)
        if why:
            warnings.warn(f"ckptlab: {why}; recording nothing", stacklevel=2)
            return
        for problem in _replay_limits(trainer, pl_module):
            warnings.warn(
                f"ckptlab: {problem}; recording anyway (health, alerts, checkpoints and dirty work; "
                "replay will not be exact)",
                stacklevel=2,
            )
        optimizer, scheduler = _recorded_optimizers(trainer, pl_module)
        self.rec = Recorder(
            self.run_dir,
            pl_module,
            optimizer,
            step_fn=training_step,
            build_fn=self.build_fn,
            scheduler=scheduler,
            scaler=getattr(trainer.precision_plugin, "scaler", None),
            config=_common.with_trackers(self.config, trainer.loggers),
        )

    # --- one step -------------------------------------------------------------------------

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.rec is None:
            return
        ids = _sample_ids(batch, self.sample_ids)
        k = trainer.accumulate_grad_batches
        if k == 1:  # one batch, one step
            self.rec.begin_step(
                {"batch": batch, "batch_idx": batch_idx, "lightning": self._config(trainer, batch_idx)}, ids
            )
            return
        # Gradient accumulation: the step begins with its first micro-batch (its checkpoint and
        # RNG states); its batch, the micro-batches together, is recorded before the last runs.
        if not self.rec.in_step:
            self.rec.begin_step()
            self._micro = _common.MicroBatches()
        micro = self._micro
        assert micro is not None  # made as the step began, with its first micro-batch
        micro.add({"batch": batch, "batch_idx": batch_idx}, ids)
        last = not trainer.fit_loop._should_accumulate()  # the optimizer steps after this one
        accumulating(self.rec.optimizer, not last)  # pre-clip gradient norms: measured once, on the last
        if last:
            micro.record(self.rec, {"lightning": self._config(trainer, batch_idx, k)})

    def _config(self, trainer, batch_idx: int, accumulate: int = 1) -> dict:
        """How the trainer finishes the step whose last batch is `batch_idx` (under manual
        optimization: the step's own code steps the optimizers and schedulers)."""
        manual = not trainer.lightning_module.automatic_optimization
        scheduler = not manual and _scheduler_steps(trainer, batch_idx)
        self._scheduler_count = _scheduler_count(trainer)
        self._predicted_scheduler_step = scheduler
        algorithm, clip_val = trainer.gradient_clip_algorithm, trainer.gradient_clip_val
        config = {
            "epoch": trainer.current_epoch,
            # as the trainer passes them to configure_gradient_clipping (None: not set)
            "gradient_clip_val": None if clip_val is None else float(clip_val),
            "gradient_clip_algorithm": None if algorithm is None else str(getattr(algorithm, "value", algorithm)),
            "scheduler_step": scheduler,
            "precision": str(trainer.precision),
        }
        if accumulate != 1:
            config["accumulate_grad_batches"] = accumulate
        if manual:
            config["manual"] = True
        config.update(strategy_config(trainer))
        return config

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.rec is None or not self.rec.in_step:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if trainer.accumulate_grad_batches != 1:
            micro = self._micro
            assert micro is not None  # made as the step began (on_train_batch_start)
            micro.add_loss(loss)  # already divided by accumulate_grad_batches
            if not micro.recorded:
                return  # more micro-batches to come
            loss = micro.loss
        # loss None: training_step returned nothing. Under manual optimization its optimizers
        # stepped all the same; under automatic optimization Lightning ran no backward, and the
        # optimizer's step found no gradient (yet the RNG draws of the forward and the
        # scheduler's step are the step's). Either way it is a step: recorded with its loss
        # not known, so that replay goes through it as the trainer did.
        self._check_scheduler(trainer)
        _common.end_step(self.rec, loss)

    def _check_scheduler(self, trainer) -> None:
        """The scheduler step predicted at batch start must be what the trainer did (under
        manual optimization, training_step steps them: replay runs it)."""
        if not trainer.lightning_module.automatic_optimization:
            return
        count = _scheduler_count(trainer)
        stepped = count is not None and self._scheduler_count is not None and count != self._scheduler_count
        if stepped != self._predicted_scheduler_step and not self._warned_scheduler:
            self._warned_scheduler = True
            warnings.warn(
                "ckptlab: the LR scheduler stepped where ckptlab did not predict it; replay will not match "
                "the record bit for bit",
                stacklevel=2,
            )

    # --- validation and end ---------------------------------------------------------------

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.rec is None or trainer.sanity_checking:
            return
        metrics = _common.scalar_metrics(trainer.callback_metrics, lambda k: k.startswith(self.val_prefix))
        if metrics:
            self.rec.log_validation(**metrics)

    def on_train_end(self, trainer, pl_module) -> None:
        self.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self.rec is not None and self.rec.in_step:
            if self._micro is not None and not self._micro.recorded:  # crashed before its last micro-batch
                cfg = self._config(trainer, self._micro.parts[-1]["batch_idx"], trainer.accumulate_grad_batches)
                self._micro.record(self.rec, {"lightning": {**cfg, "optimizer_step": False}})
            self.rec.abort_step(exception)  # the batch stays recorded: a crashing step can be replayed
        self.close()

    def close(self) -> None:
        if self.rec is not None:
            self.rec.close()


# --- build and replay ----------------------------------------------------------------------


def build(module, optimizer=None, scheduler=None, *, precision: str | None = None, tensor_parallel_size: int = 1):
    """`(module, optimizer[, scheduler][, scaler])` for build_fn, from
    `module.configure_optimizers()` (the same parsing the trainer does) unless you pass them.
    A module with a `configure_model` (ModelParallelStrategy's) is first sharded by it on the
    strategy's device mesh, (world / tensor_parallel_size, tensor_parallel_size): give the
    trainer's `tensor_parallel_size` (lightning_strategy.py `configure_model`).
    Registers the scheduler, which `training_step` steps where the recorded trainer did.
    Under manual optimization (`module.automatic_optimization = False`) with several
    optimizers: `(module, [optimizers], [each one's scheduler or None])`, as the callback
    records them; the schedulers are registered for `self.lr_schedulers()`.

    `precision="16-mixed"`, as the trainer was given it (or its MixedPrecision plugin): also a
    GradScaler, as Lightning makes one; its scale and settings come from the checkpoint."""
    if type(module).configure_model is not pl.LightningModule.configure_model:
        configure_model(module, tensor_parallel_size)
    if optimizer is None:
        parse = importlib.import_module(f"{pl.__name__}.core.optimizer")._configure_optimizers  # the trainer's parser
        optimizers, schedulers, _ = parse(module.configure_optimizers())
        found = [c["scheduler"] if isinstance(c, dict) else c for c in schedulers]
        if not module.automatic_optimization and len(optimizers) > 1:  # training_step drives them
            for opt in optimizers:
                _common.register(opt, lr_schedulers=found)  # (for self.lr_schedulers())
            return module, optimizers, _per_optimizer(optimizers, found)
        if len(optimizers) != 1:
            raise RecordError(
                f"configure_optimizers returned {len(optimizers)} optimizers; ckptlab replays several under "
                "manual optimization (automatic_optimization = False), as Lightning runs them"
            )
        optimizer = optimizers[0]
        if schedulers:
            first = schedulers[0]
            scheduler = first["scheduler"] if isinstance(first, dict) else first
    scaler = None
    if precision is not None and str(precision) in ("16-mixed", "16"):  # 16: the older spelling
        scaler = torch.amp.GradScaler("cuda" if torch.cuda.is_available() else "cpu")
    _common.register(optimizer, scheduler=scheduler, scaler=scaler, lr_schedulers=[scheduler] if scheduler else [])
    return (module, optimizer, *(x for x in (scheduler, scaler) if x is not None))


def training_step(model, optimizer, batch):
    """One step of Lightning's automatic optimization, as the recorded trainer ran it, for each
    of its batches (one; or, with accumulate_grad_batches=k, its micro-batches in order):

    training_step (under autocast for bf16-mixed and 16-mixed), its loss divided by k; on the
    first batch, on_before_zero_grad + optimizer_zero_grad; on_before_backward + backward +
    on_after_backward (16-mixed: of the loss the GradScaler scaled). The last batch runs inside
    optimizer.step(closure), followed by on_before_optimizer_step and configure_gradient_clipping
    (16-mixed: on the gradients the scaler unscaled, then the scaler's step, which skips the
    update on inf/NaN gradients, and its update); then the LR scheduler steps when the trainer
    stepped it after this batch. Under DDP (recorded "strategy": "ddp") training_step runs
    through a DistributedDataParallel wrapper (`ddp_wrapper`), the micro-batches before the
    last under its no_sync, as DDPStrategy runs them. Returns the loss (with accumulation, the
    sum of the micro-batches' losses).
    """
    cfg = batch["lightning"]
    if cfg.get("manual"):
        return _manual_step(model, optimizer, batch, cfg)
    parts = batch.get(MICRO_BATCHES) or [{"batch": batch["batch"], "batch_idx": batch["batch_idx"]}]
    k = cfg.get("accumulate_grad_batches", 1)
    steps = cfg.get("optimizer_step", True)  # False: a step recorded as it crashed, before its last micro-batch
    scaler = None
    if cfg["precision"] == "16-mixed":
        scaler = _common.registered(optimizer, "scaler", required=True, hint=SCALER_HINT)
    check_mesh(model, cfg)
    ddp = ddp_wrapper(model, optimizer, cfg)
    total = None
    for i, part in enumerate(parts):
        last = steps and i == len(parts) - 1
        accumulating(optimizer, not last)  # the probe measures pre-clip gradient norms on the last only
        _common.restore_micro_rng(part)  # when something between micro-batches moved them
        # Lightning zeroes the gradients when batch_idx % k == 0: the first micro-batch of each step.
        closure = _closure(model, optimizer, part, cfg, k, first=i == 0, last=last, scaler=scaler, ddp=ddp)
        if last:
            stepping = optimizer if scaler is None else _ScaledOptimizer(optimizer, scaler)
            with _quiet_log():
                model.optimizer_step(cfg["epoch"], part["batch_idx"], stepping, closure)
        else:
            with no_sync(ddp):  # DDP: no all-reduce until the step's last micro-batch
                closure()
        if closure.loss is not None:
            total = _common.add_losses(total, closure.loss)
    if steps and cfg["scheduler_step"]:
        scheduler = _common.registered(optimizer, "scheduler", required=True, hint=BUILD_HINT)
        model.lr_scheduler_step(scheduler, None)
    return total


def _manual_step(model, optimizers, batch, cfg: dict):
    """One step of manual optimization: the module's training_step, which drives its
    optimizers through what `ReplayedTrainer` (lightning_manual.py) gives it, under the
    precision's autocast. Returns the loss it returned."""
    given = as_list(optimizers)
    schedulers = _common.registered(given[0], "lr_schedulers", required=False, hint=BUILD_HINT) or []
    wrap = importlib.import_module(f"{pl.__name__}.core.optimizer").LightningOptimizer
    trainer = ReplayedTrainer(model, given, schedulers, wrap)
    args = (batch["batch"], batch["batch_idx"]) if _takes_batch_idx(model) else (batch["batch"],)
    with trainer.attached(), _autocast(model, cfg["precision"]), _quiet_log():
        result = model.training_step(*args)
    return result.get("loss") if isinstance(result, dict) else result


def _closure(model, optimizer, part: dict, cfg: dict, k: int, *, first: bool, last: bool, scaler=None, ddp=None):
    """Lightning's closure for one batch: training_step (through the DDP wrapper `ddp`, when
    the trainer had one), zero_grad (first batch of the step), backward (of the scaled loss,
    with a GradScaler); on the step's last batch, the hooks before the update and gradient
    clipping (after unscaling, with a GradScaler). `closure.loss` is the loss it returned
    (divided by k)."""
    inputs, batch_idx, epoch = part["batch"], part["batch_idx"], cfg["epoch"]
    args = (inputs, batch_idx) if _takes_batch_idx(model) else (inputs,)

    def closure():
        with _autocast(model, cfg["precision"]), _quiet_log():
            result = call_through(run_training_step, model, ddp, args)
        loss = result.get("loss") if isinstance(result, dict) else result
        if first:
            call_through(model.on_before_zero_grad, optimizer)
            call_through(model.optimizer_zero_grad, epoch, batch_idx, optimizer)
        if loss is None:
            return None
        loss = loss / k  # ClosureResult normalizes by accumulate_grad_batches
        closure.loss = loss.detach()
        if scaler is not None:
            loss = scaler.scale(loss)  # MixedPrecision.pre_backward: the hooks see the scaled loss
        call_through(model.on_before_backward, loss)  # (the user's hooks: their exceptions are theirs)
        call_through(model.backward, loss)
        call_through(model.on_after_backward)
        if last:
            # MixedPrecision.optimizer_step unscales before the hooks and the clipping, unless
            # the optimizer unscales in its own step (fused: Lightning then refuses to clip).
            if scaler is not None and not getattr(optimizer, "_step_supports_amp_scaling", False):
                scaler.unscale_(optimizer)
            call_through(model.on_before_optimizer_step, optimizer)
            clip = cfg["gradient_clip_val"], cfg["gradient_clip_algorithm"]
            with _trainerless_clipping(model):
                call_through(model.configure_gradient_clipping, optimizer, *clip)
        return loss

    closure.loss = None  # type: ignore[attr-defined]  # a function's own attribute, which mypy does not model
    return closure


def _clip(optimizer, gradient_clip_val, gradient_clip_algorithm) -> None:
    """Lightning's Precision.clip_gradients: over the optimizer's parameters, group by group."""
    if not gradient_clip_val or gradient_clip_val <= 0:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)).lower() == "value":
        torch.nn.utils.clip_grad_value_(params, clip_value=gradient_clip_val)
    else:
        torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)


@contextlib.contextmanager
def _trainerless_clipping(model):
    """`LightningModule.clip_gradients` asks the trainer's precision plugin; replay has no
    trainer, so the module's own (or overridden) configure_gradient_clipping reaches `_clip`."""
    model.__dict__["clip_gradients"] = lambda optimizer, gradient_clip_val=None, gradient_clip_algorithm=None: _clip(
        optimizer, gradient_clip_val, gradient_clip_algorithm or "norm"
    )
    try:
        yield
    finally:
        model.__dict__.pop("clip_gradients", None)


class _ScaledOptimizer:
    """The optimizer `optimizer_step` steps under precision="16-mixed": `step(closure)` is
    Lightning's MixedPrecision.optimizer_step (the closure runs forward, scaled backward,
    unscale, hooks and clipping; then the GradScaler's step, which skips the update when the
    gradients hold inf/NaN, and its update). Anything else is the optimizer's."""

    def __init__(self, optimizer, scaler):
        self.optimizer, self.scaler = optimizer, scaler

    def step(self, closure=None, **kwargs):
        result = closure() if closure is not None else None
        if result is None:  # no backward ran (training_step returned None): nothing to step
            return None
        out = self.scaler.step(self.optimizer, **kwargs)
        self.scaler.update()
        return out

    def __getattr__(self, name):
        return getattr(self.optimizer, name)


def _autocast(model, precision: str):
    """MixedPrecision.forward_context: autocast to the precision's dtype, cache off."""
    dtype = AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    device = next((p.device.type for p in model.parameters()), "cpu")
    return torch.autocast(device, dtype=dtype, cache_enabled=False)


@contextlib.contextmanager
def _quiet_log():
    """`self.log` without a trainer warns on every call and does nothing: fine in replay."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*self\.log\(\)")
        yield


def _takes_batch_idx(model) -> bool:
    is_param_in_hook_signature = importlib.import_module(
        f"{pl.__name__}.utilities.signature_utils"
    ).is_param_in_hook_signature
    return is_param_in_hook_signature(model.training_step, "batch_idx", min_args=2)


# --- what the trainer will do after this batch ------------------------------------------------


def _scheduler_steps(trainer, batch_idx: int) -> bool:
    """Whether the trainer steps the (first) LR scheduler after this batch: Lightning's
    `_update_learning_rates` rule ("step" interval every `frequency` batches; "epoch"
    interval after the epoch's last batch, every `frequency` epochs; never ReduceLROnPlateau,
    which it steps after validation)."""
    configs = trainer.lr_scheduler_configs
    if not configs or configs[0].reduce_on_plateau:
        return False
    c = configs[0]
    if c.interval == "step":
        return (batch_idx + 1) % c.frequency == 0
    last = trainer.fit_loop.epoch_loop._num_ready_batches_reached()
    return bool(last) and (trainer.current_epoch + 1) % c.frequency == 0


def _scheduler_count(trainer) -> int | None:
    configs = trainer.lr_scheduler_configs
    return getattr(configs[0].scheduler, "last_epoch", None) if configs else None


def _recorded_optimizers(trainer, module):
    """(optimizer, scheduler) for the Recorder: the trainer's optimizer and first scheduler;
    under manual optimization with several optimizers, all of them as a list, with each one's
    scheduler (training_step steps them, so each one's state is what a checkpoint needs)."""
    configs = trainer.lr_scheduler_configs
    found = [c.scheduler for c in configs]
    if module.automatic_optimization or len(trainer.optimizers) == 1:
        return trainer.optimizers[0], found[0] if found else None
    return list(trainer.optimizers), _per_optimizer(trainer.optimizers, found)


def _per_optimizer(optimizers, schedulers) -> list:
    """Each optimizer's scheduler (the first whose `.optimizer` it is), or None."""
    return [next((s for s in schedulers if getattr(s, "optimizer", None) is o), None) for o in optimizers]


def _replay_limits(trainer, module) -> list[str]:
    """What keeps replay from being exact in this trainer's configuration."""
    problems = []
    manual = not module.automatic_optimization
    if manual and (str(trainer.precision) in ("16-mixed", "16") or trainer.world_size > 1):
        problems.append(
            "manual optimization with 16-mixed or several processes: replay runs training_step without "
            "the trainer's loss scaling and gradient all-reduce"
        )
    if str(trainer.precision) not in EXACT_PRECISIONS:
        problems.append(
            f"precision={trainer.precision!s} is not replayed (exact: {', '.join(sorted(EXACT_PRECISIONS))})"
        )
    per_optimizer = len(trainer.optimizers) if manual else 1  # (manual: one scheduler each is checkpointed)
    if len(trainer.lr_scheduler_configs) > per_optimizer:
        problems.append(
            f"{len(trainer.lr_scheduler_configs)} LR schedulers: only "
            + ("one per optimizer is" if manual else "the first is")
            + " checkpointed and replayed"
        )
    if len(trainer.optimizers) > 1 and not manual:
        problems.append(f"{len(trainer.optimizers)} optimizers: only the first is checkpointed")
    strategy = trainer.strategy
    if getattr(strategy, "_ddp_comm_hook", None) is not None or getattr(strategy, "_model_averaging_period", None):
        problems.append("a DDP communication hook or model averaging: replay all-reduces gradients as plain DDP does")
    return problems


def _sample_ids(batch, where):
    if where is None:
        return None
    if callable(where):
        return where(batch)
    if isinstance(batch, dict) and where in batch:
        return batch[where]
    raise RecordError(f"sample_ids={where!r}: the batch has no such key", hint="pass sample_ids=lambda batch: ... ")
