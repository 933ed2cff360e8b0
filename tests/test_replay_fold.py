"""`replay --world-size 1`: a 4-process DDP run (gloo) replayed in one process, every rank's
micro-batches in turn, named as the 4-process replay names it.

`python -m torch.distributed.run --standalone --nproc_per_node=4 tests/test_replay_fold.py RUN`
records it: tests/models.py's MLP under DDP, AdamW with a LambdaLR whose step LR_STEP is LR_SPIKE
times too large (the update explodes, AdamW recovers), then a NaN in row NAN_ROW of rank
NAN_RANK's batch at NAN_STEP, where the run stops (NonFiniteLoss).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptlab
from tests import dist_models as dm
from tests.models import MLP, step_mlp

ROOT = Path(__file__).resolve().parent.parent
WORLD, NAN_RANK, NAN_ROW, NAN_STEP = 4, 2, 1, 12
LR_STEP, LR_SPIKE = 6, 30.0


def _spike(step: int) -> float:
    return LR_SPIKE if step == LR_STEP else 1.0


def build():
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(MLP())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, _spike)


def step_fn(model, optimizer, batch):
    """The loop's step, with dropout's randomness in it: each rank's turn needs its own RNG streams."""
    x, y = batch
    x = torch.nn.functional.dropout(x, 0.1)
    return step_mlp(model, optimizer, (x, y))


def batch(step: int, rank: int):
    (x, y), ids = dm.batch(step, rank)
    if (step, rank) == (NAN_STEP, NAN_RANK):
        x[NAN_ROW, 0] = float("nan")
    return (x, y), ids


def record(run_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model, optimizer, scheduler = build()
    with ckptlab.Recorder(
        run_dir, model, optimizer, scheduler=scheduler, step_fn=step_fn, build_fn=build, ckpt_every=5
    ) as rec:
        for s in range(15):
            b, ids = batch(s, rank)
            try:
                rec.step(b, sample_ids=ids)
            except ckptlab.NonFiniteLoss:
                break
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fold4") / "run"
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}", __file__]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*args, str(run_dir)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return run_dir


def _named(report) -> tuple:
    return report.root_step, report.origin.kind, report.rank, [(s.row, s.sample_id) for s in report.samples]


def test_one_process_names_the_rank_and_sample_of_the_four_process_replay(run4):
    full = ckptlab.replay(run4, NAN_STEP, budget=0)
    assert full.bit_exact, full.verdict
    folded = ckptlab.replay(run4, NAN_STEP, budget=0, world_size=1)
    nan_id = dm.sample_ids(NAN_STEP, NAN_RANK)[NAN_ROW]
    assert _named(folded) == _named(full) == (NAN_STEP, "data", NAN_RANK, [(NAN_ROW, nan_id)])
    assert folded.world_size == 1 and full.world_size is None
    assert folded.counterfactuals[0].fault is False  # proven on rank 2's batch without the row
    assert [len(c.rank_loss or []) for c in folded.steps] == [WORLD] * len(folded.steps)  # every rank's turn
    # Each rank's own loss is its loss on the record, bit for bit (its batch, its RNG streams, the
    # same weights); the averaged gradient may differ in its last bits from gloo's ring.
    assert all(c.rank_loss[r] == c.recorded_rank_loss[r] for c in folded.steps[:1] for r in range(WORLD))
    assert folded.agreement in ("bit-exact", "equivalent"), folded.verdict
    if not folded.bit_exact:
        assert any("replayed on 1 of the recorded 4 processes" in r for r in folded.bits_differ)
        assert "replayed on 1 of the recorded 4 processes" in folded.verdict
    assert any("replayed on 1 process for the recorded 4" in n for n in folded.notes)


def test_two_processes_name_the_rank_and_sample(run4):
    """`world_size=2`: two spawned processes, each running two ranks' turns (0 and 2, 1 and 3),
    their sums all-reduced: the same root step, rank and sample."""
    folded = ckptlab.replay(run4, NAN_STEP, budget=0, world_size=2)
    nan_id = dm.sample_ids(NAN_STEP, NAN_RANK)[NAN_ROW]
    assert _named(folded) == (NAN_STEP, "data", NAN_RANK, [(NAN_ROW, nan_id)]) and folded.world_size == 2
    assert [len(c.rank_loss or []) for c in folded.steps] == [WORLD] * len(folded.steps)
    assert all(c.rank_loss[r] == c.recorded_rank_loss[r] for c in folded.steps[:1] for r in range(WORLD))
    assert folded.agreement in ("bit-exact", "equivalent"), folded.verdict
    assert folded.bit_exact or any("replayed on 2 of the recorded 4 processes" in r for r in folded.bits_differ)


def test_one_process_names_the_learning_rate_step(run4, cli):
    done = cli("replay", "--run", run4, "--step", LR_STEP, "--world-size", 1, "--json", "--budget", 0)
    assert done.code == 0, done.err
    doc = json.loads(done.out)
    assert (doc["root_step"], doc["origin"]["kind"], doc["samples"], doc["world_size"]) == (
        LR_STEP,
        "optimizer",
        [],
        1,
    ), doc["verdict"]
    assert f"{LR_SPIKE:g}x its recent value" in doc["origin"]["detail"]
    assert doc["agreement"] in ("bit-exact", "equivalent") and "diverged" not in doc["verdict"]


def test_what_cannot_be_folded_is_refused_in_one_line(run4, cli):
    for size, said in [(5, "recorded on 4 processes; a replay runs on 4 or fewer"), (3, "do not fold evenly")]:
        done = cli("replay", "--run", run4, "--step", NAN_STEP, "--world-size", size)
        assert done.code == 1 and said in done.err and "Traceback" not in done.err, done.err


if __name__ == "__main__":  # torchrun --nproc_per_node=4 tests/test_replay_fold.py RUN
    record(sys.argv[1])
