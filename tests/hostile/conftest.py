"""The hostile corpus: each case is a damaged, foreign or malicious file built by its test.

Every case runs the real CLI in a child process under a memory limit (RLIMIT_AS) and a
timeout, and expects the standard for bad input: exit 1, one line on stderr naming the file
and the problem (no traceback, no "internal error"), the input's bytes unchanged, and time and
memory bounded by the bytes on disk.
"""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import subprocess
import sys
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


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def run_cli(*args, timeout: float = TIMEOUT) -> Result:
    """`python -m ckptlab ARGS` in a child process with bounded memory and time."""
    return run_python("-m", "ckptlab", *args, timeout=timeout)


def run_python(*args, timeout: float = TIMEOUT) -> Result:
    """`python ARGS` in a child process with bounded memory and time."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("CKPTLAB_DEBUG", None)
    env.pop("CKPTLAB_RUN", None)
    start = time.monotonic()
    p = subprocess.run(
        [sys.executable, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        preexec_fn=_limit_memory,
        cwd=ROOT,
    )
    return Result(p.returncode, p.stdout, p.stderr, time.monotonic() - start)


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
