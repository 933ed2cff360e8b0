"""The processes a distributed replay runs its ranks in: started as `spawn` starts them, without
each paying torch's import.

Where the platform has it (Linux, macOS), the ranks are forked from a fork server, Python's
`multiprocessing` "forkserver": a clean process this one starts the first time a replay needs
ranks, which imports torch and ckptlab's replay once and then forks one child a rank. A rank
so started skips the ~2 s of CPU a fresh interpreter spends importing them, and the server
stays for this process's later replays (the Python API in a notebook, a search that replays
again), whose ranks then start in a fraction of a second. Elsewhere the ranks are spawned.

A forked rank would have the server's environment and standard streams, as they were when the
server started. Each rank takes this process's instead, as they are when the replay starts,
which is what a spawned rank inherits: the environment (kernel pins such as
ATEN_CPU_CAPABILITY are read when a kernel first runs, after this) and fds 1 and 2 (`--json`
points fd 1 at stderr while it runs, so that the user's prints keep off the document). Only what
torch reads while it is imported comes from the environment the server started with.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

# What the server imports once, for every rank it forks: what a rank imports first.
PRELOAD = ["torch", "torch.distributed", "ckptlab.replayer.distributed"]


def start_method() -> str:
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def run_ranks(fn: Callable[..., None], args: tuple, nprocs: int) -> None:
    """`fn(rank, *args)` in `nprocs` new processes, until all return; raises as torch's
    `start_processes` does when one fails (the others are stopped)."""
    import torch.multiprocessing as mp

    method = start_method()
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(PRELOAD)  # (kept by a server already running)
        args = (fn, _Parent(), *args)
        fn = _as_spawned
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method=method)


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
            if fd is not None:
                got = fd.detach()
                if got != target:
                    os.dup2(got, target)
                    os.close(got)


def _as_spawned(rank: int, fn: Callable[..., None], parent: _Inherited, *args: Any) -> None:
    parent.adopt()
    fn(rank, *args)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
