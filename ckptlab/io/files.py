"""Opening a file we are about to read: a regular file, or one clear error.

A run directory or checkpoint someone sent can hold a FIFO (opening it for reading waits for a
writer that never comes), a device (`/dev/zero` reads forever) or a folder where a file should
be. Every reader of run and checkpoint files (in io/ and run/) opens them here: without blocking, then refusing
anything that is not a regular file, as a CorruptFileError naming the path.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

from ckptlab.errors import CorruptFileError

_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def open_fd(path: str | os.PathLike, flags: int = 0) -> int:
    """A read-only file descriptor of the regular file `path` (CorruptFileError otherwise;
    OSError as open() raises it for a missing or unreadable file). `flags`: more os.O_* flags
    (O_DIRECT)."""
    fd = os.open(path, os.O_RDONLY | flags | _NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CorruptFileError(f"not a regular file ({_kind(mode)})", path=path)
        if _NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """`open(path, "rb")` for a regular file only."""
    return os.fdopen(open_fd(path), "rb")


def read_bytes(path: str | os.PathLike) -> bytes:
    """The whole of the regular file `path`."""
    with open_regular(path) as f:
        return f.read()


def read_text(path: str | os.PathLike) -> str:
    """The whole of the regular file `path`, as UTF-8 text."""
    return read_bytes(path).decode("utf-8")


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a file"
