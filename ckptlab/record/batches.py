"""Each step's batch record: the batch (whole, or by reference with a `batch_fn`), its sample
ids, and the RNG states the step starts in -- only when they changed since the end of the
previous step (a DataLoader reseeding or augmentation in the loop moves them; otherwise
"unchanged" costs nothing). Appended before the step runs, so a step that crashes the process
still has its batch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckptlab.errors import RecordError
from ckptlab.run import records
from ckptlab.run.writer import RunWriter
from ckptlab.training.rng_state import rng_fingerprint
from ckptlab.training.state import capture_rng

WRITTEN = object()  # `BatchLog.pending_rng` when the running step's batch is written (or none runs)


class BatchLog:
    """The batch records of one session, and the RNG bookkeeping they need: the fingerprint
    of the states when the previous step ended, the states of the running step, and whether
    its batch is written yet."""

    def __init__(self, writer: RunWriter, run_dir: Path, batch_fn: Callable | None, ref_bytes: int):
        self.writer, self.run_dir = writer, run_dir
        self.batch_fn, self.ref_bytes = batch_fn, ref_bytes
        self._rng_after_prev: tuple | None = None  # rng_fingerprint() when the previous step ended
        self._force_rng = True  # record the next step's states whatever they are
        self.pending_rng: Any = WRITTEN  # the RNG states of a step whose batch is not yet written
        # The RNG states the running step began in, when changed or when its batch comes later
        # (begin_step without one: a checkpoint before record_batch gives them to the batch).
        self._step_rng: dict | None = None

    @property
    def written(self) -> bool:
        """The running step's batch is written (or no step runs)."""
        return self.pending_rng is WRITTEN

    def begin_step(self, *, forced: bool, keep_start: bool = False) -> None:
        """A step is about to start: the RNG states it starts in, kept for its batch record
        when they changed (or `forced`: a segment, and a replay, can start at a checkpoint, so
        its first batch carries them whatever they are); `keep_start`: kept anyway, for a
        checkpoint taken before the batch is recorded. Two fingerprints compared (~10 us);
        the states themselves are captured only when they are kept."""
        forced = forced or self._force_rng or self._rng_after_prev is None
        changed = forced or rng_fingerprint() != self._rng_after_prev
        rng = capture_rng() if changed or keep_start else None
        self.pending_rng = rng if changed else None
        self._step_rng = rng
        self._force_rng = False

    def force_rng(self) -> None:
        """A checkpoint was taken between steps: the next step's batch carries its RNG states."""
        self._force_rng = True

    def checkpoint_mid_step(self) -> None:
        """A checkpoint is taken mid-step (a validation between two micro-batches): the weights
        are those the step began with, the RNG states are not. A replay can start there, so the
        step's batch, not yet written, carries the states it began in."""
        if self.pending_rng is None:
            self.pending_rng = self._step_rng

    def append(self, n: int, batch: Any, sample_ids) -> None:
        """Step n's batch, sample ids and the RNG states `open` kept."""
        if sample_ids is not None:
            sample_ids = plain_ids(sample_ids)
        nbytes = records.batch_nbytes(batch) if self.batch_fn is not None else 0
        if self.batch_fn is not None and nbytes >= self.ref_bytes:
            if sample_ids is None:
                raise RecordError(
                    f"step {n}: a batch stored by reference needs its sample_ids (batch_fn rebuilds it from them)",
                    path=self.run_dir,
                )
            digest = records.batch_digest(batch)
            payload = records.encode_batch_ref(n, digest, nbytes, sample_ids, self.pending_rng)
        else:
            payload = records.encode_batch(n, batch, sample_ids, self.pending_rng)
        self.writer.append_batch(n, payload)
        self.pending_rng = WRITTEN

    def drop(self) -> None:
        """The step failed: a batch not yet written is not recorded."""
        self.pending_rng = WRITTEN

    def step_ended(self) -> None:
        """A step ended: what the next one compares its RNG states against."""
        self._rng_after_prev = rng_fingerprint()


def plain_ids(ids) -> list:
    """Sample ids as a JSON list of ints/strings (a tensor or array of ids is accepted)."""
    if type(ids) in _SEQUENCES and _PLAIN.issuperset(map(type, ids)):
        return list(ids)  # the common case, checked without a Python loop (once a step)
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    elif hasattr(ids, "tolist"):
        ids = ids.tolist()
    out = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, (int, str)):
            if hasattr(i, "item"):
                i = i.item()
            elif isinstance(i, bytes):
                i = i.decode("utf-8", "replace")
            else:
                i = str(i)
        out.append(i)
    return out


_SEQUENCES = (list, tuple)
_PLAIN = frozenset((int, str))  # exactly: a bool, an IntEnum or a str subclass takes the loop
