"""RunWriter: appends a session's records and commits its checkpoints in the background.

The training thread only serializes (a snapshot of the batch, a copy of the state off the
device) and hands bytes to the kernel; checkpoint writes, fsync and retention run in one
background thread (which hashes a live checkpoint's files on a helper thread of the lowest
priority: run/checkpoint.py). At most one checkpoint is in flight: if the next one is due before the last finished,
the training thread waits (and the wait is reported as `ckpt_wait` in the step's health).
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ckptlab.errors import RecordError
from ckptlab.run import columns, framelog, records
from ckptlab.run.atomic import fsync_path
from ckptlab.run.checkpoint import CapturedState, TornSnapshot, commit_checkpoint
from ckptlab.run.layout import batches_dir, journal_dir, segment_name
from ckptlab.run.retention import apply_retention


@dataclass
class Retention:
    keep_last: int
    # -> (checkpoint steps that must survive, (first, last) step range whose batches must too):
    # the best-validation and last-healthy checkpoints, and the batches up to the first anomaly.
    protect: Callable[[], tuple[set[int], tuple[int, int] | None]]


def io_error(e: BaseException, what: str, run_dir: Path) -> RecordError | None:
    """A failed write as one line ("no space left on device while writing step 8 to ..."), or
    None when `e` is not an I/O error. safetensors reports them as "... (os error 28)"."""
    code = e.errno if isinstance(e, OSError) else None
    if code is None:
        found = re.search(r"\(os error (\d+)\)", str(e))
        if found is None:
            return None
        code = int(found.group(1))
    reason = {
        errno.ENOSPC: "no space left on device",
        errno.EDQUOT: "disk quota exceeded",
        errno.EFBIG: "file too large (a file size limit was hit)",
    }.get(code, os.strerror(code).lower())
    return RecordError(
        f"{reason} while {what}; everything recorded before this is intact",
        path=run_dir,
        hint="free space, then continue with Recorder(..., resume=True)",
    )


class RunWriter:
    """After the first failed write the writer stops (`failed`): appending after a torn frame
    would hide every later frame from readers. A new session (resume) starts new segments.
    A failure in the background surfaces at the next `check()` (the start of a step), so a
    step is either recorded whole or not started."""

    def __init__(self, run_dir: Path, session: int, rank: int = 0, *, journal: bool = True):
        self.run_dir = run_dir
        self.session = session
        self.rank = rank
        self._write_journal = journal
        self._batches: framelog.FrameWriter | None = None
        self._journal: framelog.FrameWriter | None = None
        self._first_step: int | None = None  # where the open segments start
        # The open journal segment's records as appended, for its summary (columns.py);
        # None: some record came without them (its summary is decoded from the frames).
        self._appended: tuple[list, list] | None = ([], [])
        self._batch_compress = records.Compressor()
        self._jobs: queue.Queue = queue.Queue()
        self._ckpt_slot = threading.Semaphore(1)  # at most one checkpoint in flight
        self._error: BaseException | None = None  # from the background thread, raised once
        self.failed: BaseException | None = None  # the first failed write; nothing is written after it
        self._thread = threading.Thread(target=self._work, name="ckptlab-writer", daemon=True)
        self._thread.start()

    # --- segments (training thread) ------------------------------------------------------

    def roll(self, first_step: int) -> None:
        """Start new segment files at `first_step` (a checkpoint or session start). Again at
        the same step (a step that failed before its batch was recorded begins again): the
        segments open are those, already."""
        if first_step == self._first_step:
            return
        old = [w for w in (self._batches, self._journal) if w is not None]
        old_journal = self._journal
        folders = [batches_dir(self.run_dir, self.rank)] + ([journal_dir(self.run_dir)] if self._write_journal else [])
        created = [new for folder in folders for new in _make_dirs(folder)]
        self._batches = self._open(folders[0] / segment_name(self.session, first_step))
        if self._write_journal:
            self._journal = self._open(folders[1] / segment_name(self.session, first_step))
        self._first_step = first_step
        for w in old:  # their fsync is durability for power loss; a kill cannot lose them
            self._submit(("close", w))
        if old_journal is not None:
            self._submit(("summarize", old_journal.path, self._appended))
        self._appended = ([], [])
        # The new files' and folders' names are durable only once their parent folder is synced.
        for folder in dict.fromkeys([*folders, *(new.parent for new in created)]):
            self._submit(("sync_dir", folder))

    def _open(self, path: Path) -> framelog.FrameWriter:
        try:
            return framelog.FrameWriter(path)
        except OSError as e:
            raise self._fail(e, f"creating {path.name}") from None

    def append_batch(self, step: int, payload: bytes) -> int:
        data, flags = self._batch_compress(payload)
        return self._append(self._batches, framelog.BATCH, step, data, flags)

    def append_step(self, step: int, payload: bytes, record: tuple[dict, dict] | None = None) -> int:
        """Step `step`'s record, encoded (`payload`); `record`: its (scalars, arrays) as
        encoded, kept (not copied: neither is changed after) for the segment's summary."""
        n = self._append(self._journal, framelog.STEP, step, payload, framelog.FLAG_SAFETENSORS)
        if self._appended is not None:
            if record is None:
                self._appended = None
            else:
                self._appended[0].append((step, *record))
        return n

    def append_json(self, kind: int, step: int, meta: dict) -> int:
        n = self._append(self._journal, kind, step, records.encode_json(meta), 0)
        if self._appended is not None:
            self._appended[1].append((kind, step, meta))
        return n

    def append_rank_event(self, step: int, meta: dict) -> int:
        """An event only this rank saw (its own step raised), in its batch log: ranks other
        than 0 write no journal (docs/run-format.md, "Several ranks")."""
        return self._append(self._batches, framelog.EVENT, step, records.encode_json(meta), 0)

    def _append(self, writer, kind, step, data, flags) -> int:
        if self.failed is not None:
            self.check()
        if writer is None:
            raise RecordError("the recording is closed", path=self.run_dir)
        try:
            return writer.append(kind, step, data, flags=flags, rank=self.rank)
        except OSError as e:
            raise self._fail(e, f"writing step {step} to {writer.path.name}") from None

    def _fail(self, e: OSError, what: str) -> RecordError:
        self.failed = io_error(e, what, self.run_dir) or RecordError(f"{e} while {what}", path=self.run_dir)
        return self.failed

    def check(self) -> None:
        """Raise a background failure (once), then refuse to go on after any failed write."""
        self.raise_pending()
        if self.failed is not None:
            problem = getattr(self.failed, "problem", None) or f"{type(self.failed).__name__}: {self.failed}"
            raise RecordError(
                f"recording stopped at an earlier failure: {problem}",
                path=self.run_dir,
                hint="continue with Recorder(..., resume=True)",
            )

    # --- checkpoints (background) --------------------------------------------------------

    def submit_checkpoint(self, captured: CapturedState, retention: Retention | None) -> float:
        """Queue a checkpoint commit; returns how long the training thread waited for the
        previous one (backpressure)."""
        t0 = time.perf_counter()
        self._ckpt_slot.acquire()
        waited = time.perf_counter() - t0
        try:
            self._submit(("checkpoint", captured, retention))
        except BaseException:
            self._ckpt_slot.release()
            raise
        return waited

    def _submit(self, job) -> None:
        self._jobs.put(job)

    def _work(self) -> None:
        captured = retention = None
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if job[0] == "close":
                    job[1].close(fsync=True)
                elif job[0] == "sync_dir":
                    fsync_path(job[1])
                elif job[0] == "summarize":  # derived: a summary not written costs readers time only
                    with contextlib.suppress(OSError):
                        columns.write_summary(job[1], job[2])
                elif job[0] == "checkpoint":
                    _, captured, retention = job
                    try:
                        commit_checkpoint(self.run_dir, captured)
                    except TornSnapshot:  # not committed: the Recorder saw it and takes another
                        retention = None
                    finally:
                        self._ckpt_slot.release()
                    if retention is not None:
                        apply_retention(self.run_dir, retention.keep_last, *retention.protect())
            except BaseException as e:  # noqa: BLE001 - surfaced on the training thread
                what = _describe(job)
                self._error = io_error(e, what, self.run_dir) or e
            finally:
                # Drop the job now: a checkpoint's snapshot (the whole training state in host
                # memory) would otherwise stay alive in these locals until the next job arrives.
                job = captured = retention = None
                self._jobs.task_done()

    def raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            self.failed = self.failed or err
            raise err

    def flush(self) -> None:
        """Wait for background work (checkpoint commits) to finish."""
        self._jobs.join()
        self.raise_pending()

    def close(self) -> None:
        for w in (self._batches, self._journal):
            if w is not None:
                self._jobs.put(("close", w))
        if self._journal is not None and self.failed is None:
            self._jobs.put(("summarize", self._journal.path, self._appended))
        self._batches = self._journal = None
        self._jobs.put(None)
        self._thread.join()
        self.raise_pending()


def _describe(job: tuple) -> str:
    """What a background job was doing, for its error message."""
    kind, target = job[0], job[1]
    if kind == "checkpoint":
        return f"writing checkpoint {target.step}"
    if kind in ("sync_dir", "summarize"):
        return f"{'syncing folder' if kind == 'sync_dir' else 'summarizing'} {target.name}"
    return f"closing {target.path.name}"


def _make_dirs(folder: Path) -> list[Path]:
    """mkdir -p; returns the folders it created, outermost first."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for new in reversed(missing):
        new.mkdir(exist_ok=True)
    return list(reversed(missing))
