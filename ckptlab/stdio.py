"""The process's standard streams below Python's: what C code (an extension's printf) left in
its stdio buffers. Torch-free: the terminal (render/console.py) and a replay's ranks
(replayer/workers.py) both flush them."""

from __future__ import annotations


def flush_c_stdio() -> None:
    """fflush(NULL): C's buffered stdout (printf from an extension) written out now."""
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):  # no C library to call (Windows)
        pass
