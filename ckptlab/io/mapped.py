"""Tensors stored raw in a file at a known byte offset (safetensors, .pt zip records).

Two ways to read them:
- mapped (default): one read-only private mmap per file; a segment is a zero-copy view, and
  `release` drops its pages from this process (MADV_DONTNEED) so resident memory stays flat
  however big the file is; the page cache keeps them for the next reader.
- sequential: positioned reads (pread) into a reusable buffer. For network filesystems,
  where page faults are slow and a file changed under a mapping kills the process (SIGBUS).
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import numpy as np

from ckptlab import dtypes
from ckptlab.errors import CorruptFileError
from ckptlab.io.base import TensorRef
from ckptlab.io.files import open_fd

_PAGE = mmap.PAGESIZE


class MappedFile:
    """One open checkpoint file."""

    def __init__(self, path: str | os.PathLike, *, sequential: bool = False):
        self.path = Path(path)
        self.sequential = sequential
        self._fd = open_fd(self.path)
        self.size = os.fstat(self._fd).st_size
        self._mm: mmap.mmap | None = None
        self._lock = threading.Lock()

    def mapping(self) -> mmap.mmap:
        """The file's one mapping (made on first use; no page is read by making it)."""
        if self._mm is None:
            with self._lock:
                if self._mm is None:
                    # ACCESS_COPY (private, writable) rather than ACCESS_READ: torch.from_numpy
                    # warns on read-only arrays. Nothing writes; a write would stay private.
                    self._mm = mmap.mmap(self._fd, self.size, access=mmap.ACCESS_COPY)
        return self._mm

    def read(self, offset: int, nbytes: int, dtype: np.dtype, scratch: np.ndarray | None = None) -> np.ndarray:
        """Bytes [offset, offset + nbytes) as a 1-D numpy array of `dtype`."""
        dtype = np.dtype(dtype)
        count = nbytes // dtype.itemsize
        if offset < 0 or nbytes < 0:
            raise CorruptFileError(f"invalid byte range {offset}+{nbytes}", path=self.path)
        if nbytes == 0:
            return np.empty(0, dtype=dtype)
        if offset + nbytes > self.size:
            raise CorruptFileError(
                f"truncated: needs bytes up to {offset + nbytes}, the file has {self.size}", path=self.path
            )
        if not self.sequential:
            return np.frombuffer(self.mapping(), dtype=dtype, count=count, offset=offset)
        buf = scratch[:nbytes] if scratch is not None and scratch.size >= nbytes else np.empty(nbytes, dtype=np.uint8)
        view = memoryview(buf)  # type: ignore[arg-type]  # ndarray has the buffer protocol; numpy's stubs lack __buffer__
        done = 0
        while done < nbytes:  # pread releases the GIL; a short read means the file shrank
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n <= 0:
                raise CorruptFileError(f"truncated while reading: ended at byte {offset + done}", path=self.path)
            done += n
        return buf.view(dtype)

    def release(self, offset: int, nbytes: int) -> None:
        """Drop the pages of a range from this process (mapped mode only; page cache keeps them)."""
        if self._mm is None or nbytes <= 0 or not hasattr(self._mm, "madvise"):
            return
        start = offset - offset % _PAGE
        end = min(self.size, offset + nbytes)
        # Whole pages only; a page shared with a neighbour that is still being read just
        # faults back in from the page cache on its next touch.
        self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        # The mapping stays until the tensors viewing it are gone (closing it under a live view
        # would fail); it is unmapped when garbage-collected.
        self._mm = None


class FileTensor(TensorRef):
    """A contiguous tensor at a byte offset of a MappedFile; `dtype` is its name
    (`ckptlab.dtypes`), which `segment` reads in its numpy storage type without torch."""

    splittable = True

    def __init__(self, file: MappedFile, offset: int, shape, dtype: str):
        self.file = file
        self.offset = offset
        self.shape = tuple(shape)
        self.dtype = dtype
        self.itemsize = dtypes.itemsize(dtype)

    def load(self):
        """A torch tensor viewing the bytes (torch is imported here, when a caller wants one)."""
        raw = self.file.read(self.offset, self.nbytes, np.uint8)
        return dtypes.to_torch(self.dtype, raw).view(self.shape)

    def segment(self, start, count, scratch=None):
        size = self.itemsize
        return self.file.read(self.offset + start * size, count * size, dtypes.storage(self.dtype), scratch)

    def release(self, start, count):
        size = self.itemsize
        self.file.release(self.offset + start * size, count * size)

    @property
    def identity(self):
        return (str(self.file.path), self.offset, self.shape, self.dtype)
