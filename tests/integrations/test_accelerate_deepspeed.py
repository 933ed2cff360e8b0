"""The run_clm_no_trainer.py-shaped accelerate loop with `DeepSpeedPlugin(zero_stage=3)` and the
example's torch AdamW, on 2 processes (torchrun, gloo on the CPU; tests/accelerate_deepspeed_models.py),
wired with ckptlab.integrations.accelerate, is recorded on every rank through DeepSpeed's
engine: rank 0 writes the whole ZeRO-3 state (layout "zero"), each rank its own micro-batches.
`ckptlab replay` spawns both ranks, runs the loop's body under `accelerator.accumulate` on a
rebuilt engine bit for bit, and names rank 1's planted NaN sample, and the learning-rate bug of
a later step."""

import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

import ckptlab  # noqa: E402
from tests import accelerate_deepspeed_models as dm  # noqa: E402
from tests.integrations.ddp_launch import assert_replays_and_names_the_sample, replay_json, torchrun  # noqa: E402


@pytest.fixture(scope="module")
def ds_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("acc-zero3") / "run"
    lines = torchrun("accelerate_deepspeed_models.py", run_dir, dm.WORLD)
    assert [line for line in lines if line.startswith("rank")] == [
        f"rank {r} recorded {dm.STEPS} steps" for r in (0, 1)
    ]
    return run_dir


def test_every_rank_records_its_micro_batches_and_rank_0_the_whole_zero_3_state(ds_run):
    run = ckptlab.open_run(ds_run)
    assert (run.manifest["layout"], run.world_size, run.ranks) == ("zero", dm.WORLD, [0, 1])
    # whole shapes, under the model's own names (ZeRO-3's parameters are empty stubs between steps)
    params = {p["name"]: p for p in run.manifest["parameters"]}
    assert params["transformer.wte.weight"]["shape"] == [dm.am.VOCAB, dm.am.EMBD]
    assert {p["group"] for p in params.values()} == {0, 1}  # the example's decay / no-decay groups
    batch, ids = run.batch(dm.FAULT_STEP, rank=1)
    assert batch["accelerate"] == {"gradient_accumulation_steps": dm.ACCUM}
    assert batch["micro_rows"] == [dm.am.BATCH] * dm.ACCUM
    assert ids[dm.FAULT_MICRO * dm.am.BATCH + dm.FAULT_ROW] == dm.FAULT_SAMPLE
    assert dm.FAULT_SAMPLE not in run.batch(dm.FAULT_STEP, rank=0)[1]
    m = run.metrics()
    rank_loss = m.scalars[m.index(dm.FAULT_STEP)]["rank_loss"]
    assert math.isfinite(rank_loss[0]) and math.isnan(rank_loss[1])  # the NaN came in on rank 1
    # DeepSpeed skipped the NaN step's update, and accelerate's scheduler its step
    assert m.lr[m.index(dm.FAULT_STEP + 1), 0] == m.lr[m.index(dm.FAULT_STEP), 0] > 0
    assert m.lr[m.index(dm.LR_STEP), 0] == dm.LR_FAULT
    assert {0, 3, 6} <= set(run.checkpoints)
    tensors, _ = run.checkpoint(6).load_model()
    assert tuple(tensors["transformer.wte.weight"].shape) == (dm.am.VOCAB, dm.am.EMBD)


def test_replay_from_the_cli_is_bit_exact_and_names_rank_micro_batch_row_and_sample(ds_run):
    """From step 0: every healthy step's losses and gradient norm equal to the bit on both
    ranks (ZeRO-3's gathers, reduce-scatters and step as the loop ran them), then the NaN."""
    assert_replays_and_names_the_sample(replay_json(ds_run, dm.FAULT_STEP, "--from-step", "0"), dm)


def test_replay_names_the_learning_rate_step(ds_run):
    doc = replay_json(ds_run, dm.LR_STEP + 1)
    assert doc["deterministic"] and doc["bit_exact"] and all(s["match"] for s in doc["steps"]), doc["verdict"]
    assert (doc["root_step"], doc["origin"]["kind"], doc["samples"]) == (dm.LR_STEP, "optimizer", [])
    assert doc["rank"] in (0, 1) and "learning rate of group 0, 1e+04" in doc["verdict"]
