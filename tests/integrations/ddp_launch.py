"""What the framework DDP tests share: a fixture script under `torchrun --nproc_per_node=2`
(gloo on the CPU), and `ckptlab replay --json` as a user runs it, in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _run(args: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def torchrun(script: str, run_dir: Path, nproc: int = 2) -> list[str]:
    """Run tests/`script` RUN_DIR on `nproc` processes; its lines of output, sorted."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    done = _run([*launch, str(ROOT / "tests" / script), str(run_dir)])
    return sorted(line for line in done.stdout.splitlines() if line)


def replay_json(run_dir: Path, step: int, *options: str) -> dict:
    """`ckptlab replay --run RUN_DIR --step STEP OPTIONS --json`, its report."""
    done = _run(
        [sys.executable, "-m", "ckptlab", "replay", "--run", str(run_dir), "--step", str(step), *options, "--json"]
    )
    return json.loads(done.stdout)
