"""A Hugging Face Trainer under `torchrun --nproc_per_node=2` (DDP, gloo on the CPU; tests/
hf_ddp_models.py) is recorded on every rank as the plain Recorder records DDP: rank 0 writes the
run, each rank its own batches. `ckptlab replay` spawns both ranks, runs the Trainer's DDP step
(the model accelerate wrapped, the gradients all-reduced after the last micro-batch) bit for
bit, and names rank 1, the micro-batch, the row and the planted sample."""

import math
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import ckptlab  # noqa: E402
from ckptlab.integrations import transformers as ckt  # noqa: E402
from tests import hf_ddp_models as dm  # noqa: E402
from tests.integrations.ddp_launch import assert_replays_and_names_the_sample, record_to_the_fault, replay_json  # noqa: E402


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return record_to_the_fault("hf_ddp_models.py", tmp_path_factory.mktemp("hf-ddp") / "run", dm)


def test_every_rank_records_its_own_micro_batches(ddp_run):
    run = ckptlab.open_run(ddp_run)
    assert run.world_size == dm.WORLD and run.ranks == [0, 1]
    assert run.steps_of(0) == run.steps_of(1) == list(range(dm.FAULT_STEP + 1))
    batch, ids = run.batch(dm.FAULT_STEP, rank=1)
    assert batch["micro_rows"] == [dm.hm.BATCH] * dm.ACCUM
    assert ids[dm.FAULT_MICRO * dm.hm.BATCH + dm.FAULT_ROW] == dm.FAULT_SAMPLE
    assert dm.FAULT_SAMPLE not in run.batch(dm.FAULT_STEP, rank=0)[1]
    m = run.metrics()
    rank_loss = m.scalars[m.index(dm.FAULT_STEP)]["rank_loss"]
    assert math.isfinite(rank_loss[0]) and math.isnan(rank_loss[1])  # the NaN came in on rank 1
    assert 0 in run.checkpoints and 2 in run.checkpoints  # written once, by rank 0


@pytest.mark.parametrize("fold", [False, True], ids=["two-processes", "world-size-1"])
def test_replay_from_the_cli_is_bit_exact_and_names_rank_micro_batch_row_and_sample(ddp_run, fold):
    """From step 0: the healthy steps' losses and gradient norms equal to the bit on both ranks
    (the all-reduce as DDP ran it), then the NaN on rank 1; on the recorded 2 processes, and with
    `--world-size 1` in one (both ranks' turns, the micro-batches before the last under no_sync)."""
    more = ["--world-size", "1", "--budget", "0"] if fold else []
    doc = replay_json(ddp_run, dm.FAULT_STEP, "--from-step", "0", *more)
    assert_replays_and_names_the_sample(doc, dm)
    assert doc["world_size"] == (1 if fold else None)


def test_fsdp_that_accelerate_prepares_as_ddp_is_recorded_as_the_ddp_it_runs(tmp_path):
    """On the CPU the Trainer given `fsdp=` runs DDP, saying nothing: the callback says so and
    records what runs (FSDP2 itself: tests/integrations/test_fsdp2_frameworks.py)."""
    import torch

    model = torch.nn.Linear(2, 1)
    cb = ckt.CkptlabCallback(tmp_path / "run", build_fn=dm.build)
    cb.trainer = SimpleNamespace(is_fsdp_enabled=False, accelerator=SimpleNamespace(scaler=None))
    args = SimpleNamespace(world_size=2, max_steps=10, fsdp="full_shard", deepspeed=None)
    with pytest.warns(UserWarning, match=r"given fsdp= but its accelerator prepared the model without FSDP .*, DDP"):
        cb.on_train_begin(args, None, None, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert cb.rec is not None
    cb.rec.close()
