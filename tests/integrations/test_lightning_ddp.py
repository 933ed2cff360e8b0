"""Lightning under DDP (2 CPU processes, gloo): every rank records its own batches, and
`ckptlab replay` re-runs the steps on 2 processes, through DDP's gradient all-reduce, bit for
bit, and names the rank, micro-batch, row and sample id the NaN came in with."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import ckptlab  # noqa: E402
from tests.integrations import lit_ddp_models as ldm  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ACCUM = 2
NAN_STEP = ldm.FAULT_BATCH  # 5: one batch per step
ACCUM_STEP, ACCUM_MICRO = divmod(ldm.FAULT_BATCH, ACCUM)  # step 2, its micro-batch 1


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both recordings, trained at once, each from its own `python -m` process: strategy="ddp"
    with one batch a step (Lightning's launcher runs the command again as rank 1), and
    strategy="ddp_spawn" with accumulate_grad_batches=2 and bf16-mixed (both ranks spawned from it)."""
    tmp = tmp_path_factory.mktemp("lit-ddp")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    procs = {
        k: subprocess.Popen(
            [sys.executable, "-m", "tests.integrations.lit_ddp_models", str(tmp / f"run{k}"), str(k), method],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for k, method in ((1, "popen"), (ACCUM, "spawn"))
    }
    done = {}
    for k, p in procs.items():
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        done[k] = (tmp / f"run{k}", out)
    return done


def replay_json(run_dir, step, capfd, *more: str) -> dict:
    from ckptlab.cli import main

    capfd.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["replay", "--run", str(run_dir), "--step", str(step), "--from-step", "0", "--json", *more])
    out, err = capfd.readouterr()
    assert done.value.code == 0, err[-3000:]
    return json.loads(out)


def test_every_rank_records_its_own_batches(runs):
    run_dir, out = runs[1]
    stopped = sorted(re.findall(r"rank \d stopped at step \d+", out))
    assert stopped == [f"rank {r} stopped at step {NAN_STEP}" for r in (0, 1)]  # every rank raises there
    run = ckptlab.open_run(run_dir)
    assert run.world_size == 2 and run.ranks == [0, 1] and run.manifest["backend"] == "gloo"
    assert run.steps_of(0) == run.steps_of(1) == list(range(NAN_STEP + 1))
    assert run.checkpoints == [0, 2, 4]  # rank 0 writes them
    batch, ids = run.batch(NAN_STEP, rank=1)
    assert ids == ldm.sample_ids(ldm.FAULT_BATCH, 1) and ids[ldm.FAULT_ROW] == ldm.FAULT_SAMPLE
    assert math.isnan(batch["batch"]["x"][ldm.FAULT_ROW, 2])
    assert run.batch(NAN_STEP, rank=0)[1] == ldm.sample_ids(ldm.FAULT_BATCH, 0)
    assert batch["lightning"]["strategy"] == "ddp"
    m = run.metrics()
    rank_loss = m.scalars[m.index(NAN_STEP)]["rank_loss"]
    assert math.isfinite(rank_loss[0]) and math.isnan(rank_loss[1])  # the NaN came in on rank 1


def test_replay_is_bit_exact_on_two_processes_and_names_rank_row_and_sample(runs, capfd):
    """From step 0: each step's loss and gradient norm as recorded, which takes DDP's gradient
    all-reduce (without it rank 0 would step on its own gradients)."""
    doc = replay_json(runs[1][0], NAN_STEP, capfd)
    assert doc["root_step"] == NAN_STEP and doc["rank"] == ldm.FAULT_RANK
    assert doc["reproduced"] and doc["deterministic"] and doc["bit_exact"]
    assert [(c["step"], c["match"]) for c in doc["steps"]] == [(s, True) for s in range(NAN_STEP + 1)]
    assert [(s["row"], s["sample_id"]) for s in doc["samples"]] == [(ldm.FAULT_ROW, ldm.FAULT_SAMPLE)]
    assert doc["verdict"].startswith(f"Step {NAN_STEP} on rank 1: ") and f"row {ldm.FAULT_ROW}" in doc["verdict"]
    assert doc["counterfactuals"][0]["fault"] is False  # without that row the step is healthy


def test_ddp_spawn_with_accumulation_and_bf16_replays_bit_exactly_and_names_the_micro_batch(runs, capfd):
    """strategy="ddp_spawn" records as "ddp" does. accumulate_grad_batches=2: the first
    micro-batch's backward runs without the all-reduce (Lightning's no_sync), the last one's
    with it; replay does the same, under the same bf16 autocast."""
    run_dir, out = runs[ACCUM]
    run = ckptlab.open_run(run_dir)
    batch, ids = run.batch(ACCUM_STEP, rank=1)
    assert batch["micro_rows"] == [4, 4] and ids == sum((ldm.sample_ids(b, 1) for b in (4, 5)), [])
    assert (batch["lightning"]["accumulate_grad_batches"], batch["lightning"]["precision"]) == (ACCUM, "bf16-mixed")
    doc = replay_json(run_dir, ACCUM_STEP, capfd)
    assert doc["root_step"] == ACCUM_STEP and doc["rank"] == ldm.FAULT_RANK and doc["bit_exact"]
    assert [(c["step"], c["match"]) for c in doc["steps"]] == [(s, True) for s in range(ACCUM_STEP + 1)]
    sample = doc["samples"][0]
    assert len(doc["samples"]) == 1
    assert (sample["micro_batch"], sample["row"], sample["sample_id"]) == (ACCUM_MICRO, ldm.FAULT_ROW, ldm.FAULT_SAMPLE)
    assert f"micro-batch {ACCUM_MICRO} row {ldm.FAULT_ROW} (sample {ldm.FAULT_SAMPLE})" in doc["verdict"]


@pytest.mark.parametrize("k", [1, ACCUM], ids=["ddp", "ddp_spawn-accumulation-bf16"])
def test_one_process_replays_both_ranks_bit_exactly(runs, capfd, k):
    """`--world-size 1`: the DDP wrapper the replayed step makes is found at its first forward,
    and both ranks' turns run in this process (with accumulation, the first micro-batch under
    no_sync); a sum of two gradients is the same in either order: every step bit for bit."""
    step, micro = (NAN_STEP, 0) if k == 1 else (ACCUM_STEP, ACCUM_MICRO)
    doc = replay_json(runs[k][0], step, capfd, "--world-size", "1", "--budget", "0")
    assert (doc["world_size"], doc["root_step"], doc["rank"], doc["bit_exact"]) == (1, step, ldm.FAULT_RANK, True)
    assert [(s["micro_batch"] or 0, s["row"], s["sample_id"]) for s in doc["samples"]] == [
        (micro, ldm.FAULT_ROW, ldm.FAULT_SAMPLE)
    ]


def test_other_multi_process_strategies_are_not_recorded(tmp_path):
    """Lightning's FSDP1 strategy on 2 processes: a warning naming the strategy, and nothing
    written (its DeepSpeed strategy: test_lightning_model_parallel.py)."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    from ckptlab.integrations import lightning as ckl
    from tests.integrations import lit_models as lm

    cb = ckl.CkptlabCallback(tmp_path / "run", build_fn=lm.build)
    trainer = SimpleNamespace(strategy=FSDPStrategy(), world_size=2)
    with pytest.warns(UserWarning, match="2-process Lightning run under FSDPStrategy is not supported"):
        cb.on_train_start(trainer, lm.LitMLP())
    assert cb.rec is None and not (tmp_path / "run").exists()
