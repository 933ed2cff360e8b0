"""The hostile corpus's child processes: forked from one Python process that has imported torch
and the CLI once (torch's import is ~2 s of each case otherwise).

`python -c "from tests.hostile import zygote; zygote.serve(LIMIT)"` reads one JSON request a line
on stdin -- {"argv": ["-m", "ckptlab", ...] or ["-c", CODE], "out": PATH, "err": PATH} -- forks a
child that sends its stdout/stderr to those files, limits its address space (RLIMIT_AS) to LIMIT
bytes and runs `python ARGV` as a fresh interpreter would; it answers "pid N", then "exit STATUS"
(the waitpid status) when the child is done.
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import runpy
import sys
import traceback


def serve(memory_limit: int) -> None:
    import torch  # noqa: F401 - what every child would import first

    import ckptlab.cli  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, memory_limit)  # never returns
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {status}", flush=True)


def _child(request: dict, memory_limit: int) -> None:
    code = 1
    try:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, request["out"]), (2, request["err"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
        code = _run(request["argv"])
    except BaseException:  # noqa: BLE001 - as an uncaught exception in `python`: traceback, exit 1
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _run(argv: list[str]) -> int:
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            raise ValueError(f"zygote: expected -m MODULE or -c CODE, got {argv[:2]}")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    serve(int(sys.argv[1]))
