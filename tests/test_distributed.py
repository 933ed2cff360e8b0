"""Distributed recording and replay: 2 processes, gloo on the CPU (DDP; FSDP2 below)."""

import json
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


def torchrun(run_dir, kind, kill_step=None, nproc=2):  # kill_step: a step number, or "resume"
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(ROOT / "tests" / "dist_models.py"),
        str(run_dir),
        kind,
    ]
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


def test_replay_on_two_processes_names_the_rank_and_sample(ddp_run, tmp_path, monkeypatch):
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # its own: other jobs' replays do not show
    report = ckptlab.replay(ddp_run, dm.NAN_STEP)
    assert not list(scratch.glob("ckptlab-replay-*"))  # its workers' folder is gone
    assert report.deterministic and all(c.match for c in report.steps), (report.verdict, report.steps)
    assert all(c.rank_loss == c.recorded_rank_loss or math.isnan(c.rank_loss[1]) for c in report.steps)
    assert report.root_step == dm.NAN_STEP and report.rank == dm.NAN_RANK
    assert [(s.row, s.sample_id) for s in report.samples] == [(dm.NAN_ROW, dm.sample_ids(dm.NAN_STEP, 1)[dm.NAN_ROW])]
    assert report.origin.kind == "data" and "on rank 1" in report.verdict


def test_one_process_replays_both_ranks_bit_exactly(ddp_run):
    """`world_size=1`: both ranks' micro-batches in turn in this process; a sum of two gradients
    is the same in either order, so every step matches the record bit for bit."""
    report = ckptlab.replay(ddp_run, dm.NAN_STEP, world_size=1, budget=0)
    assert report.bit_exact and report.agreement == "bit-exact", report.verdict
    assert (report.root_step, report.rank, report.world_size) == (dm.NAN_STEP, dm.NAN_RANK, 1)
    assert [(s.row, s.sample_id) for s in report.samples] == [(dm.NAN_ROW, dm.sample_ids(dm.NAN_STEP, 1)[dm.NAN_ROW])]


def test_a_two_process_fsdp2_run_folds_onto_one_bit_for_bit(fsdp_run):
    """`world_size=1` of FSDP2: the DCP checkpoint loaded whole, both ranks' turns reduced
    into the mean of two (the same in either order), each rank's gradient norm measured on its
    recorded shard: every replayed step as recorded."""
    report = ckptlab.replay(fsdp_run, dm.NAN_STEP, world_size=1, budget=0)
    assert report.bit_exact and all(c.match for c in report.steps), report.verdict
    assert (report.root_step, report.rank, report.world_size) == (dm.NAN_STEP, dm.NAN_RANK, 1)
    assert [(s.row, s.sample_id) for s in report.samples] == [(dm.NAN_ROW, dm.sample_ids(dm.NAN_STEP, 1)[dm.NAN_ROW])]


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


def test_fsdp_checkpoints_are_committed_dcp_shards(fsdp_run):
    run = ckptlab.open_run(fsdp_run)
    assert run.manifest["layout"] == "sharded" and run.world_size == 2
    ck = run.checkpoint(run.checkpoints[-1])
    assert ck.sharded and {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "state.safetensors"} <= set(
        ck.commit["files"]
    )
    ck.verify()
    tensors, _ = ck.load_model()  # the shards assembled, in one process, no process group
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {
        "fc1.weight": (16, 8),
        "fc1.bias": (16,),
        "fc2.weight": (1, 16),
        "fc2.bias": (1,),
    }
    # exact global gradient norms: the shards' squared norms add up
    m = run.metrics()
    i = m.index(dm.NAN_STEP - 1)
    assert m.grad_norm[i] == pytest.approx(float((m.param_grad_norm[i].astype("float64") ** 2).sum() ** 0.5))
    report = ckptlab.diff(f"{fsdp_run}@{run.checkpoints[-2]}", f"{fsdp_run}@{run.checkpoints[-1]}")
    assert report.verdict is None  # healthy steps between them


def test_fsdp_replay_is_bit_exact_per_rank_and_names_rank_1(fsdp_run):
    report = ckptlab.replay(fsdp_run, dm.NAN_STEP)
    assert report.deterministic and all(c.match for c in report.steps)
    assert report.root_step == dm.NAN_STEP and report.rank == dm.NAN_RANK
    assert [(s.row, s.sample_id) for s in report.samples] == [(dm.NAN_ROW, dm.sample_ids(dm.NAN_STEP, 1)[dm.NAN_ROW])]
    assert report.counterfactuals[0].fault is False


def test_one_process_fsdp2_records_sharded_and_replays_with_working_counterfactuals(tmp_path):
    """torchrun --nproc_per_node=1 around a fully_shard model (testing an FSDP2 script on one
    device): DTensor parameters in a group of one. It records DCP checkpoints, and the replay
    (in one process, with a group of one made for build_fn) restores the root step's state
    before each counterfactual: a snapshot there is not the live parameters themselves."""
    run_dir = tmp_path / "run"
    done = torchrun(run_dir, "fsdp", nproc=1)
    assert done.returncode == 0, done.stderr[-2000:]
    run = ckptlab.open_run(run_dir)
    assert (run.manifest["layout"], run.world_size, run.manifest["backend"]) == ("sharded", 1, "gloo")
    assert run.checkpoint(run.checkpoints[-1]).sharded
    report = ckptlab.replay(run, dm.NAN_STEP)
    assert report.deterministic and all(c.match for c in report.steps)
    assert [(s.row, s.sample_id) for s in report.samples] == [(dm.NAN_ROW, dm.sample_ids(dm.NAN_STEP, 0)[dm.NAN_ROW])]
    assert report.counterfactuals[0].fault is False  # without the NaN row the step is healthy


def test_one_process_ddp_run_replays_with_a_group_for_its_build_fn(tmp_path):
    """A DDP script under torchrun --nproc_per_node=1: the run notes its backend, so the
    replay gives build_fn (which wraps the model in DDP) a process group of one."""
    run_dir = tmp_path / "run"
    done = torchrun(run_dir, "ddp", nproc=1)
    assert done.returncode == 0, done.stderr[-2000:]
    run = ckptlab.open_run(run_dir)
    assert (run.manifest["layout"], run.world_size, run.manifest["backend"]) == ("replicated", 1, "gloo")
    assert run.needs_process_group
    report = ckptlab.replay(run, dm.NAN_STEP)
    assert report.deterministic and report.counterfactuals[0].fault is False
    assert [s.sample_id for s in report.samples] == [dm.sample_ids(dm.NAN_STEP, 0)[dm.NAN_ROW]]


def test_fsdp_killed_rank_leaves_records_and_checkpoints_intact(tmp_path):
    """Rank 1 dies just before step 11, while checkpoint 10 is still being written in the
    background (sharded checkpoints commit at the next step): no half checkpoint is left
    behind, the committed ones verify, and replay starts from checkpoint 5."""
    run_dir = tmp_path / "run"
    done = torchrun(run_dir, "fsdp", kill_step=11)
    assert done.returncode != 0
    run = ckptlab.open_run(run_dir)
    # (This test failed once in a full run and not in many runs after: say what was seen.)
    seen = f"checkpoints {run.checkpoints}, damaged {run.damaged}; torchrun said: {done.stderr[-1500:]}"
    assert run.damaged == [] and run.checkpoints == [0, 5], seen
    for c in run.checkpoints:
        run.checkpoint(c).verify()
    assert 10 in run.steps_of(1), seen
    report = ckptlab.replay(run, 10)
    assert report.deterministic and report.start_checkpoint == 5, (report.verdict, report.start_checkpoint)
    # Restart the job: every rank restores its shards of the latest checkpoint and goes on.
    again = torchrun(run_dir, "fsdp", kill_step="resume")
    assert again.returncode == 0, again.stderr[-2000:]
    run = ckptlab.open_run(run_dir)
    resumed = run.manifest["sessions"][-1]
    assert resumed["restored_from"] == max(c for c in run.checkpoints if c < resumed["start_step"])
    report = ckptlab.replay(run, run.steps[-1])
    assert report.deterministic and report.rank == dm.NAN_RANK and report.root_step == run.steps[-1]


def test_dirty_scans_every_ranks_batches(ddp_run):
    from ckptlab.analysis.dirty import scan

    report = scan(ckptlab.open_run(ddp_run))
    rows = {(f.step, f.rank, f.row, f.sample_id) for f in report.flagged if f.reason == "nonfinite"}
    assert rows == {(dm.NAN_STEP, dm.NAN_RANK, dm.NAN_ROW, dm.sample_ids(dm.NAN_STEP, 1)[dm.NAN_ROW])}
    assert dm.sample_ids(dm.NAN_STEP, 1)[dm.NAN_ROW] in report.skip_ids


def test_rollback_exports_a_sharded_checkpoint_loadable_without_ckptlab(fsdp_run, tmp_path):
    import safetensors.torch
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    from ckptlab.run.portable import export_checkpoint
    from tests.models import MLP

    run = ckptlab.open_run(fsdp_run)
    export_checkpoint(run.checkpoint(run.checkpoints[-1]), tmp_path / "out")
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    whole = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, safetensors.torch.load_file(tmp_path / "out" / "model.safetensors"), options=whole)
    set_optimizer_state_dict(
        model, opt, torch.load(tmp_path / "out" / "optimizer.pt", weights_only=True), options=whole
    )
    assert torch.equal(model.fc1.weight, run.checkpoint(run.checkpoints[-1]).load_model()[0]["fc1.weight"])
    assert opt.state_dict()["state"][0]["exp_avg"].shape == (16, 8)


def test_replay_json_stdout_stays_clean_when_the_ranks_print(ddp_run, capfd):
    """The DDP run's build_fn/step_fn write to fd 1, in the CLI's process (here, in-process under
    fd capture) and in the worker processes it spawns (which inherit fd 1): all of it on stderr,
    one document on stdout."""
    from ckptlab.cli import main

    capfd.readouterr()
    try:
        main(["replay", "--run", str(ddp_run), "--step", str(dm.NAN_STEP), "--json"])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capfd.readouterr()
    assert code == 0, err[-2000:]
    doc = json.loads(out)
    assert doc["root_step"] == dm.NAN_STEP and doc["rank"] == dm.NAN_RANK
    assert err.count("chatty ddp build_fn") >= 3  # this process, and each rank's worker
    assert "chatty ddp step_fn" in err


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_step_that_raises_on_one_rank_is_reported_not_waited_for(tmp_path, kind):
    """Replayed, rank 1's step raises before its backward while rank 0 waits in a collective
    (DDP's all-reduce, FSDP2's gathers): the replay stops every rank and says which step raised
    on which rank, and how to trace it."""
    run_dir = tmp_path / "run"
    done = torchrun(run_dir, f"{kind}-raise")
    assert done.returncode != 0 and "input out of range" in done.stderr
    raised = [e for e in ckptlab.open_run(run_dir).events() if e["kind"] == "exception"]
    # rank 1's own error, from its batch log (rank 0's journal can only hold its peers' failure)
    assert {"step": dm.RAISE_STEP, "rank": 1, "error": "ValueError: input out of range"}.items() <= next(
        e for e in raised if e.get("rank") == 1
    ).items(), raised
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "ckptlab", "replay", "--run", str(run_dir), "--step", str(dm.RAISE_STEP)]
    replayed = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    error = replayed.stderr.strip().splitlines()[-1]
    assert replayed.returncode == 1 and "Traceback" not in replayed.stderr, replayed.stderr[-2000:]
    assert f"step {dm.RAISE_STEP} raised on rank 1 when replayed (ValueError: input out of range" in error
    assert f"--step {dm.RAISE_STEP} --rank 1" in error
    report = ckptlab.replay(run_dir, dm.RAISE_STEP, rank=1)  # on that rank alone: the whole story
    assert report.root_step == dm.RAISE_STEP and report.origin.kind == "exception"
    assert "as when recorded" in report.verdict, report.verdict
    assert report.samples[0].sample_id == dm.sample_ids(dm.RAISE_STEP, 1)[0]
    if kind == "ddp":  # in one process nothing waits: the raising rank's turn is the root step, explained
        folded = ckptlab.replay(run_dir, dm.RAISE_STEP, world_size=1, budget=0)
        assert (folded.root_step, folded.rank, folded.origin.kind) == (dm.RAISE_STEP, 1, "exception"), folded.verdict
        assert folded.samples[0].sample_id == dm.sample_ids(dm.RAISE_STEP, 1)[0]
