"""The run lock: one process at a time changes a run.

    lock = acquire(run_dir, "recorder")    # RunLockedError naming the holder if it is taken
    ...                                    # record (or rewind)
    lock.release()                         # also: `with acquire(...):`

`RUN/.lock` is locked with `flock(2)` for as long as its holder works on the run: a Recorder
from its start (before it writes anything) until `close()`, and a rewind (`ckptlab rollback`)
while it moves files. The file holds JSON `{"pid", "host", "started", "holder"}` for messages
only: whether the run is locked is the kernel's flock, never the file's content. The kernel
releases a flock when its process dies (SIGKILL included), so a `.lock` left by a dead process
is not held and the next holder simply takes it. A holder removes the file when it releases
it (while still holding the flock; an acquirer that locked a file no longer at that path tries
again), so an idle run has no `.lock`.

Distributed training: only rank 0's Recorder holds the lock (one lock per run, whatever the
world size); the other ranks learn from rank 0 whether it was taken (record.py).

Readers (`info`, `replay`, `diff`, `dirty`, `report`, `rollback --dry-run`, `--to` exports)
never take the lock: they read only, and recording only appends and commits atomically.

Leases: what a reader of a live run holds against retention.

    lease = take_lease(run_dir, checkpoints=[35], steps=(35, 40))   # None: nobody records
    ...                                                              # read them
    lease.release()

While a Recorder holds the run, retention deletes old checkpoints and batch logs as the run
goes on. A reader that needs some of them for a while (a replay: its start checkpoint and
the batches up to its step) leases them: `RUN/.leases/<host>-<pid>-<n>.json` names them and
its holder keeps an exclusive flock on it; retention keeps whatever a live lease names, and
removes a lease whose flock is free (its reader died). A lease is taken, and retention
decides, under a flock on the `checkpoints/` folder (`guard`), so retention never deletes
what a lease taken before it names; what retention deleted before the lease, the reader
finds gone when it checks (after taking the lease) and reads the run again. Readers that
read everything (`info`, `report`, `dirty`) take no lease: a part retired while they read
it is left out of their answer, as if they had read a moment later.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import count
from pathlib import Path

from ckptlab.errors import CkptlabError
from ckptlab.run.layout import checkpoints_dir, leases_dir, lock_file

# What each kind of holder is called in a refusal: "<who> ... is <doing> this run".
HOLDERS = {
    "recorder": ("a Recorder", "recording", "stop it first"),
    "rollback": ("a rollback", "rewinding", "let it finish first"),
}


class RunLockedError(CkptlabError):
    """Another live process (a Recorder, a rollback) holds the run's lock."""

    def __init__(self, run_dir: Path, holder: dict):
        self.holder = holder
        who, doing, then = HOLDERS.get(str(holder.get("holder")), ("another process", "writing", "stop it first"))
        facts = []
        if holder.get("pid") is not None:
            facts.append(f"pid {holder['pid']}" + (f" on host {holder['host']}" if holder.get("host") else ""))
        if isinstance(holder.get("started"), (int, float)):
            facts.append("since " + _when(holder["started"]))
        detail = f" ({', '.join(facts)})" if facts else ""
        super().__init__(f"{who}{detail} is {doing} this run; {then}", path=run_dir)


class RunLock:
    """A held run lock. `release()` (or leaving a `with` block) gives it back; so does the
    process ending, and so does dropping the last reference to it."""

    def __init__(self, path: Path, fd: int, info: dict):
        self.path, self.info = path, info
        self._fd: int | None = fd
        self._finalizer = weakref.finalize(self, os.close, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:  # unlink while still holding the flock: nobody can take a file we are removing
            if _same_file(self.path, fd):
                self.path.unlink()
        except OSError:
            pass
        finally:
            self._finalizer.detach()
            os.close(fd)  # releases the flock

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(run_dir: str | os.PathLike, holder: str) -> RunLock:
    """Lock the run (its folder must exist) for `holder` ("recorder" or "rollback"), without
    waiting: RunLockedError naming the live holder if another process has it."""
    run_dir = Path(run_dir)
    path = lock_file(run_dir)
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    tries = 0
    while True:
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as e:  # ELOOP: a symlink where the lock file should be
            raise CkptlabError(f"cannot open the run lock ({e.strerror})", path=path) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _read(fd)
            os.close(fd)
            tries += 1
            if tries < 5:  # `holder()` holds it for an instant; a real holder holds it for good
                time.sleep(0.02)
                continue
            raise RunLockedError(run_dir, info) from None
        except BaseException:
            os.close(fd)
            raise
        if not _same_file(path, fd):  # its holder removed it as we opened it: lock the new one
            os.close(fd)
            continue
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "holder": holder}
        try:
            data = (json.dumps(info) + "\n").encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        except OSError:  # the content is only for messages; the flock is the lock
            pass
        return RunLock(path, fd, info)


def holder(run_dir: str | os.PathLike) -> dict | None:
    """Who holds the run's lock right now (its JSON), or None when nobody does. Changes
    nothing: takes and drops the flock on an existing lock file, creates none."""
    path = lock_file(Path(run_dir))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read(fd)
        return None
    finally:
        os.close(fd)  # (also drops our shared flock)


def check_unlocked(run_dir: str | os.PathLike) -> None:
    """RunLockedError if a live process holds the run's lock (a quick check before slow work;
    the holder of a change still acquires the lock itself)."""
    info = holder(run_dir)
    if info is not None:
        raise RunLockedError(Path(run_dir), info)


def _read(fd: int) -> dict:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _same_file(path: Path, fd: int) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


# --- leases ----------------------------------------------------------------------------------

_LEASE_NUMBERS = count()


class Lease:
    """A live reader's hold on some checkpoints and a range of batches (see the module doc)."""

    def __init__(self, path: Path, fd: int, holds: dict):
        self.path, self.holds = path, holds
        self._fd: int | None = fd
        self._finalizer = weakref.finalize(self, os.close, fd)

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            self.path.unlink()
            self.path.parent.rmdir()  # the last lease out leaves no folder behind
        except OSError:
            pass
        finally:
            self._finalizer.detach()
            os.close(fd)


@contextmanager
def guard(run_dir: Path) -> Iterator[bool]:
    """Leases are taken, and retention decides what to delete, one at a time: under an
    exclusive flock on the run's `checkpoints/` folder. Yields False (and holds nothing)
    when that folder cannot be opened (none yet: nothing to retire, nothing to lease)."""
    try:
        fd = os.open(checkpoints_dir(run_dir), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # (also drops the flock)


def take_lease(run_dir: Path, *, checkpoints: list[int], steps: tuple[int, int]) -> Lease | None:
    """Hold `checkpoints` and the batches of `steps` (first, last) against retention while a
    Recorder records the run; None when none does (nothing retires them then) or the run
    cannot be written here (a read-only copy: no Recorder writes it either)."""
    info = holder(run_dir)
    if info is None or info.get("holder") != "recorder":
        return None
    holds = {"checkpoints": sorted(set(checkpoints)), "steps": list(steps), "pid": os.getpid()}
    folder = leases_dir(run_dir)
    path = folder / f"{socket.gethostname()}-{os.getpid()}-{next(_LEASE_NUMBERS)}.json"
    with guard(run_dir) as guarded:
        if not guarded:
            return None
        try:
            folder.mkdir(exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, json.dumps(holds).encode())
        except OSError:
            os.close(fd)
            return None
    return Lease(path, fd, holds)


def live_leases(run_dir: Path) -> list[dict]:
    """What the live leases hold (call under `guard`); removes the leases of readers that died."""
    folder = leases_dir(run_dir)
    found = []
    for p in sorted(folder.iterdir()) if folder.is_dir() else []:
        try:
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # its reader holds it
            holds = _read(fd)
            if isinstance(holds.get("checkpoints"), list) and isinstance(holds.get("steps"), list):
                found.append(holds)
            continue
        except OSError:
            continue
        finally:
            os.close(fd)
        p.unlink(missing_ok=True)  # nobody holds it: its reader died
    return found
