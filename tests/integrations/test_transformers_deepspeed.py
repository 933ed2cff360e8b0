"""A Hugging Face Trainer with `deepspeed=` a ZeRO-2 config and its torch AdamW under
`torchrun --nproc_per_node=2` (gloo on the CPU; tests/hf_deepspeed_models.py) is recorded on
every rank through the engine the Trainer makes in `train()`: rank 0 writes the whole state
(layout "zero"), each rank its own micro-batches. `ckptlab replay` spawns both ranks, runs the
Trainer's step on a rebuilt engine bit for bit, and names rank 1's planted NaN sample, and the
learning-rate bug of a later step."""

import math
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

import ckptlab  # noqa: E402
from ckptlab.integrations import transformers as ckt  # noqa: E402
from tests import hf_deepspeed_models as dm  # noqa: E402
from tests.integrations.ddp_launch import assert_replays_and_names_the_sample, replay_json, torchrun  # noqa: E402


@pytest.fixture(scope="module")
def ds_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("hf-zero2") / "run"
    lines = torchrun("hf_deepspeed_models.py", run_dir, dm.WORLD)
    assert [line for line in lines if line.startswith("rank")] == [
        f"rank {r} recorded {dm.STEPS} steps" for r in (0, 1)
    ]
    return run_dir


def test_every_rank_records_its_micro_batches_and_rank_0_the_whole_zero_state(ds_run):
    run = ckptlab.open_run(ds_run)
    assert (run.manifest["layout"], run.world_size, run.ranks) == ("zero", dm.WORLD, [0, 1])
    names = [p["name"] for p in run.manifest["parameters"]]
    assert names[0] == "transformer.wte.weight" and not any(n.startswith("module.") for n in names)
    assert {p["group"] for p in run.manifest["parameters"]} == {0, 1}  # the Trainer's decay / no-decay groups
    batch, ids = run.batch(dm.FAULT_STEP, rank=1)
    assert batch["micro_rows"] == [dm.hm.BATCH] * dm.ACCUM
    assert ids[dm.FAULT_MICRO * dm.hm.BATCH + dm.FAULT_ROW] == dm.FAULT_SAMPLE
    assert dm.FAULT_SAMPLE not in run.batch(dm.FAULT_STEP, rank=0)[1]
    m = run.metrics()
    rank_loss = m.scalars[m.index(dm.FAULT_STEP)]["rank_loss"]
    assert math.isfinite(rank_loss[0]) and math.isnan(rank_loss[1])  # the NaN came in on rank 1
    # DeepSpeed skipped the NaN step's update, and the Trainer its LR step; the bug's rate is recorded
    assert m.lr[m.index(dm.FAULT_STEP + 1), 0] == m.lr[m.index(dm.FAULT_STEP), 0]
    assert m.lr[m.index(dm.LR_STEP), 0] == dm.LR_FAULT
    assert {0, 3, 6} <= set(run.checkpoints)
    # the checkpoint holds both groups' AdamW state, under the model's own names
    tensors, _ = run.checkpoint(6).load_model()
    assert "transformer.h.0.ln_1.bias" in tensors


def test_replay_from_the_cli_is_bit_exact_and_names_rank_micro_batch_row_and_sample(ds_run):
    """From step 0: every healthy step's losses and gradient norm equal to the bit on both
    ranks (DeepSpeed's reduction and step as the Trainer ran them), then the NaN on rank 1."""
    assert_replays_and_names_the_sample(replay_json(ds_run, dm.FAULT_STEP, "--from-step", "0"), dm)


def test_replay_names_the_learning_rate_step(ds_run):
    doc = replay_json(ds_run, dm.LR_STEP + 1)
    assert doc["deterministic"] and doc["bit_exact"] and all(s["match"] for s in doc["steps"]), doc["verdict"]
    assert (doc["root_step"], doc["origin"]["kind"], doc["samples"]) == (dm.LR_STEP, "optimizer", [])
    assert doc["rank"] in (0, 1) and "learning rate of group 0, 1e+04" in doc["verdict"]
    # traced in a process group of one, the rank's loss is the recorded one (the Trainer scales it by the processes)
    assert not any("traced step's loss differs" in n for n in doc["notes"]), doc["notes"]


def test_a_deepspeed_set_up_that_is_not_recorded_is_named_in_one_warning(tmp_path):
    """A real engine in bf16 (in a process group of one), as the Trainer hands it to the
    callback: one warning naming it, nothing written, training left to go on."""
    import deepspeed
    import torch

    from ckptlab.training.world import solo_world
    from tests.models import MLP

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # (tests/deepspeed_models.py says why)
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    with solo_world(True):
        model = MLP()
        engine, opt, _, _ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config
        )
        cb = ckt.CkptlabCallback(tmp_path / "run", build_fn=dm.build)
        cb.trainer = SimpleNamespace(is_deepspeed_enabled=True, deepspeed=engine)  # (attached: train() made it)
        args = SimpleNamespace(world_size=1, max_steps=10, fsdp="", deepspeed=config)
        with pytest.warns(
            UserWarning, match=r"^ckptlab: cannot record a DeepSpeed engine in fp16 or bf16 .*; recording nothing$"
        ):
            cb.on_train_begin(args, None, None, model=model, optimizer=opt)
    assert cb.rec is None and not (tmp_path / "run").exists()
