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

import numpy as np
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


def build_fsdp():
    """The same model and optimizer under FSDP2 (each layer, then the whole, `fully_shard`-ed)."""
    model, optimizer = dm.build_fsdp()
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


class TwoHeads(torch.nn.Module):
    """A model whose second head only rows flagged in the batch go through: under DDP with
    find_unused_parameters a rank whose batch has none leaves it unused."""

    def __init__(self):
        super().__init__()
        self.body, self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1), torch.nn.Linear(8, 1)

    def forward(self, x, use_b):
        h = torch.relu(self.body(x))
        return self.b(h) if bool(use_b) else self.a(h)


def build_unused():
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(TwoHeads(), find_unused_parameters=True)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def step_unused(model, optimizer, batch):
    x, y, use_b = batch
    loss = torch.nn.functional.mse_loss(model(x, use_b), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


# Head b: rank 1's batches go through it at steps 1 and 2, rank 3's at step 4, no other's.
USES_B = {(1, 1), (2, 1), (4, 3)}


def record(run_dir: str, kind: str = "main") -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if kind == "unused":
        model, optimizer = build_unused()
        with ckptlab.Recorder(run_dir, model, optimizer, step_fn=step_unused, build_fn=build_unused) as rec:
            for s in range(5):
                (x, y), ids = dm.batch(s, rank)
                rec.step((x, y, torch.tensor((s, rank) in USES_B)), sample_ids=ids)
    else:
        build_fn = build_fsdp if kind == "fsdp" else build
        model, optimizer, scheduler = build_fn()
        with ckptlab.Recorder(
            run_dir, model, optimizer, scheduler=scheduler, step_fn=step_fn, build_fn=build_fn, ckpt_every=5
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


def _torchrun(run_dir: Path, nproc: int, kind: str) -> Path:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*args, str(run_dir), kind], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return run_dir


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    return _torchrun(tmp_path_factory.mktemp("fold4") / "run", WORLD, "main")


@pytest.fixture(scope="module")
def fsdp4(tmp_path_factory):
    return _torchrun(tmp_path_factory.mktemp("fold-fsdp4") / "run", WORLD, "fsdp")


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


@pytest.mark.parametrize("size", [1, 2])
def test_fsdp2_folds_onto_fewer_processes_naming_the_rank_and_sample(fsdp4, size):
    """A 4-process FSDP2 run: the checkpoint resharded onto `size` processes (DCP), each rank's
    turn reduce-scattered over them, and the turns' shards summed into the mean over the 4
    ranks (turns.py); named as the 4-process replay names it (what test_distributed checks
    of FSDP2's full-size replay): rank 2's batch, row 1."""
    folded = ckptlab.replay(fsdp4, NAN_STEP, budget=0, world_size=size)
    nan_id = dm.sample_ids(NAN_STEP, NAN_RANK)[NAN_ROW]
    assert _named(folded) == (NAN_STEP, "data", NAN_RANK, [(NAN_ROW, nan_id)]) and folded.world_size == size
    assert [len(c.rank_loss or []) for c in folded.steps] == [WORLD] * len(folded.steps)
    # every rank's loss, bit for bit, at every step before the fault: the averaged gradients
    # (and so the weights) the fold makes are the recorded ones up to round-off
    assert all(c.rank_loss == c.recorded_rank_loss for c in folded.steps[:-1]) and len(folded.steps) > 1
    # each recorded rank's gradient norm is its own shard's, measured on that shard in the fold
    m, first = ckptlab.open_run(fsdp4).metrics(), folded.steps[0]
    assert first.rank_grad_norm == pytest.approx(m.scalars[m.index(first.step)]["rank_grad_norm"], rel=1e-6)
    assert folded.agreement in ("bit-exact", "equivalent"), folded.verdict
    said = f"replayed on {size} of the recorded 4 processes"
    assert folded.bit_exact or any(said in r for r in folded.bits_differ), folded.bits_differ
    if size == 1:
        assert folded.counterfactuals[0].fault is False  # proven on rank 2's batch without the row


def test_fsdp2_on_one_process_names_the_learning_rate_step(fsdp4, cli):
    done = cli("replay", "--run", fsdp4, "--step", LR_STEP, "--world-size", 1, "--json", "--budget", 0)
    assert done.code == 0, done.err
    doc = json.loads(done.out)
    assert (doc["root_step"], doc["origin"]["kind"], doc["samples"]) == (LR_STEP, "optimizer", []), doc["verdict"]
    assert f"{LR_SPIKE:g}x its recent value" in doc["origin"]["detail"] and "diverged" not in doc["verdict"]


def test_what_cannot_be_folded_is_refused_in_one_line(run4, cli):
    for size, said in [(5, "recorded on 4 processes; a replay runs on 4 or fewer"), (3, "do not fold evenly")]:
        done = cli("replay", "--run", run4, "--step", NAN_STEP, "--world-size", size)
        assert done.code == 1 and said in done.err and "Traceback" not in done.err, done.err


def test_a_fold_that_would_not_fit_in_memory_is_refused_naming_one_that_fits(run4, cli, monkeypatch):
    """Before anything is loaded: each process's estimate (the checkpoint's state twice, the
    parameters' size four times, the process), times the processes, against the memory available."""
    from ckptlab.replayer import fold

    run = ckptlab.open_run(run4)
    need = fold.process_bytes(run, NAN_STEP)
    state = run.checkpoint(max(s for s in run.checkpoints if s <= NAN_STEP)).nbytes
    assert need > 2 * state + fold.PROCESS_BYTES  # (and the parameters' three copies)
    monkeypatch.setattr(fold, "available_bytes", lambda: int(1.5 * need))
    done = cli("replay", "--run", run4, "--step", NAN_STEP, "--world-size", 2, "--budget", 0)
    assert done.code == 1 and "Traceback" not in done.err, done.err
    assert "--world-size 2: each process needs about" in done.err and "--world-size 1 fits" in done.err
    # one process: this one, whose own share (PROCESS_BYTES) is already in use
    monkeypatch.setattr(fold, "available_bytes", lambda: (need - fold.PROCESS_BYTES) // 2)
    done = cli("replay", "--run", run4, "--step", NAN_STEP, "--world-size", 1, "--budget", 0)
    assert done.code == 1 and "replay on a machine with more memory" in done.err, done.err
    assert fold.available_bytes() > 0  # MemAvailable, read from /proc/meminfo


def test_find_unused_parameters_folds_when_a_stepping_rank_used_each_parameter(tmp_path, cli):
    """find_unused_parameters: DDP learns the unused parameters over its group, in a fold the
    K processes' stepping ranks (0 .. K-1) alone. On 2 processes, rank 1 steps: its use of head b
    at steps 1 and 2 folds (its loss at step 2, through b as step 1 updated it, is the recorded
    one); rank 3's at step 4 would be dropped: refused in one line, naming it. On 1 process,
    rank 1's use at step 1 already is."""
    run = _torchrun(tmp_path / "run", WORLD, "unused")
    done = cli("replay", "--run", run, "--step", 3, "--world-size", 2, "--from-step", 0, "--json")
    assert done.code == 0, done.err
    doc = json.loads(done.out)
    assert [s["step"] for s in doc["steps"]] == [0, 1, 2, 3] and doc["agreement"] in ("bit-exact", "equivalent")
    assert all(s["rank_loss"] == s["recorded_rank_loss"] for s in doc["steps"]), doc["steps"]
    done = cli("replay", "--run", run, "--step", 4, "--world-size", 2, "--from-step", 0)
    assert done.code == 1 and "Traceback" not in done.err, done.err
    assert "`b.weight` got a gradient from another rank's batch but not from rank 0's or rank 1's" in done.err
    done = cli("replay", "--run", run, "--step", 3, "--world-size", 1, "--from-step", 0)
    assert done.code == 1 and "`b.weight` got a gradient from another rank's batch but not from rank 0's" in done.err


def test_ddp_options_whose_reduction_cannot_be_folded_are_named():
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ckptlab.replayer.turns import _unfoldable
    from ckptlab.training.world import solo_world

    with solo_world(True):
        assert _unfoldable(DDP(MLP())) is None
        assert "gradient_as_bucket_view=True" in _unfoldable(DDP(MLP(), gradient_as_bucket_view=True))
        with_buffers = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        assert "broadcast_buffers=False" in _unfoldable(DDP(with_buffers, broadcast_buffers=False))


def test_the_recorded_shards_are_found_in_any_process_s_shard():
    """FSDP2 splits a dimension of n into chunks of ceil(n / ranks) (torch.chunk): a fold's
    process of K holds whole recorded shards where the chunks line up, and pieces of one
    where they do not (n = 10: 4 ranks hold 3, 3, 3, 1 rows; 2 processes 5 and 5)."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Shard

    from ckptlab.replayer.fsdp2 import recorded_shards

    param = SimpleNamespace(placements=(Shard(0),), shape=(10, 3))

    def rows(proc: int, procs: int) -> list[tuple[int | None, int]]:
        grad = torch.zeros(-(-10 // procs) if proc < procs - 1 else 10 - proc * -(-10 // procs), 3)
        return [(r, v.shape[0]) for r, v in recorded_shards(param, grad, 4, procs, proc)]

    assert rows(0, 1) == [(0, 3), (1, 3), (2, 3), (3, 1)]
    assert rows(0, 2) == [(0, 3), (1, 2)] and rows(1, 2) == [(1, 1), (2, 3), (3, 1)]
    tiny = SimpleNamespace(placements=(Shard(0),), shape=(1, 16))  # rank 0 held it all
    assert [(r, v.shape[0]) for r, v in recorded_shards(tiny, torch.zeros(1, 16), 4, 1, 0)] == [(0, 1)]
    whole = SimpleNamespace(placements=(), shape=(5,))  # not sharded: every rank held it whole
    assert recorded_shards(whole, torch.zeros(5), 4, 1, 0)[0][0] is None


def test_a_recorded_shard_split_over_two_processes_adds_its_pieces(monkeypatch):
    """Rank 1's shard of a 10-row parameter lies on both processes of a fold onto 2: its row
    holds the sum of the pieces' squares, not the last process's piece."""
    from ckptlab.replayer import turns

    world = turns.FoldedWorld(rank=0, size=4, sharded=True, lead=0, procs=2)
    P = 1
    lead = np.zeros(3 + 5 * P)
    lead[3] = 99.0  # (the probe's own number: replaced by the recorded ranks')
    other = {0: {0: 9.0, 1: 4.0}}, {0: {1: 1.0, 2: 9.0, 3: 1.0}}
    parts = [({0: lead, 2: lead}, other[0]), ({1: lead, 3: lead}, other[1])]  # (each process's two turns)
    monkeypatch.setattr(turns, "_everyones", lambda mine, procs: parts)
    rows = world._sharded_rows({0: lead, 2: lead})
    assert rows[:, 3].tolist() == [9.0, 5.0, 9.0, 1.0]


def test_fsdp2_settings_a_fold_cannot_take_are_named():
    """A gradient divide factor (torch divides by it otherwise on fewer processes), and an
    all-reduce hook of the model's own: refused, naming it, before a turn's result is used."""
    from types import SimpleNamespace

    from torch.distributed.fsdp import fully_shard

    from ckptlab.replayer.turns import Fold
    from ckptlab.training.world import solo_world

    run = SimpleNamespace(manifest={"layout": "sharded"}, path="run", world_size=4)
    with solo_world(True):
        for setting in ("set_gradient_divide_factor", "set_all_reduce_hook"):
            model = MLP()
            fully_shard(model)
            getattr(model, setting)(4.0 if setting == "set_gradient_divide_factor" else (lambda out: None))
            fold = Fold(SimpleNamespace(run=run), 4)
            fold._hook_fsdp(model)
            said = "gradient divide factor" if setting == "set_gradient_divide_factor" else "all-reduce hook of its own"
            assert fold.refusal is not None and said in str(fold.refusal), fold.refusal


def test_a_float16_reduction_s_turns_are_summed_without_overflow():
    """FSDP2 reducing in float16: four ranks' shards of 30,000 each sum to 120,000 (past
    float16's 65,504) on the way to their mean, 30,000: the fold keeps the sum in float32."""
    from types import SimpleNamespace

    from ckptlab.replayer.turns import Fold

    run = SimpleNamespace(manifest={"layout": "sharded"}, path="run", world_size=4)
    fold = Fold(SimpleNamespace(run=run), 4)
    for rank in (1, 2, 3, 0):  # (the lead, rank 0, last)
        fold.running, fold.reductions = rank, {}
        out = torch.full((3,), 30000.0, dtype=torch.float16)
        fold._reduced(7, out)
    assert out.tolist() == [30000.0] * 3 and not fold.shards.get((7, 0), torch.zeros(1)).isinf().any()


if __name__ == "__main__":  # torchrun --nproc_per_node=4 tests/test_replay_fold.py RUN [main|fsdp|unused]
    record(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "main")
