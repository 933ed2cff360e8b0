"""What the framework DDP tests share: a fixture script under `torchrun --nproc_per_node=2`
(gloo on the CPU), and `ckptlab replay --json` as a user runs it, in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def torchrun(script: str, run_dir: Path, nproc: int = 2, *args: str, timeout: float = 300) -> list[str]:
    """Run tests/`script` RUN_DIR ARGS on `nproc` processes; its ranks' lines of output, sorted.

    Each rank's stdout goes to a file of its own (torchrun's --redirects): ranks printing
    at once into one pipe can interleave within a line where stdout is unbuffered."""
    with tempfile.TemporaryDirectory() as logs:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        launch += ["--redirects", "1", "--log-dir", logs]
        _run([*launch, str(ROOT / "tests" / script), str(run_dir), *args], timeout)
        said = [line for out in sorted(Path(logs).rglob("stdout.log")) for line in out.read_text().splitlines()]
    return sorted(line for line in said if line)


def record_to_the_fault(script: str, run_dir: Path, dm) -> Path:
    """Record tests/`script` on dm.WORLD ranks into `run_dir`; every rank stops at the planted
    fault (dm.FAULT_STEP). Returns `run_dir`."""
    assert torchrun(script, run_dir, dm.WORLD) == [f"rank {r} stopped at step {dm.FAULT_STEP}" for r in range(dm.WORLD)]
    return run_dir


def replay_json(run_dir: Path, step: int, *options: str) -> dict:
    """`ckptlab replay --run RUN_DIR --step STEP OPTIONS --json`, its report."""
    done = _run(
        [sys.executable, "-m", "ckptlab", "replay", "--run", str(run_dir), "--step", str(step), *options, "--json"]
    )
    return json.loads(done.stdout)


def assert_replays_and_names_the_sample(doc: dict, dm) -> None:
    """A replay from step 0 of a fixture module `dm`'s planted NaN (FAULT_STEP, FAULT_RANK,
    FAULT_MICRO, FAULT_ROW, FAULT_SAMPLE): every healthy step equal to the bit on both ranks
    (each rank's own loss and the all-reduced gradient norm), the fault on its rank, and the
    sample named by micro-batch and row."""
    assert doc["root_step"] == dm.FAULT_STEP and doc["rank"] == dm.FAULT_RANK
    assert doc["reproduced"] and doc["deterministic"] and doc["bit_exact"]
    steps = doc["steps"]
    assert [s["step"] for s in steps] == list(range(dm.FAULT_STEP + 1)) and all(s["match"] for s in steps)
    for s in steps[:-1]:
        assert (s["rank_loss"], s["grad_norm"]) == (s["recorded_rank_loss"], s["recorded_grad_norm"])
    assert [(s["micro_batch"], s["row"], s["sample_id"]) for s in doc["samples"]] == [
        (dm.FAULT_MICRO, dm.FAULT_ROW, dm.FAULT_SAMPLE)
    ]
    assert f"on rank {dm.FAULT_RANK}" in doc["verdict"]
    assert f"micro-batch {dm.FAULT_MICRO} row {dm.FAULT_ROW}" in doc["verdict"]
    assert doc["counterfactuals"][0]["fault"] is False  # without that row, the step is healthy
