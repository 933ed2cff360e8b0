"""Crash safety, for real: SIGKILL a recording process at many instants, then hold the run to
the run format's promise (docs/run-format.md) -- every step whose `rec.step()` returned has its batch (bit-exact) and
metrics, no partial checkpoint is listed, listed checkpoints verify, and a resumed session
continues the numbering without losing anything.

Kills come two ways (see crash_worker.py): from outside at a random instant, and from inside a
write -- a torn batch/journal frame or segment header, a torn checkpoint file or COMMIT.json,
just before each fsync of the commit, around its rename, half-way through retention -- which
are the windows a random instant rarely hits.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import ckptlab
from tests.run.bits import assert_same
from tests.run.crash_worker import KEEP_LAST, SITES, make_batch

ROOT = Path(__file__).resolve().parents[2]
KILLS = 21  # three of each site


@dataclass
class Session:
    status: int | None = None
    ready: int | None = None  # the session's first step number, as the child saw it
    steps: list[int] = field(default_factory=list)  # steps whose rec.step() returned
    seconds: float = 0.0  # from fork to exit


class Zygote:
    def __init__(self, stderr_path: Path):
        self.stderr_path = stderr_path
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from tests.run import crash_worker; crash_worker.zygote()"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(stderr_path, "wb"),
            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        )

    def session(self, run_dir: Path, seed: int, site: str, kill_after: float | None = None) -> Session:
        self.proc.stdin.write(f"go {run_dir} {seed} {site}\n".encode())
        self.proc.stdin.flush()
        out, timers = Session(), []
        while True:
            line = self.proc.stdout.readline().decode()
            assert line, f"the zygote died:\n{self.stderr_path.read_text()}"
            word, value = line.split()
            if word == "pid":
                pid, t0 = int(value), time.monotonic()
                if kill_after is not None:
                    timers.append(threading.Timer(kill_after, _kill, (pid,)))
                timers.append(threading.Timer(120, _kill, (pid,)))  # a hung child fails, not hangs
                for t in timers:
                    t.start()
            elif word == "ready":
                out.ready = int(value)
            elif word == "step":
                out.steps.append(int(value))
            elif word == "exit":
                out.status, out.seconds = int(value), time.monotonic() - t0
                break
        for t in timers:
            t.cancel()
        killed = os.WIFSIGNALED(out.status) and os.WTERMSIG(out.status) == signal.SIGKILL
        assert killed or out.status == 0, f"the recording child failed:\n{self.stderr_path.read_text()}"
        return out

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def next_step_on_disk(run_dir: Path) -> int:
    """What a resumed session must number its first step: one past the last recorded step."""
    run = ckptlab.open_run(run_dir)
    recorded = [*run.steps, *run.metrics().step.tolist()]
    return max(max(recorded, default=-1) + 1, max(run.checkpoints, default=0))


def check_run(run_dir: Path, returned: set[int]) -> None:
    run = ckptlab.open_run(run_dir)
    done = set(run.metrics().step.tolist())
    assert returned <= done, f"steps returned but without metrics: {sorted(returned - done)}"
    checkpoints = run.checkpoints
    # Retention drops batches before the oldest of the last KEEP_LAST checkpoints; from there on
    # every returned step must have its batch.
    floor = checkpoints[-KEEP_LAST] if len(checkpoints) >= KEEP_LAST else 0
    for step in sorted(s for s in returned if s >= floor):
        batch, ids = run.batch(step)
        want, want_ids = make_batch(step)
        assert_same(batch, want, f"step {step}")
        assert ids == want_ids
    on_disk = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert on_disk == [f"step-{s:09d}" for s in checkpoints], "a partial checkpoint is visible"
    for step in checkpoints:
        ckpt = run.checkpoint(step)
        ckpt.verify()
        ckpt.load_model(verify=False)
        ckpt.load_state(verify=False)
    assert all("torn at the tail" in p for p in run.problems), run.problems


def test_sigkill_at_random_instants(tmp_path):
    run_dir = tmp_path / "run"
    rng = random.Random(20240613)
    zygote = Zygote(tmp_path / "stderr.txt")
    try:
        first = zygote.session(run_dir, 0, "timer")  # runs to the end: creates the run, times a session
        assert first.status == 0 and first.ready == 0
        returned = set(first.steps)
        check_run(run_dir, returned)

        for i in range(KILLS):
            site = SITES[i % len(SITES)]
            expected_first = next_step_on_disk(run_dir)
            s = zygote.session(run_dir, 1 + i, site, rng.uniform(0, first.seconds) if site == "timer" else None)
            if s.ready is not None:
                assert s.ready == expected_first, f"session {i + 1} ({site}) did not continue the numbering"
            assert s.steps == list(range(expected_first, expected_first + len(s.steps)))
            returned |= set(s.steps)
            check_run(run_dir, returned)

        last = zygote.session(run_dir, 99, "timer")  # and a clean session still records
        assert last.status == 0 and len(last.steps) > 0
        returned |= set(last.steps)
        check_run(run_dir, returned)
    finally:
        zygote.close()

    # Numbering: every step from 0 on is recorded once (metrics, or a batch of a step a kill
    # interrupted), except interrupted steps whose batches retention has since dropped.
    run = ckptlab.open_run(run_dir)
    recorded = set(run.metrics().step.tolist()) | set(run.steps)
    floor = run.checkpoints[-KEEP_LAST]
    assert set(range(floor, max(recorded) + 1)) <= recorded
    assert len(run.manifest["sessions"]) <= KILLS + 2  # a kill before the manifest write leaves no trace
