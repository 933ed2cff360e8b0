"""Distributed recording and replay: 2 processes, gloo on the CPU (DDP; FSDP2 below)."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ckptlab
from tests import dist_models as dm

ROOT = Path(__file__).resolve().parent.parent


def torchrun(run_dir, kind, kill_step=None):
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            str(ROOT / "tests" / "dist_models.py"), str(run_dir), kind]
    if kill_step is not None:
        args.append(str(kill_step))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ddp") / "run"
    done = torchrun(run_dir, "ddp")
    assert done.returncode == 0, done.stderr[-2000:]
    return run_dir


def test_each_rank_records_its_own_batches(ddp_run):
    run = ckptlab.open_run(ddp_run)
    assert run.world_size == 2 and run.ranks == [0, 1]
    kept = run.steps_of(0)
    assert kept == run.steps_of(1) == list(range(kept[0], dm.NAN_STEP + 1))  # (retention: from checkpoint 5)
    batch, ids = run.batch(dm.NAN_STEP, rank=1)
    assert ids == dm.sample_ids(dm.NAN_STEP, 1)
    assert math.isnan(batch[0][dm.NAN_ROW, 3])
    m = run.metrics()
    rank_loss = m.scalars[m.index(dm.NAN_STEP)]["rank_loss"]
    assert math.isfinite(rank_loss[0]) and math.isnan(rank_loss[1])  # the NaN came in on rank 1
    assert math.isnan(m.loss[m.index(dm.NAN_STEP)])  # the recorded loss is the ranks' mean


def test_replay_on_two_processes_names_the_rank_and_sample(ddp_run):
    report = ckptlab.replay(ddp_run, dm.NAN_STEP)
    assert report.deterministic and all(c.match for c in report.steps)
    assert all(c.rank_loss == c.recorded_rank_loss or math.isnan(c.rank_loss[1]) for c in report.steps)
    assert report.root_step == dm.NAN_STEP and report.rank == dm.NAN_RANK
    assert [(s.row, s.sample_id) for s in report.samples] == [(dm.NAN_ROW, dm.sample_ids(dm.NAN_STEP, 1)[dm.NAN_ROW])]
    assert report.origin.kind == "data" and "on rank 1" in report.verdict


def test_single_rank_quick_look(ddp_run):
    report = ckptlab.replay(ddp_run, dm.NAN_STEP, rank=1)
    assert report.root_step == dm.NAN_STEP
    assert report.samples[0].sample_id == dm.sample_ids(dm.NAN_STEP, 1)[dm.NAN_ROW]
    assert any("approximation" in n for n in report.notes)


def test_a_killed_rank_leaves_the_others_records_intact(tmp_path):
    run_dir = tmp_path / "run"
    done = torchrun(run_dir, "ddp", kill_step=12)
    assert done.returncode != 0
    found = re.findall(r"rank (\d) step (\d+) returned", done.stdout)
    returned = {r: [int(s) for rank, s in found if int(rank) == r] for r in (0, 1)}
    assert returned[1] == list(range(12))
    run = ckptlab.open_run(run_dir)
    assert run.damaged == []
    for r in (0, 1):
        assert set(returned[r]) <= set(run.steps_of(r))
    assert set(returned[0]) <= set(run.metrics().step.tolist())
    assert 10 in run.checkpoints
    report = ckptlab.replay(run, 11)
    assert report.deterministic and not report.fault_recorded
