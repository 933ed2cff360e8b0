"""The processes a distributed replay runs its ranks in: started as `spawn` starts them, without
each paying torch's import.

On Linux the ranks are forked from a fork server, Python's `multiprocessing` "forkserver": a
clean process this one starts the first time a replay needs ranks, which imports torch and
ckptlab's replay once and then forks one child a rank. A rank so started skips the ~2 s of CPU
a fresh interpreter spends importing them, and the server stays for this process's later
replays (the Python API in a notebook, a search that replays again), whose ranks then start in
a fraction of a second. Elsewhere the ranks are spawned (macOS spawns by default: forking after
its system frameworks are loaded is unsafe).

A forked rank is made what a spawned one would be:
- it takes this process's environment and fds 1 and 2 as they are when the replay starts, not
  the server's (kernel pins such as ATEN_CPU_CAPABILITY are read when a kernel first runs, after
  this; `--json` points fd 1 at stderr while it runs, so that the user's prints keep off the
  document). A variable that a library may read while it loads (LOADED_PREFIXES: thread pools,
  torch's settings, the dynamic linker's, Python's) differing from the server's starts a new
  server for the replay;
- it stops (SIGINT) when this process dies, as torch's parent-death signal stops a spawned
  rank: the server, its parent, outlives it;
- it runs the interpreter's exit handlers (`atexit`) and flushes C's stdio buffers when done:
  a forked child ends with `os._exit`.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

# What the server imports once, for every rank it forks: what a rank imports first.
PRELOAD = ["torch", "torch.distributed", "ckptlab.replayer.distributed", "ckptlab.stdio"]
# Variables a library may read while it loads (libgomp, MKL and oneDNN, torch's own, the dynamic
# linker, the interpreter, glibc's allocator): the server's must be this process's.
LOADED_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "ONEDNN_", "DNNL_", "TORCH", "LD_", "PYTHON", "GLIBC_", "MALLOC_")

_server_env: dict[str, str] | None = None  # the loaded-at-start variables of the server we started


def start_method() -> str:
    return "forkserver" if sys.platform.startswith("linux") else "spawn"


def run_ranks(fn: Callable[..., None], args: tuple, nprocs: int) -> None:
    """`fn(rank, *args)` in `nprocs` new processes, until all return; raises as torch's
    `start_processes` does when one fails (the others are stopped)."""
    import torch.multiprocessing as mp

    method = start_method()
    if method == "forkserver" and _server_ready():
        args = (fn, _Parent(), *args)
        fn = _as_spawned
    else:
        method = "spawn"
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method=method)


def _server_ready() -> bool:
    """The fork server is (or, when the first rank starts, will be) one whose loaded variables
    are this process's, preloading what a rank imports; False: spawn instead."""
    global _server_env
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is None or not hasattr(server, "_forkserver_pid") or not hasattr(server, "_stop"):
        return False  # (an interpreter whose server we cannot look after)
    loaded = {k: v for k, v in os.environ.items() if k.startswith(LOADED_PREFIXES)}
    if server._forkserver_pid is not None and loaded != _server_env:
        server._stop()  # (another's, or ours before the environment changed; its children go on)
    if server._forkserver_pid is None:
        preload = list(getattr(server, "_preload_modules", []))
        multiprocessing.set_forkserver_preload(preload + [m for m in PRELOAD if m not in preload])
        _server_env = loaded
    return True


class _Parent:
    """What a spawned child inherits from this process, sent to a forked one: the environment,
    and fds 1 and 2 (passed over the server's socket, as multiprocessing passes descriptors)."""

    def __init__(self) -> None:
        self.env = dict(os.environ)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple]:
        # (called while the rank's process is being started: DupFd hands the fd to it)
        fds = tuple(reduction.DupFd(fd) if _is_open(fd) else None for fd in (1, 2))
        return _Inherited, (self.env, fds)


class _Inherited:
    def __init__(self, env: dict[str, str], fds: tuple[Any, ...]) -> None:
        self.env, self.fds = env, fds

    def adopt(self) -> None:
        os.environ.clear()
        os.environ.update(self.env)
        for target, fd in zip((1, 2), self.fds):
            if fd is None:  # closed in this process: closed in a spawned one
                os.close(target)
                continue
            got = fd.detach()
            if got != target:
                os.dup2(got, target)
                os.close(got)


def _as_spawned(rank: int, fn: Callable[..., None], parent: _Inherited, *args: Any) -> None:
    import atexit

    from ckptlab.stdio import flush_c_stdio

    parent.adopt()
    _stop_with_parent()
    try:
        fn(rank, *args)
    finally:
        atexit._run_exitfuncs()  # (what an interpreter's exit would run)
        flush_c_stdio()


def _stop_with_parent() -> None:
    """SIGINT this rank when the process that started the replay dies (its end of the pipe
    that started this rank closes), as torch's parent-death signal does for a spawned rank."""
    import signal
    import threading
    from multiprocessing.connection import wait

    parent = multiprocessing.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    if sentinel is None:
        return

    def watch() -> None:
        wait([sentinel])
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, name="ckptlab-parent-watch", daemon=True).start()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
