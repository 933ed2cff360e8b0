"""Writing files so that a crash leaves the old version or the new one, never half of one.

    write_bytes_atomic(path, data)      # temp file beside it, fsync, rename over it, fsync the folder
    with atomic_file(path) as tmp:      # the same, for a writer that wants a path (h5py, copyfile)
        h5py.File(tmp, "w") ...
    rename_durably(src, dst)            # a file or folder moved, then its folder(s) fsynced
    write_synced(tmp / "COMMIT.json", data)   # a new file inside a temp folder, fsynced

A folder is committed by its owner (a checkpoint, an export, an archived checkpoint): it fills
a temp folder, fsyncs what it wrote and the folder, then calls `rename_durably`. The files a
run writes are opened for writing here and nowhere else (besides the O_DIRECT checkpoint
writes, the append-only journal segments and the run lock, which need their own flags).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def fsync_path(path: Path) -> None:
    """fsync a file or a folder by name (a folder's fsync makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rename_durably(src: Path, dst: Path) -> None:
    """Rename `src` to `dst` (a file, or a folder onto nothing or an empty folder), then fsync
    the folder it is now in, and the one it left if that is another."""
    os.rename(src, dst)
    fsync_path(Path(dst).parent)
    if Path(src).parent != Path(dst).parent:
        fsync_path(Path(src).parent)


@contextlib.contextmanager
def atomic_file(path: Path, *, durable: bool = True) -> Iterator[Path]:
    """A temp path beside `path` to write; once the block ends, it is fsynced and replaces
    `path`, and the folder is fsynced (`durable=False`: no fsync, whole or not at all still).
    If the block raises, the temp file is removed."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        if durable:
            fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_path(path.parent)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def write_derived(path: Path, data: bytes) -> None:
    """`data` at `path`, whole or not at all (a temp file renamed), not fsynced: for a file
    derived from others that readers do without when it is missing (a journal summary)."""
    with atomic_file(path, durable=False) as tmp, open(tmp, "wb") as f:
        f.write(data)


def write_json_atomic(path: Path, obj) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def write_synced(path: Path, data: bytes) -> None:
    """A new file (refused if `path` exists) holding `data`, fsynced: for a file inside a temp
    folder that is committed as a whole."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def create_new(path: Path) -> BinaryIO:
    """A new file (refused if `path` exists) opened for unbuffered writes; the caller fsyncs it."""
    return open(path, "xb", buffering=0)
