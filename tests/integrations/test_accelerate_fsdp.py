"""accelerate's FSDP2 (forced on the CPU: tests/accelerate_fsdp_models.py) on 2 processes: every
rank records its shards and micro-batches as under plain FSDP2, `ckptlab replay` re-runs the
steps on the 2 processes bit for bit and names rank 1, the micro-batch, the row and the planted
sample; `--world-size 1` folds both ranks' turns into one process, bit for bit too."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import ckptlab  # noqa: E402
from tests import accelerate_fsdp_models as fm  # noqa: E402
from tests.integrations.ddp_launch import assert_replays_and_names_the_sample, record_to_the_fault, replay_json  # noqa: E402


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    return record_to_the_fault("accelerate_fsdp_models.py", tmp_path_factory.mktemp("acc-fsdp") / "run", fm)


def test_every_rank_records_its_shards(fsdp_run):
    run = ckptlab.open_run(fsdp_run)
    assert (run.world_size, run.ranks, run.manifest["layout"]) == (fm.WORLD, [0, 1], "sharded")
    ck = run.checkpoint(2)
    assert ck.sharded and {"dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(ck.commit["files"])
    names = {p["name"] for p in run.manifest["parameters"]}
    assert "transformer.wte.weight" in names and not any("_fsdp" in n or "module." in n for n in names)


def test_replay_is_bit_exact_and_names_rank_micro_batch_row_and_sample(fsdp_run):
    assert_replays_and_names_the_sample(replay_json(fsdp_run, fm.FAULT_STEP, "--from-step", "0"), fm)


def test_one_process_replays_both_ranks_bit_exactly(fsdp_run):
    """`--world-size 1`: the DCP checkpoint loaded whole into accelerate's FSDP2 over one
    process, each rank's turn reduced, their sum the mean of two (the same bits in either
    order), each rank's gradient norm measured on its recorded shard."""
    doc = replay_json(fsdp_run, fm.FAULT_STEP, "--from-step", "0", "--world-size", "1", "--budget", "0")
    assert doc["world_size"] == 1
    assert_replays_and_names_the_sample(doc, fm)
