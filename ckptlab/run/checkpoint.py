"""Checkpoints: committed atomically, verified by our own hashes.

A checkpoint folder `checkpoints/step-SSSSSSSSS/` holds
    model.safetensors   the model's state dict (plain safetensors: `safetensors.torch.load_file`
                        reads it; tied names are in metadata["ckptlab.aliases"])
    state.safetensors   optimizer, scheduler, grad scaler, RNG and execution settings
                        (tensors + codec spec in metadata["ckptlab"])
    COMMIT.json         step, session, reason, health, and every file's size and sha256

Commit protocol: write into `checkpoints/.tmp-...`, fsync each file, write COMMIT.json last,
fsync the folder, rename it into place, fsync `checkpoints/`. A kill at any instant leaves
either no `step-*` folder or a complete one. Integrity comes from the hashes, not from "it
parses": an interrupted safetensors write can leave a full-length file of zeros that loads.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.torch
import torch

from ckptlab.errors import CorruptFileError
from ckptlab.io.dcp import dcp_tree
from ckptlab.io.safetensors_file import ALIASES_KEY, load_safetensors, read_aliases
from ckptlab.run import codec
from ckptlab.run.atomic import create_new, fsync_path, rename_durably, write_synced
from ckptlab.run.commit import committed, read_commit, verify_files
from ckptlab.run.hashing import DIRECT_ALIGN, sha256_file, sha256_uncached
from ckptlab.run.layout import (
    COMMIT,
    DCP_DIR,
    MODEL_FILE,
    STATE_FILE,
    checkpoint_name,
    checkpoints_dir,
)
from ckptlab.run.records import META_KEY, layout


@dataclass
class CapturedState:
    """A training state ready to be written in the background: copied off the device, or
    (`live`) partly the training's own tensors, written before training may change them.

    `live` lists (tensor, version) pairs: tensors of the running training that the files are
    written from directly, with their version counters when captured. Training waits for
    `released` (set by `release()`, once their bytes are written) before it changes them, or
    tensor by tensor (`wait_copied`: the writer reports each one whose bytes it has, `copied`)."""

    step: int
    model: dict[str, torch.Tensor]
    aliases: dict[str, str]
    state_spec: Any
    state_tensors: dict[str, torch.Tensor]
    info: dict = field(default_factory=dict)  # reason, session, health... -> COMMIT.json
    live: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    released: threading.Event = field(default_factory=threading.Event)
    intact: bool | None = None
    # data_ptr -> (tensor, version) of the live tensors whose bytes the writer does not have
    # yet (made at its first use, under the lock); `_changed`: a live tensor had changed in
    # place when checked; `_updating`: the optimizer's step began before the release.
    _unwritten: dict[int, tuple[torch.Tensor, int]] | None = field(default=None, repr=False)
    _changed: bool = field(default=False, repr=False)
    _updating: bool = field(default=False, repr=False)
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)

    def release(self) -> bool:
        """The live tensors are written (or never will be): training may go on. Returns
        whether none of them changed in place since it was captured (a change outside the
        optimizer's step, which waits for them: the files would not hold step `step`).
        Idempotent; the version check is made at the first call."""
        with self._cond:
            if self.intact is None:
                # As late as possible: PyTorch bumps a version when the in-place op is done, so
                # an op under way while its tensor was copied shows only after the copy. Once
                # the optimizer's step began (begin_update checked every tensor then), only those
                # it may not have touched yet.
                checked = self._pending().values() if self._updating else self.live
                self.intact = not self._changed and all(t._version == v for t, v in checked)
                self.live, self._unwritten = [], {}
            self.released.set()
            self._cond.notify_all()
        return self.intact

    def begin_update(self) -> None:
        """The optimizer's step begins while the writer is still at work: a tensor changed in
        place by now changed outside it. From here on the step may change every tensor whose
        bytes the writer has (`copied`)."""
        with self._cond:
            if not self.released.is_set() and not self._updating:  # (a second step: its own changes)
                self._changed |= any(t._version != v for t, v in self.live)
                self._updating = True

    def copied(self, ptr: int) -> None:
        """The writer has the bytes of the tensor whose data starts at `ptr` (on its thread)."""
        with self._cond:
            entry = self._pending().pop(ptr, None)
            if entry is not None:
                self._changed |= entry[0]._version != entry[1]
                self._cond.notify_all()

    def unwritten(self, ptrs) -> bool:
        """Whether the writer still lacks the bytes of any of the tensors starting at `ptrs`."""
        with self._cond:
            return self._lacks(ptrs)

    def wait_copied(self, ptrs) -> None:
        """Wait until the writer has the bytes of the tensors starting at `ptrs`."""
        with self._cond:
            self._cond.wait_for(lambda: not self._lacks(ptrs))

    def _lacks(self, ptrs) -> bool:
        pending = self._pending()
        return not self.released.is_set() and any(p in pending for p in ptrs)

    def _pending(self) -> dict[int, tuple[torch.Tensor, int]]:
        if self._unwritten is None:
            self._unwritten = {t.data_ptr(): (t, v) for t, v in self.live}
        return self._unwritten


class TornSnapshot(Exception):
    """A live tensor changed in place before it was written: the checkpoint was not committed."""

    def __init__(self, step: int):
        super().__init__(f"step {step}: a tensor changed in place while the checkpoint was written from it")
        self.step = step


def commit_checkpoint(run_dir: Path, captured: CapturedState) -> dict:
    """Write and atomically commit one checkpoint; returns its COMMIT record. The captured
    state is released (training may change its live tensors) as soon as its bytes are in the
    files, before they are synced; TornSnapshot if a live tensor changed first.

    A live checkpoint's files are hashed after the release, read back from the disk on a
    thread of the lowest CPU priority: the optimizer's step waits for the bytes alone, and the
    hash (~2 of the ~2.7 CPU-seconds a 3 GB checkpoint costs) takes the CPU time training
    leaves idle over the following steps instead of stalling one. The hash is then of what
    the disk holds. A copied snapshot is hashed as it is written: nothing waits for it."""
    live = bool(captured.live)
    try:
        root = checkpoints_dir(run_dir)
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".tmp-{checkpoint_name(captured.step)}-{os.getpid()}-{time.monotonic_ns()}"
        tmp.mkdir()
        try:
            files = {
                MODEL_FILE: write_safetensors(
                    tmp / MODEL_FILE,
                    captured.model,
                    {"format": "pt", ALIASES_KEY: json.dumps(captured.aliases)},
                    hash=not live,
                    on_copied=captured.copied if live else None,
                ),
                STATE_FILE: write_state_file(tmp, captured, hash=not live, on_copied=captured.copied if live else None),
            }
            if not captured.release():
                raise TornSnapshot(captured.step)
            for name in files:
                fsync_path(tmp / name)
            unhashed = [name for name, record in files.items() if record["sha256"] is None]
            if unhashed:
                digests = at_lowest_priority(lambda: [hash_written(tmp / name) for name in unhashed])
                for name, digest in zip(unhashed, digests):
                    files[name]["sha256"] = digest
            return finish_commit(tmp, captured.step, files, captured.info)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        captured.release()  # never leave training waiting, whatever failed


def write_state_file(folder: Path, captured: CapturedState, **kw) -> dict:
    """state.safetensors; returns its {bytes, sha256} (not yet fsynced). `kw`: write_safetensors'."""
    return write_safetensors(
        folder / STATE_FILE, captured.state_tensors, {META_KEY: json.dumps(captured.state_spec)}, **kw
    )


def hash_written(path: Path) -> str:
    """sha256 of a checkpoint file once written: read back around the page cache if it was
    written that way (as write_safetensors does from DIRECT_MIN bytes)."""
    if _CAN_DIRECT and path.stat().st_size >= DIRECT_MIN:
        return sha256_uncached(path)
    return sha256_file(path)


def at_lowest_priority(fn: Callable[[], Any]) -> Any:
    """fn() on a thread of the lowest CPU priority (nice 19, a per-thread setting on Linux;
    elsewhere the usual priority): it runs on cores training leaves idle, and takes about 1.5%
    of a core from a busy one. Its own work must release the GIL (hashing, reads): a thread
    this low could hold the GIL while it waits for a core."""
    with ThreadPoolExecutor(1, thread_name_prefix="ckptlab-hash-back", initializer=_lowest_priority) as pool:
        return pool.submit(fn).result()


def _lowest_priority() -> None:
    if sys.platform.startswith("linux"):  # elsewhere a thread id is no PRIO_PROCESS target
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


# A checkpoint file is written in pieces of STREAM_CHUNK and hashed as it goes (no second
# read), on a second thread one piece behind (hashlib and file writes both release the GIL).
# A file of DIRECT_MIN bytes or more goes around the page cache where the OS allows (O_DIRECT,
# Linux): each piece is copied into one aligned buffer and written from it straight to the
# disk. Through the page cache the kernel first takes memory for every byte, copies it, and
# writes it back later: on a 2-core VM, 3.2 GB took 4.6 s and 4.4 CPU-seconds that way against
# 2.6 s and 2.7 CPU-seconds direct (scripts/bench_ckpt_write.py, docs/performance.md), CPU the
# training step shares. Elsewhere (macOS, Windows, a filesystem that refuses O_DIRECT) a file
# past STREAM_SYNC bytes is flushed and dropped from the page cache every STREAM_SYNC, so a
# few hundred MB of page cache serve the whole file (on a VM that hands freed memory back to
# its host, fresh memory costs ~2 s a GB).
STREAM_CHUNK = 32 << 20
STREAM_SYNC = 256 << 20
DIRECT_MIN = 64 << 20
_CAN_DROP = hasattr(os, "fdatasync") and hasattr(os, "posix_fadvise")  # (not on macOS or Windows)
_CAN_DIRECT = hasattr(os, "O_DIRECT")


def write_safetensors(
    path: Path, tensors: dict, metadata: dict[str, str], *, hash: bool = True, on_copied: Callable | None = None
) -> dict:
    """Write `tensors` as the safetensors file `safetensors.torch.save_file` writes; returns
    {bytes, sha256} of what was written (sha256 None with hash=False: the caller hashes the
    file later, `hash_written`). `on_copied(data_ptr)` is called as each tensor's bytes are
    out of its memory (written, or in the write buffer), with hash=False only: the hash reads
    the memory later. The caller fsyncs the file."""
    if hash:
        on_copied = None
    laid = layout(tensors, metadata)
    if laid is None:  # a dtype we do not lay out ourselves: the library writes it, we hash it
        safetensors.torch.save_file(tensors, path, metadata=metadata)
        return {"bytes": path.stat().st_size, "sha256": sha256_file(path) if hash else None}
    head, chunks = laid
    total = len(head) + sum(c.nbytes for c in chunks)
    if _CAN_DIRECT and total >= DIRECT_MIN:
        record = _write_direct(path, head, chunks, total, hash, on_copied)
        if record is not None:
            return record
    return _write_buffered(path, head, chunks, total, hash, on_copied)


def _pieces(head: bytes, chunks: list):
    """The file's bytes in order, as pieces of at most STREAM_CHUNK (views, no copies), each
    with the address of its chunk's data when it is the chunk's last piece (else None)."""
    for data in (head, *chunks):
        view = memoryview(data).cast("B")
        ends = data.ctypes.data if isinstance(data, np.ndarray) else None
        if not len(view):
            yield view, ends
        for i in range(0, len(view), STREAM_CHUNK):
            yield view[i : i + STREAM_CHUNK], ends if i + STREAM_CHUNK >= len(view) else None


class _Hasher:
    """sha256 of the pieces given in order, computed on its own thread at most one piece
    behind the writes (`enabled` False: nothing, and hexdigest() is None)."""

    def __init__(self, pool: ThreadPoolExecutor, enabled: bool = True):
        self.sha, self._pool = hashlib.sha256() if enabled else None, pool
        self._last: Future[None] | None = None

    def add(self, piece) -> None:
        if self.sha is None:
            return
        if self._last is not None:
            self._last.result()
        self._last = self._pool.submit(self.sha.update, piece)

    def hexdigest(self) -> str | None:
        if self._last is not None:
            self._last.result()
        return None if self.sha is None else self.sha.hexdigest()


def _write_buffered(path: Path, head: bytes, chunks: list, total: int, hash=True, on_copied=None) -> dict:
    written = synced = 0
    with create_new(path) as f, ThreadPoolExecutor(1, thread_name_prefix="ckptlab-hash") as pool:
        fd, hasher = f.fileno(), _Hasher(pool, hash)
        for piece, ends in _pieces(head, chunks):
            hasher.add(piece)
            while piece:  # (a regular file takes it all; a signal may cut a write short)
                n = f.write(piece)
                piece, written = piece[n:], written + n
            if ends is not None and on_copied is not None:
                on_copied(ends)
            if total > STREAM_SYNC and written - synced >= STREAM_SYNC and _CAN_DROP:
                os.fdatasync(fd)
                os.posix_fadvise(fd, synced, written - synced, os.POSIX_FADV_DONTNEED)
                synced = written
        return {"bytes": written, "sha256": hasher.hexdigest()}


def _write_direct(path: Path, head: bytes, chunks: list, total: int, hash=True, on_copied=None) -> dict | None:
    """The file written with O_DIRECT from an aligned buffer of STREAM_CHUNK bytes (copied into
    with numpy, without the GIL); the last piece is padded to the alignment and the file cut to
    its size. None (and no file left) where the filesystem refuses direct writes: the caller
    writes it through the page cache."""
    # Two page-aligned buffers (as O_DIRECT needs): one is copied into while the other's write
    # is in flight, so the file takes max(copy, write) a piece, not their sum (a live
    # checkpoint's optimizer step follows the copies: docs/performance.md).
    bufs = [mmap.mmap(-1, STREAM_CHUNK) for _ in range(2)]
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as e:
        for b in bufs:
            b.close()
        if e.errno != errno.EINVAL:
            raise
        with contextlib.suppress(OSError):  # (created before the flag was refused, on some kernels)
            path.unlink()
        return None
    job = None
    try:
        with (
            ThreadPoolExecutor(1, thread_name_prefix="ckptlab-hash") as pool,
            ThreadPoolExecutor(1, thread_name_prefix="ckptlab-write") as writes,
        ):
            job = _DirectWrite(fd, bufs, writes, _Hasher(pool, hash), on_copied)
            for piece, ends in _pieces(head, chunks):
                job.add(piece, ends)
            record = job.finish()
    except OSError as e:
        os.close(fd)
        fd = -1
        with contextlib.suppress(OSError):
            path.unlink()
        if e.errno == errno.EINVAL and not (
            job and job.reported
        ):  # a filesystem that takes the flag but not the writes
            return None
        raise
    finally:
        if fd >= 0:
            os.close(fd)
        if job is not None:
            job.staged.clear()  # (no array may view a buffer when it is closed)
        for b in bufs:
            b.close()
    return record


class _DirectWrite:
    """One O_DIRECT write in progress: pieces are copied into one buffer while the other's
    write is in flight on `writes`."""

    def __init__(self, fd: int, bufs: list[mmap.mmap], writes: ThreadPoolExecutor, hasher: _Hasher, on_copied):
        self.fd, self.bufs, self.writes, self.hasher, self.on_copied = fd, bufs, writes, hasher, on_copied
        self.staged = [np.frombuffer(b, dtype=np.uint8) for b in bufs]
        self.cur = self.fill = self.written = 0
        self.in_flight: Future[int] | None = None  # the write of the other buffer
        # Tensors whose bytes are in a buffer, reported once a direct write has gone through:
        # until then the filesystem may refuse them (EINVAL), and the buffered path writes
        # every tensor again from its memory, which training may have changed by then if it
        # was told it could.
        self.unreported: list[int] | None = []
        self.reported = False  # training was told of a tensor: no second write from its memory

    def add(self, piece, ends: int | None) -> None:
        """Copy `piece` in, handing each full buffer over; report its tensor (`ends`) once copied."""
        self.hasher.add(piece)
        src, i = np.frombuffer(piece, dtype=np.uint8), 0
        while i < src.size:
            k = min(STREAM_CHUNK - self.fill, src.size - i)
            np.copyto(self.staged[self.cur][self.fill : self.fill + k], src[i : i + k])
            self.fill, i = self.fill + k, i + k
            if self.fill == STREAM_CHUNK:
                self._hand_over(STREAM_CHUNK)
                self.written += STREAM_CHUNK
                self.fill = 0
        if ends is not None and self.on_copied is not None:  # its bytes are in a write buffer
            if self.unreported is None:
                self.on_copied(ends)
                self.reported = True
            else:
                self.unreported.append(ends)

    def finish(self) -> dict:
        """The last piece written (padded), every write waited for, the file cut to its size."""
        if self.fill:
            padded = -(-self.fill // DIRECT_ALIGN) * DIRECT_ALIGN
            self.staged[self.cur][self.fill : padded] = 0
            self._hand_over(padded)
            self.written += self.fill
        if self.in_flight is not None:
            self.in_flight.result()
        self._accepted()
        if self.written % DIRECT_ALIGN:
            os.ftruncate(self.fd, self.written)
        return {"bytes": self.written, "sha256": self.hasher.hexdigest()}

    def _hand_over(self, n: int) -> None:
        if self.in_flight is not None:
            self.in_flight.result()  # the other buffer is free (its error, if any, raised here)
            self._accepted()
        self.in_flight = self.writes.submit(_write_all, self.fd, self.bufs[self.cur], n)
        self.cur ^= 1

    def _accepted(self) -> None:
        for ptr in self.unreported or ():
            self.on_copied(ptr)
            self.reported = True
        self.unreported = None


def _write_all(fd: int, buf: mmap.mmap, n: int) -> int:
    view, done = memoryview(buf), 0
    try:
        while done < n:  # (a short direct write leaves an aligned remainder)
            done += os.write(fd, view[done:n])
    finally:
        view.release()
    return n


def file_record(path: Path) -> dict:
    """Size and sha256 of a file written for a checkpoint, after fsync."""
    fsync_path(path)
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def finish_commit(tmp: Path, step: int, files: dict, info: dict) -> dict:
    """COMMIT.json last (fsync), then the folder (fsync), then rename into place (fsync the
    parent): before the rename there is no checkpoint, after it a complete one."""
    root = tmp.parent
    final = root / checkpoint_name(step)
    commit = {"format_version": 1, "step": step, "created": time.time(), "files": files, **info}
    write_synced(tmp / COMMIT, json.dumps(commit, indent=2).encode())
    for sub in {Path(name).parent for name in files} - {Path(".")}:
        fsync_path(tmp / sub)
    fsync_path(tmp)
    if final.exists():  # an orphan from a crashed session at the same step: set it aside
        rename_durably(final, root / f".superseded-{final.name}-{time.monotonic_ns()}")
    rename_durably(tmp, final)
    return commit


def clean_stale(run_dir: Path) -> None:
    """Remove the leftovers of a crash mid-commit or mid-delete (never a complete checkpoint)."""
    root = checkpoints_dir(run_dir)
    for stale in [*root.glob(".tmp-*"), *root.glob(".deleting-*")]:
        shutil.rmtree(stale, ignore_errors=True)


def retire_checkpoint(path: Path) -> Path:
    """Rename a checkpoint folder out of the run's listing (to a name no reader lists);
    returns where it went, for deleting. Rename first, then delete: a half-deleted folder
    never looks like a checkpoint."""
    doomed = path.with_name(f".deleting-{path.name}-{time.monotonic_ns()}")
    rename_durably(path, doomed)
    return doomed


@dataclass
class Checkpoint:
    step: int
    path: Path
    commit: dict

    @property
    def sharded(self) -> bool:
        """Written by FSDP training as a torch.distributed.checkpoint folder (`dcp/`)."""
        return self.commit.get("layout") == "sharded"

    @property
    def model_path(self) -> Path:
        """The model weights: model.safetensors, or the DCP folder of a sharded checkpoint."""
        return self.path / (DCP_DIR if self.sharded else MODEL_FILE)

    @property
    def reason(self) -> str:
        return self.commit.get("reason", "periodic")

    @property
    def nbytes(self) -> int:
        return sum(int(f["bytes"]) for f in self.commit["files"].values())

    def verify(self) -> None:
        """Check every file against the sha256 recorded at commit; IntegrityError otherwise."""
        verify_files(self.path, self.commit)

    def load_model(self, *, verify: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The full model state dict (a sharded checkpoint's shards assembled) and aliases."""
        if verify:
            self.verify()
        if self.sharded:
            return read_dcp(self.model_path).get("model", {}), {}
        try:
            tensors, metadata = load_safetensors(self.model_path)
        except OSError as e:
            raise CorruptFileError(f"unreadable safetensors ({e})", path=self.model_path) from None
        return tensors, read_aliases(metadata, self.model_path)

    def load_sharded(self, state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict]:
        """A sharded checkpoint's shards assembled in this process: (the whole model state dict,
        the optimizer state dict keyed by parameter name). `state`: its `load_state()`, which
        holds the optimizer's param_groups and any per-parameter state that is no tensor
        (`optimizer_scalars`, DeepSpeed FusedAdam's `step`), kept out of DCP."""
        tree = read_dcp(self.path / DCP_DIR)
        per_param = tree.get("optim", {}).get("state", {})
        for name, values in state.get("optimizer_scalars", {}).items():  # (not tensors: kept out of DCP)
            per_param.setdefault(name, {}).update(values)
        return tree.get("model", {}), {"state": per_param, "param_groups": state["param_groups"]}

    def load_state(self, *, verify: bool = True) -> dict[str, Any]:
        if verify:
            self.verify()
        path = self.path / STATE_FILE
        try:
            state = codec.decode(*read_state_file(path))
        except Exception as e:  # noqa: BLE001
            raise CorruptFileError(f"unreadable training state ({e})", path=path) from None
        if not isinstance(state, dict) or not isinstance(state.get("rng", {}), dict):
            raise CorruptFileError("unreadable training state (not the object a checkpoint holds)", path=path)
        return state


def read_state_file(path: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """(codec spec, tensors) of a state.safetensors, to `codec.decode`."""
    tensors, metadata = load_safetensors(path)
    return json.loads(metadata[META_KEY]), tensors


def read_dcp(folder: Path) -> dict:
    """Every tensor of a DCP folder, assembled whole in this process, as its nested tree."""
    tree, _, closers = dcp_tree(folder)
    try:
        return _materialize(tree)
    finally:
        for close in closers:
            close()


def _materialize(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _materialize(v) for k, v in node.items()}
    return node.load()


def load_captured(path: Path) -> CapturedState:
    """A committed checkpoint folder back as the in-memory state it was written from."""
    try:
        commit = read_commit(path)
    except ValueError as e:
        raise CorruptFileError(f"corrupt checkpoint ({e})", path=path / COMMIT) from None
    ckpt = Checkpoint(int(commit["step"]), path, commit)
    ckpt.verify()
    tensors, aliases = ckpt.load_model(verify=False)
    spec, state_tensors = read_state_file(path / STATE_FILE)
    return CapturedState(ckpt.step, tensors, aliases, spec, state_tensors, {})


def list_checkpoints(run_dir: Path) -> tuple[list[Checkpoint], list[str]]:
    """Committed checkpoints whose files are present at their committed sizes, and problems
    (commit.committed). Cheap (no hashing): `Checkpoint.verify()` does the full check before a
    checkpoint is used."""
    found, problems = committed(run_dir)
    return [Checkpoint(step, path, commit) for step, path, commit in found], problems
