"""The hostile corpus: each case is a damaged, foreign or malicious file built by its test.

Every case runs the real CLI in a child process under a memory limit (RLIMIT_AS) and a
timeout, and expects the standard for bad input: exit 1, one line on stderr naming the file
and the problem (no traceback, no "internal error"), the input's bytes unchanged, and time and
memory bounded by the bytes on disk. The children are forked from one process that imported
torch once (tests/hostile/zygote.py), so that a case does not pay torch's import.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_RUN = ROOT / "sample_ckpts" / "tinylm-nan"
MEMORY_LIMIT = 2 << 30  # RLIMIT_AS of the child: torch's import alone maps ~0.7 GiB
TIMEOUT = 30  # seconds


@dataclass
class Result:
    code: int
    out: str
    err: str
    seconds: float


def run_cli(*args, timeout: float = TIMEOUT) -> Result:
    """`python -m ckptlab ARGS` in a child process with bounded memory and time."""
    return run_python("-m", "ckptlab", *args, timeout=timeout)


def run_python(*args, timeout: float = TIMEOUT) -> Result:
    """`python ARGS` in a child process with bounded memory and time: a child forked from a
    process that has imported torch already (tests/hostile/zygote.py), under RLIMIT_AS."""
    return _zygote().run([str(a) for a in args], timeout)


class Zygote:
    def __init__(self):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        env.pop("CKPTLAB_DEBUG", None)
        env.pop("CKPTLAB_RUN", None)
        self.dir = Path(tempfile.mkdtemp(prefix="ckptlab-hostile-"))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from tests.hostile import zygote; zygote.serve({MEMORY_LIMIT})"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.dir / "zygote.err", "wb"),
            env=env,
            cwd=ROOT,
        )
        atexit.register(self.close)

    def _line(self, word: str) -> int:
        line = self.proc.stdout.readline().decode()
        assert line.startswith(word + " "), f"the zygote died: {(self.dir / 'zygote.err').read_text()[-3000:]}"
        return int(line.split()[1])

    def run(self, argv: list[str], timeout: float) -> Result:
        out, err = self.dir / "out", self.dir / "err"
        start = time.monotonic()
        self.proc.stdin.write((json.dumps({"argv": argv, "out": str(out), "err": str(err)}) + "\n").encode())
        self.proc.stdin.flush()
        pid = self._line("pid")
        timer = threading.Timer(timeout, _kill, (pid,))
        timer.start()
        status = self._line("exit")
        timer.cancel()
        seconds = time.monotonic() - start
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL and seconds >= timeout:
            raise subprocess.TimeoutExpired(["python", *argv], timeout)
        return Result(os.waitstatus_to_exitcode(status), out.read_text(), err.read_text(), seconds)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_ZYGOTE: Zygote | None = None


def _zygote() -> Zygote:
    global _ZYGOTE
    if _ZYGOTE is None or _ZYGOTE.proc.poll() is not None:
        _ZYGOTE = Zygote()
    return _ZYGOTE


def tree_hash(path: Path) -> dict[str, str]:
    """sha256 of every file under `path` (or of `path` itself), by relative name."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def refused(target: Path, *args, names: str, says: str | None = None) -> Result:
    """Run the CLI on a hostile input and check the standard for bad input.

    names: text that the one error line must contain (the damaged file's name); says: the
    problem it must mention."""
    before = tree_hash(target)
    r = run_cli(*args)
    assert tree_hash(target) == before, "the input was modified"
    assert "Traceback" not in r.err and "internal error" not in r.err, r.err
    assert r.code == 1, (r.code, r.out[-2000:], r.err[-2000:])
    errors = [line for line in r.err.splitlines() if line.startswith("ckptlab: error:")]
    assert len(errors) == 1, r.err
    assert names in errors[0], errors[0]
    if says is not None:
        assert says in errors[0], errors[0]
    return r


API_CALL = """
import sys
import ckptlab
from ckptlab.errors import CkptlabError
try:
    {call}
except CkptlabError as e:
    print(type(e).__name__ + ": " + str(e), file=sys.stderr)
    sys.exit(1)
"""


def refused_by_api(target: Path, call: str, *, names: str, says: str | None = None, error: str = "CorruptFileError"):
    """Like `refused`, for a library call (a Python statement) run in a bounded child process."""
    before = tree_hash(target)
    r = run_python("-c", API_CALL.format(call=call))
    assert tree_hash(target) == before, "the input was modified"
    assert r.code == 1, (r.code, r.out[-2000:], r.err[-2000:])
    line = r.err.strip()
    assert "\n" not in line and line.startswith(f"{error}: "), r.err
    assert names in line, line
    if says is not None:
        assert says in line, line
    return r


@pytest.fixture
def sample_run(tmp_path) -> Path:
    """A copy of the sample run (a real recording, 4 MB), to damage."""
    dest = tmp_path / "run"
    shutil.copytree(SAMPLE_RUN, dest)
    return dest
