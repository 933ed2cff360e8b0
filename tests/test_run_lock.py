"""The run lock (run/lock.py): one Recorder per run, rollback refused while one records,
readers unaffected, a lock left by a killed process taken over."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import ckptlab
from ckptlab.run import archive, lock
from ckptlab.run.lock import RunLockedError
from tests import models

ROOT = Path(__file__).resolve().parent.parent


def resume(run_dir, **kw) -> ckptlab.Recorder:
    model, opt = models.build_mlp()
    return ckptlab.Recorder(run_dir, model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp, resume=True, **kw)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = tmp_path_factory.mktemp("lock") / "run"
    models.record_run(
        path, models.build_mlp, models.step_mlp, models.mlp_batches(12), ckpt_every=5, keep_last=0, validate=validate
    )
    return path


def validate(i, model):
    """A made-up validation curve, best (0) at step 6: rollback chooses checkpoint 6."""
    return {"val_loss": float(abs(i - 5))} if i % 2 == 1 else None


@pytest.fixture
def run_dir(recorded, tmp_path):
    shutil.copytree(recorded, tmp_path / "run")
    return tmp_path / "run"


def test_a_second_recorder_in_the_same_process_is_refused_until_the_first_closes(run_dir):
    first = resume(run_dir)
    held = json.loads((run_dir / ".lock").read_text())
    assert (held["pid"], held["host"], held["holder"]) == (os.getpid(), socket.gethostname(), "recorder")
    with pytest.raises(RunLockedError) as refused:
        resume(run_dir)
    msg = str(refused.value)
    assert msg.startswith(f"{run_dir}: a Recorder (pid {os.getpid()} on host {socket.gethostname()}, since ")
    assert msg.endswith("is recording this run; stop it first") and "\n" not in msg
    assert isinstance(refused.value, ckptlab.CkptlabError)
    first.step(*next(models.mlp_batches(1)))  # the refused one changed nothing, the holder records on
    first.close()
    assert not (run_dir / ".lock").exists()  # released and removed
    with resume(run_dir) as again:
        assert again.next_step == 13


def test_a_new_run_is_locked_before_anything_is_written(run_dir, tmp_path):
    new = tmp_path / "new"
    model, opt = models.build_mlp()
    with ckptlab.Recorder(new, model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp):
        assert lock.holder(new)["pid"] == os.getpid()
        with pytest.raises(RunLockedError, match="is recording this run"):
            resume(new)
    assert lock.holder(new) is None


def test_the_lock_is_released_when_the_recorder_fails_to_start(run_dir):
    model, opt = models.build_lm()[:2]
    with pytest.raises(ckptlab.RecordError, match="differs"):
        ckptlab.Recorder(run_dir, model, opt, step_fn=models.step_lm, build_fn=models.build_lm, resume=True)
    assert lock.holder(run_dir) is None
    with pytest.raises(ckptlab.RecordError, match="already holds a run"):  # checked before locking
        ckptlab.Recorder(run_dir, *models.build_mlp(), step_fn=models.step_mlp, build_fn=models.build_mlp)
    resume(run_dir).close()


def test_rewind_is_refused_while_a_recorder_holds_the_run(run_dir, cli):
    with resume(run_dir):
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
            archive.rewind(run_dir, 5)
        r = cli("rollback", "--run", run_dir)
        assert r.code == 1 and "is recording this run; stop it first" in r.err
        assert len(r.err.strip().splitlines()) == 1 and "Traceback" not in r.err
        assert archive.unfinished_rollback(run_dir) is None and not (run_dir / "archive").exists()
        # reading is fine while it records
        assert cli("rollback", "--run", run_dir, "--dry-run").code == 0
        assert cli("info", "--run", run_dir).code == 0
    assert cli("rollback", "--run", run_dir).code == 0


def test_finishing_an_interrupted_rollback_is_refused_while_the_run_is_locked(run_dir, cli):
    real = os.rename
    calls = []

    def dying(*a, **k):
        calls.append(a)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    os.rename = dying
    try:
        with pytest.raises(KeyboardInterrupt):
            archive.rewind(run_dir, 5)
    finally:
        os.rename = real
    assert archive.unfinished_rollback(run_dir) is not None
    assert lock.holder(run_dir) is None  # released on the way out
    held = lock.acquire(run_dir, "rollback")  # another rollback, say
    try:
        with pytest.raises(RunLockedError, match="a rollback .* is rewinding this run; let it finish first"):
            archive.finish_interrupted(run_dir)
        r = cli("rollback", "--run", run_dir)
        assert r.code == 1 and "is rewinding this run" in r.err
    finally:
        held.release()
    assert cli("rollback", "--run", run_dir).code == 0
    assert archive.unfinished_rollback(run_dir) is None


class Holder:
    """A subprocess whose Recorder holds the run (tests/lock_holder.py)."""

    def __init__(self, run_dir: Path):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from tests import lock_holder; lock_holder.main()", str(run_dir)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        )
        line = self.proc.stdout.readline()
        assert line.startswith("ready"), self.proc.stderr.read()
        self.pid = int(line.split()[1])

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)


def test_another_process_holds_the_run_until_killed_then_its_stale_lock_is_taken(run_dir, cli):
    holder = Holder(run_dir)
    try:
        with pytest.raises(RunLockedError, match=f"a Recorder \\(pid {holder.pid} on host "):
            resume(run_dir)
        r = cli("rollback", "--run", run_dir)
        assert r.code == 1 and f"pid {holder.pid} on host {socket.gethostname()}" in r.err
        assert "is recording this run; stop it first" in r.err
        for args in (("rollback", "--dry-run"), ("info",), ("report",), ("dirty",)):
            assert cli(*args[:1], "--run", run_dir, *args[1:]).code == 0, args
        assert cli("replay", "--run", run_dir, "--step", 7).code == 0
    finally:
        holder.kill()
    assert holder.proc.returncode == -signal.SIGKILL
    stale = json.loads((run_dir / ".lock").read_text())
    assert stale["pid"] == holder.pid  # the file is still there, but nobody holds it
    assert lock.holder(run_dir) is None
    with resume(run_dir) as rec:  # a stale lock is simply taken
        assert json.loads((run_dir / ".lock").read_text())["pid"] == os.getpid()
        assert rec.next_step == 12
    r = cli("rollback", "--run", run_dir)
    assert r.code == 0, r.err


def test_a_holder_that_closes_releases_the_run(run_dir):
    holder = Holder(run_dir)
    holder.proc.stdin.write("close\n")
    holder.proc.stdin.flush()
    assert holder.proc.stdout.readline().strip() == "closed"
    holder.proc.wait(timeout=60)
    assert not (run_dir / ".lock").exists()
    resume(run_dir).close()


def test_a_symlinked_lock_file_is_refused(run_dir, tmp_path):
    (tmp_path / "elsewhere").write_text("")
    (run_dir / ".lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ckptlab.RecordError, match="cannot open the run lock"):
        resume(run_dir)
    assert (tmp_path / "elsewhere").read_text() == ""
