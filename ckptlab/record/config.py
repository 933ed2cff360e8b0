"""RecordConfig: how a Recorder records, as one frozen value (the options `Recorder(...)` and
the framework callbacks take). Options with a fixed set of values are typed `Literal[...]`,
and those types are the one place the allowed values are written down: `__post_init__`
checks every such option against them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Literal, get_args, get_origin, get_type_hints

from ckptlab.errors import RecordError
from ckptlab.trackers.tracker import TrackerSpec


@dataclass(frozen=True)
class RecordConfig:
    """How a Recorder records: the options `Recorder(...)` and both framework callbacks take
    (as keywords, or as one `config=RecordConfig(...)`).

    Args:
        ckpt_every: steps between checkpoints (a checkpoint also starts every session).
        health_every: steps between update-ratio / weight-norm measurements; grad norms, loss
            and lr are recorded every step.
        update_ratio: "sampled" (default: ||dw|| estimated from a fixed sample of at most
            4096 elements per tensor, extra memory <= 1% of the parameter bytes) or "exact"
            (a copy of every parameter on the measured steps).
        health_read: "auto" (default: "deferred" on a CUDA model, "immediate" otherwise),
            "deferred" (step n's health is read and written when step n+1 ends: no device
            sync in a step; NonFiniteLoss comes one step late) or "immediate" (read as the
            step ends; NonFiniteLoss at the faulty step).
        keep_last: checkpoints kept by retention (plus best-validation and last-healthy).
        on_nonfinite: "raise" (NonFiniteLoss after recording; with the deferred read, at the
            end of the next step) or "record" (keep going).
        resume: continue an existing run (numbering continues; nothing is overwritten).
        restore: with `resume`, load the latest checkpoint (or a rollback's target) into
            model/optimizer/scheduler/scaler/RNG. Pass False if you restored them yourself.
        val_metric, val_mode: the validation metric that defines "best" ("min" or "max").
        keep_best: checkpoint the state whenever `val_metric` improves, so rollback can
            return to exactly the best-validation weights.
        data_info: facts about the data for `ckptlab dirty`, e.g. {"pad_id": 0, "vocab_size": 50257}.
        step_scheduler: call `scheduler.step()` after each step (False when step_fn, or the
            framework driving the loop, steps it itself; the scheduler is still checkpointed).
        batch_ref_bytes: with a `batch_fn`, batches of at least this many bytes are stored by
            reference (sample ids, sha256 of the content, size) instead of whole; replay
            rebuilds them with `batch_fn` and checks the digest. Smaller ones are stored whole.
        ckpt_snapshot: "live" (default): on a CPU model, a checkpoint is written from the
            parameters and the optimizer's state themselves, in the background, and the
            optimizer's next `step()` waits for each tensor's bytes as it updates it (for all
            of them with `foreach` or `fused`); the forward and backward passes come first,
            and the files are hashed, read back, at the lowest CPU priority over the next
            steps; no copy of the state is made.
            A tensor changed in place before it is written (outside the optimizer's step)
            is detected, the checkpoint is taken again at the next step by copy, and copies
            are used from then on. "copy": copy the state when checkpointing (always, on a
            GPU: it is staged to host memory).
        async_sharded: FSDP2, FSDP1, pipeline stages, DeepSpeed ZeRO: stage each rank's
            shards (ZeRO: partitions) to host memory and write them in the background
            (`torch.distributed.checkpoint.async_save`), committed at the start of the next
            step; False writes them on the training thread.
        on_anomaly: `callback(step, events)` after a step with an anomaly (non-finite loss,
            gradient or weight; loss or grad-norm spike: see analysis/spikes.py); "warn"
            (default) logs one warning per anomaly episode naming the replay command, and
            another when a worse kind joins it (a NaN after a spike: docs/alerts.md; logger
            `ckptlab.record.health`: on stderr unless logging is configured otherwise);
            None is silent. Events are recorded either way.
        trackers: MLflow / W&B runs that receive the health as it is recorded, batched off
            the training thread, with the warning's alerts: a list of
            `ckptlab.trackers.MLflow(...)` / `WandB(...)` (or wandb runs), or "auto" (the
            W&B / MLflow run already active in this process; the callbacks add the trainer's
            loggers). See docs/integrations.md.
    """

    ckpt_every: int = 500
    health_every: int = 10
    keep_last: int = 3
    on_nonfinite: Literal["raise", "record"] = "raise"
    resume: bool = False
    restore: bool = True
    val_metric: str = "val_loss"
    val_mode: Literal["min", "max"] = "min"
    keep_best: bool = True
    data_info: dict | None = None
    step_scheduler: bool = True
    on_anomaly: Callable[[int, list[dict]], None] | Literal["warn"] | None = "warn"
    batch_ref_bytes: int = 1 << 20
    async_sharded: bool = True
    ckpt_snapshot: Literal["live", "copy"] = "live"
    trackers: TrackerSpec = ()
    update_ratio: Literal["sampled", "exact"] = "sampled"
    health_read: Literal["auto", "deferred", "immediate"] = "auto"

    def __post_init__(self) -> None:
        if self.ckpt_every < 1 or self.health_every < 1:
            raise RecordError("ckpt_every and health_every must be >= 1")
        for name, allowed in _CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                listed = " or ".join(filter(None, (", ".join(map(repr, allowed[:-1])), repr(allowed[-1]))))
                raise RecordError(f"{name} must be {listed}, not {value!r}")
        if not (self.on_anomaly is None or self.on_anomaly == "warn" or callable(self.on_anomaly)):
            raise RecordError(f"on_anomaly must be a callback(step, events), 'warn' or None, not {self.on_anomaly!r}")

    @classmethod
    def of(cls, config: RecordConfig | None = None, **options) -> RecordConfig:
        """`config` (default: the defaults) with `options` replaced; RecordError naming an
        option that does not exist."""
        unknown = sorted(set(options) - {f.name for f in fields(cls)})
        if unknown:
            raise RecordError(f"unknown Recorder option(s) {', '.join(unknown)} (see ckptlab.RecordConfig)")
        return replace(config or cls(), **options)


# option -> its allowed values, read off the Literal types above (in the order written there)
_CHOICES: dict[str, tuple[str, ...]] = {
    name: get_args(hint) for name, hint in get_type_hints(RecordConfig).items() if get_origin(hint) is Literal
}
