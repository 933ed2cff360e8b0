"""Record a trainer that owns its loop: it builds its optimizer and DataLoader inside `run()`
and offers a callback after each step, nothing before it (minGPT's `Trainer`, many research
trainers). ckptlab begins each step at the model's forward, whose inputs are the batch, and
ends it from the trainer's callback; the Recorder is made at the first step, on the optimizer
the trainer has built by then.

    from ckptlab.integrations import owned_loop

    def step(model, optimizer, batch):        # module level: what the trainer does with one batch
        x, y = batch
        _, loss = model(x, y)
        model.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss

    def build():                              # module level: the model, and the optimizer run() makes
        model = GPT(model_config)
        return model, model.configure_optimizers(train_config)

    data = owned_loop.track_ids(train_dataset)   # the ids of the samples the trainer reads
    trainer = Trainer(train_config, model, data)
    with owned_loop.record("runs/gpt", model, lambda: trainer.optimizer, step_fn=step, build_fn=build,
                           sample_ids=data.take) as rec:
        trainer.add_callback("on_batch_end", lambda t: rec.end_step(t.loss))
        trainer.run()

A step begins at the first forward of the model in training mode with gradients on (an
evaluation or a generation in a callback, under `torch.no_grad()` or `model.eval()`, does not
begin one); its batch is what the forward was called with: the positional arguments (a tuple),
the keyword arguments (a dict), or both (`{"args": ..., "kwargs": ...}`): one forward a step
(a trainer that accumulates over several forwards needs `Recorder.begin_step`/`record_batch`).
A step that raises is kept with its batch when the `with` block ends, so it can be replayed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.data as tud

from ckptlab.analysis.batches import batch_rows
from ckptlab.errors import RecordError
from ckptlab.record import RecordConfig, Recorder
from ckptlab.training.sample_ids import sample_id


def record(run_dir, model: torch.nn.Module, optimizer, **kwargs) -> ForwardRecorder:
    """Record the training steps of `model` from its forward: see `ForwardRecorder`."""
    return ForwardRecorder(run_dir, model, optimizer, **kwargs)


class ForwardRecorder:
    """Begins each training step at `model`'s forward; `end_step(loss)` (from the trainer's
    callback after the optimizer step) ends it.

    Args:
        run_dir: the run directory.
        model: the module the trainer calls once per step.
        optimizer: the optimizer that steps, or a function that returns it once the trainer has
            built it (`lambda: trainer.optimizer`): called at the first step.
        step_fn, build_fn: module-level, as for `ckptlab.Recorder`: `step_fn(model, optimizer,
            batch)` does what the trainer does with one batch; replay runs it.
        sample_ids: a function that returns the sample ids of the batch the forward got (e.g.
            `track_ids(dataset).take`); None: no sample ids.
        scheduler: an LR scheduler, or a function that returns it (called at the first step,
            as `optimizer`); pass `step_scheduler=False` when the trainer steps it itself.
        scaler, batch_fn, config, **options: as for `ckptlab.Recorder`.
    """

    def __init__(
        self,
        run_dir,
        model: torch.nn.Module,
        optimizer,
        *,
        step_fn: Callable,
        build_fn: Callable,
        sample_ids: Callable[[], Any] | None = None,
        config: RecordConfig | None = None,
        **kwargs,
    ):
        self.run_dir, self.model, self._optimizer = run_dir, model, optimizer
        self._fns, self._sample_ids = {"step_fn": step_fn, "build_fn": build_fn}, sample_ids
        self._config, self._kwargs = config, kwargs
        self.rec: Recorder | None = None
        self._hook = model.register_forward_pre_hook(self._begin, with_kwargs=True)

    def _begin(self, module, args, kwargs) -> None:
        if not (module.training and torch.is_grad_enabled()) or (self.rec is not None and self.rec.in_step):
            return  # an evaluation, or a second forward within the step
        batch: Any = tuple(args) if not kwargs else dict(kwargs) if not args else {"args": args, "kwargs": kwargs}
        ids = self._ids(batch)
        if self.rec is None:  # the trainer has made its optimizer (and scheduler) by now
            optimizer, kwargs = _made(self._optimizer), dict(self._kwargs)
            if "scheduler" in kwargs:
                kwargs["scheduler"] = _made(kwargs["scheduler"])
            fns = self._fns
            self.rec = Recorder(
                self.run_dir,
                self.model,
                optimizer,
                step_fn=fns["step_fn"],
                build_fn=fns["build_fn"],
                config=self._config,
                **kwargs,
            )
        self.rec.begin_step(batch, ids)

    def _ids(self, batch):
        if self._sample_ids is None:
            return None
        ids = self._sample_ids()
        rows = batch_rows(batch, None)
        if rows is not None and len(ids) != rows:
            raise RecordError(
                f"sample ids: {len(ids)} for a batch of {rows} rows",
                path=self.run_dir,
                hint="the dataset must be read in this process (the DataLoader's num_workers=0) for "
                "track_ids to see the samples; or pass sample_ids=None",
            )
        return ids

    def end_step(self, loss):
        """The step's optimizer update is done: record its health (see `Recorder.end_step`)."""
        if self.rec is None or not self.rec.in_step:
            raise RecordError(
                "end_step without a step: no training forward of the model ran since the last one",
                path=self.run_dir,
                hint="pass the module the trainer calls (the model itself, not a copy)",
            )
        return self.rec.end_step(loss)

    @property
    def recorder(self) -> Recorder | None:
        """The Recorder, once the first step began."""
        return self.rec

    def close(self, error: BaseException | None = None) -> None:
        """Stop recording; a step still running (`error`: what it raised) keeps its batch."""
        self._hook.remove()
        if self.rec is None:
            return
        if self.rec.in_step:
            self.rec.abort_step(error)
        self.rec.close()

    def __enter__(self) -> ForwardRecorder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)


def _made(obj):
    """`obj`, or what it returns when it is a function (torch optimizers and schedulers are not
    callable)."""
    return obj() if callable(obj) else obj


def track_ids(dataset) -> FetchedIds:
    """`dataset` as it is, remembering the ids of the items read from it, for a trainer that
    makes its own DataLoader (ids cannot ride in its batches): `take()` returns the ids read
    since the last call, i.e. the batch the trainer just loaded. The DataLoader must read in
    this process (`num_workers=0`): items read by worker processes are not seen here."""
    return FetchedIds(dataset)


class FetchedIds(tud.Dataset):
    """See `track_ids`."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset
        self._read: list = []

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        item = self.dataset[i]
        self._read.append(sample_id(self.dataset, i))
        return item

    def __getattr__(self, name: str):  # the dataset's own methods (a vocabulary size, ...)
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def take(self) -> list:
        """The ids read since the last call, in the order read."""
        ids, self._read = self._read, []
        return ids


__all__ = ["FetchedIds", "ForwardRecorder", "record", "track_ids"]
