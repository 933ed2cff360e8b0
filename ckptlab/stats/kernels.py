"""The hot loop's machinery: chunk sizes, per-thread scratch buffers, and the sums and counts
that keep BLAS to one thread and release the GIL, so that pieces counted on several threads run
on several cores. Also how a piece arrives: a numpy array or a torch tensor, as counted."""

from __future__ import annotations

import sys
import threading

import numpy as np

from ckptlab import dtypes

# 128K elements: two float64 copies (1 MiB each) stay in a 2 MiB L2 while ~12 ops run over
# them; 32K costs ~25% more in per-op overhead, 512K spills to L3 (scripts/bench_diff.py).
CHUNK = 1 << 17
# Patterns are counted per block: one bincount of 1M codes amortises zeroing its 65536 bins;
# blocks under SMALL codes are counted with np.unique instead.
BLOCK = 1 << 20
SMALL = 1 << 14


class Workspace:
    """Per-thread scratch buffers, reused across pieces (no allocation in the hot loop)."""

    def __init__(self):
        self.f64 = [np.empty(CHUNK, dtype=np.float64) for _ in range(2)]
        self.f32 = [np.empty(CHUNK, dtype=np.float32) for _ in range(3)]
        self.same = np.empty(CHUNK, dtype=np.bool_)
        self.codes = np.empty(BLOCK, dtype=np.intp)


_local = threading.local()


def workspace() -> Workspace:
    ws = getattr(_local, "ws", None)
    if ws is None:
        ws = _local.ws = Workspace()
    return ws


def bincount(codes: np.ndarray, size: int) -> np.ndarray:
    """Elements per pattern code (int64[size]). numpy's bincount holds the GIL while it counts,
    so the other workers queue behind it: the conversion to intp, half its work, is done here
    without the GIL, and where torch is imported anyway (.pt inputs, a training process)
    torch's bincount, which releases it, counts. Never imports torch for this."""
    wide = workspace().codes[: codes.size]
    np.copyto(wide, codes)
    torch = _loaded_torch()
    if torch is not None:
        return torch.bincount(torch.from_numpy(wide), minlength=size).numpy()
    return np.bincount(wide, minlength=size)


def _loaded_torch():
    """torch when something else imported it (never imported here), else None."""
    if not _torch_counts:
        return None
    torch = sys.modules.get("torch")
    return torch if torch is not None and hasattr(torch, "bincount") else None


_torch_counts = True


def count_without_torch() -> None:
    """For a forked worker process (`ckptlab.io.stream`): count with numpy even where torch
    is loaded. torch's count is there to release the GIL, which a one-thread process does not
    need, and its thread pool is not to be used after a fork."""
    global _torch_counts
    _torch_counts = False


_ROW = 8192  # OpenBLAS runs a dot product of more than 10000 elements on all its threads:
# threads that spin against our own workers on a busy machine made `@` ~100x slower.
_vecdot = getattr(np, "vecdot", None) or (lambda x, y: np.einsum("ij,ij->i", x, y))  # numpy < 2


def sumsq(x: np.ndarray) -> float:
    """sum(x * x) of a float64 1-D array, with BLAS kept to one thread (rows of _ROW)."""
    n = x.size - x.size % _ROW
    head = float(_vecdot(x[:n].reshape(-1, _ROW), x[:n].reshape(-1, _ROW)).sum()) if n else 0.0
    return head + float(np.dot(x[n:], x[n:]))


def as_array(x) -> np.ndarray:
    """A 1-D numpy piece, from a numpy array or a torch tensor (converted without a copy)."""
    return x.reshape(-1) if isinstance(x, np.ndarray) else dtypes.to_numpy(x)[1]


def as_counted(name: str, x: np.ndarray) -> np.ndarray:
    """Integers and bools are counted as float32 (their patterns and sums are then exact
    enough; float64 keeps its own float64 sums)."""
    return x if name in dtypes.FLOATS else x.astype(np.float32)


def counted_dtype(name: str) -> str:
    """The dtype of a piece after `as_counted`."""
    return name if name in dtypes.FLOATS else "float32"
