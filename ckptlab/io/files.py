"""Opening a file we are about to read: a regular file, or one clear error.

A run directory or checkpoint someone sent can hold a FIFO (opening it for reading waits for a
writer that never comes), a device (`/dev/zero` reads forever) or a folder where a file should
be. Every reader of run and checkpoint files opens them here: without blocking, then refusing
anything that is not a regular file, as a CorruptFileError naming the path.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

from ckptlab.errors import CorruptFileError

_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def open_fd(path: str | os.PathLike) -> int:
    """A read-only file descriptor of the regular file `path` (CorruptFileError otherwise;
    OSError as open() raises it for a missing or unreadable file)."""
    fd = os.open(path, os.O_RDONLY | _NONBLOCK | getattr(os, "O_CLOEXEC", 0))
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
