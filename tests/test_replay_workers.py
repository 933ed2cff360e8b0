"""The processes a distributed replay starts for its ranks (ckptlab/replayer/workers.py): on Linux
forked from one server that has imported torch, yet each as a spawned process would be: with
this process's environment and standard streams as they are when the replay starts, stopped
when this process dies, its exit handlers run and C's buffers flushed when it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptlab.replayer import workers

ROOT = Path(__file__).resolve().parent.parent
forked = pytest.mark.skipif(workers.start_method() != "forkserver", reason="the ranks are spawned on this platform")


def say(rank: int, name: str) -> None:
    """A rank's work here: say what it sees, on fd 1 and fd 2 (as C code and child processes
    write) and through sys.stdout."""
    import torch

    seen = f"{name}={os.environ.get(name)} torch={'torch' in sys.modules} bad_fork={torch.cuda._is_in_bad_fork()}"
    line = f"rank {rank} sees {seen} server={os.getppid()}\n"
    os.write(1, line.encode())
    os.write(2, ("err " + line).encode())
    print("print", line, end="", flush=True)


def fail(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 failed here")


def _servers(text: str) -> set[str]:
    return {word.split("=")[1] for word in text.split() if word.startswith("server=")}


@forked
def test_ranks_see_the_environment_and_streams_of_the_replay_not_of_the_server(monkeypatch, capfd):
    monkeypatch.setenv("CKPTLAB_TEST_WORKERS", "first")
    workers.run_ranks(say, ("CKPTLAB_TEST_WORKERS",), 1)  # the server is running from here on
    first = capfd.readouterr()
    assert "rank 0 sees CKPTLAB_TEST_WORKERS=first torch=True bad_fork=False" in first.out, first
    monkeypatch.setenv("CKPTLAB_TEST_WORKERS", "second")
    saved = os.dup(1)
    try:
        os.dup2(2, 1)  # what `--json` does while it runs: fd 1 to stderr
        workers.run_ranks(say, ("CKPTLAB_TEST_WORKERS",), 2)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    out, err = capfd.readouterr()
    assert out == "", out  # nothing where the document goes
    for rank in (0, 1):
        assert f"rank {rank} sees CKPTLAB_TEST_WORKERS=second torch=True" in err, err  # torch: preloaded
        assert f"err rank {rank} sees CKPTLAB_TEST_WORKERS=second" in err
        assert f"print rank {rank} sees CKPTLAB_TEST_WORKERS=second" in err
    assert _servers(first.out) == _servers(err)  # ckptlab's own variables are read when used: one server


@forked
def test_a_variable_read_while_libraries_load_gets_a_new_server(monkeypatch, capfd):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    workers.run_ranks(say, ("OMP_NUM_THREADS",), 1)
    before = capfd.readouterr().out
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # (libgomp reads it when it loads: in the server)
    workers.run_ranks(say, ("OMP_NUM_THREADS",), 1)
    after = capfd.readouterr().out
    assert "OMP_NUM_THREADS=2" in after and len(_servers(before + after)) == 2, (before, after)


def test_a_rank_that_raises_stops_the_replay_with_its_error():
    import torch.multiprocessing as mp

    with pytest.raises(mp.ProcessRaisedException, match="rank 1 failed here"):
        workers.run_ranks(fail, (), 2)


# --- what a rank does at its end, and when the replaying process dies: seen from outside it ---

ENDING = """
import atexit, ctypes, sys
from ckptlab.replayer import workers

def rank(r, out):
    atexit.register(lambda: open(f"{out}/atexit{r}", "w").close())
    ctypes.CDLL(None).printf(b"printf from rank %d\\n", r)  # (C's stdout to a pipe: buffered)

if __name__ == "__main__":
    workers.run_ranks(rank, (sys.argv[1],), 2)
"""

ORPHANED = """
import os, sys, time
from ckptlab.replayer import workers

def rank(r, out):
    open(f"{out}/pid{r}.tmp", "w").write(str(os.getpid()))
    os.rename(f"{out}/pid{r}.tmp", f"{out}/pid{r}")  # (whole when the test sees it)
    time.sleep(120)

if __name__ == "__main__":
    workers.run_ranks(rank, (sys.argv[1],), 2)
"""


def _script(tmp_path: Path, text: str) -> list[str]:
    (tmp_path / "script.py").write_text(text)
    return [sys.executable, str(tmp_path / "script.py"), str(tmp_path)]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_a_rank_runs_its_exit_handlers_and_flushes_c_stdio(tmp_path):
    done = subprocess.run(_script(tmp_path, ENDING), env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(done.stdout.splitlines()) == ["printf from rank 0", "printf from rank 1"], done.stdout
    assert (tmp_path / "atexit0").exists() and (tmp_path / "atexit1").exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z" if sys.platform == "linux" else True


def test_the_ranks_stop_when_the_replaying_process_is_killed(tmp_path):
    parent = subprocess.Popen(_script(tmp_path, ORPHANED), env=_env(), stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"pid{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "a rank outlived the replay that started it"
    finally:
        parent.kill()
        for r in (0, 1):
            if (tmp_path / f"pid{r}").exists() and _alive(pid := int((tmp_path / f"pid{r}").read_text())):
                os.kill(pid, signal.SIGKILL)
