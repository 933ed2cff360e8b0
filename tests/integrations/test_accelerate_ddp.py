"""The run_clm_no_trainer.py-shaped accelerate loop on 2 processes (torchrun with accelerate's
multi-CPU DDP over gloo; tests/accelerate_ddp_models.py), wired with
ckptlab.integrations.accelerate, is recorded on every rank: rank 0 writes the run, each rank its
own micro-batches. `ckptlab replay` spawns both ranks, runs the loop's body under
`accelerator.accumulate` on the DDP model bit for bit, and names rank 1, the micro-batch, the
row and the planted sample."""

import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import ckptlab  # noqa: E402
from tests import accelerate_ddp_models as dm  # noqa: E402
from tests.integrations.ddp_launch import assert_replays_and_names_the_sample, record_to_the_fault, replay_json  # noqa: E402


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return record_to_the_fault("accelerate_ddp_models.py", tmp_path_factory.mktemp("acc-ddp") / "run", dm)


def test_every_rank_records_its_own_micro_batches(ddp_run):
    run = ckptlab.open_run(ddp_run)
    assert run.world_size == dm.WORLD and run.ranks == [0, 1]
    assert run.steps_of(0) == run.steps_of(1) == list(range(dm.FAULT_STEP + 1))
    batch, ids = run.batch(dm.FAULT_STEP, rank=1)
    assert batch["accelerate"] == {"gradient_accumulation_steps": dm.ACCUM}
    assert batch["micro_rows"] == [dm.am.BATCH] * dm.ACCUM
    assert ids[dm.FAULT_MICRO * dm.am.BATCH + dm.FAULT_ROW] == dm.FAULT_SAMPLE
    assert dm.FAULT_SAMPLE not in run.batch(dm.FAULT_STEP, rank=0)[1]
    m = run.metrics()
    rank_loss = m.scalars[m.index(dm.FAULT_STEP)]["rank_loss"]
    assert math.isfinite(rank_loss[0]) and math.isnan(rank_loss[1])  # the NaN came in on rank 1
    assert m.lr[1, 0] > m.lr[0, 0] == 0  # accelerate's scheduler, stepped in the body
    assert 0 in run.checkpoints and 2 in run.checkpoints  # written once, by rank 0


def test_replay_from_the_cli_is_bit_exact_and_names_rank_micro_batch_row_and_sample(ddp_run):
    """From step 0: the healthy steps' losses and gradient norms equal to the bit on both ranks
    (accumulate's no_sync, then the all-reduce, as DDP ran them), then the NaN on rank 1."""
    assert_replays_and_names_the_sample(replay_json(ddp_run, dm.FAULT_STEP, "--from-step", "0"), dm)


def test_one_process_replays_both_ranks_bit_exactly(ddp_run):
    """`--world-size 1`: both ranks' turns in this process. accelerate skips DDP's no_sync in a
    process group of one; the fold runs it as the recorded 2 processes did (one all-reduce of
    the accumulated micro-batches), so every step is bit for bit, and the sample is named."""
    doc = replay_json(ddp_run, dm.FAULT_STEP, "--from-step", "0", "--world-size", "1", "--budget", "0")
    assert doc["world_size"] == 1
    assert_replays_and_names_the_sample(doc, dm)
