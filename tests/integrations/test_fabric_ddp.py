"""The litgpt-shaped Fabric loop on 2 processes (torchrun, Fabric's strategy="ddp" on the CPU over
gloo; tests/fabric_ddp_models.py), wired with ckptlab.integrations.fabric, is recorded on every
rank. `ckptlab replay` spawns both ranks, where `build` launches the Fabric of build_fn into the
replay's process group (and into a group of one where the root step is explained) instead of
starting processes of its own, runs the micro-batches under `fabric.no_backward_sync` on the DDP
model bit for bit, and names rank 1, the micro-batch, the row and the planted sample."""

import json
import math

import pytest

pytest.importorskip("lightning.fabric")

import ckptlab  # noqa: E402
from tests import fabric_ddp_models as dm  # noqa: E402
from tests.integrations.ddp_launch import assert_replays_and_names_the_sample, record_to_the_fault  # noqa: E402


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return record_to_the_fault("fabric_ddp_models.py", tmp_path_factory.mktemp("fabric-ddp") / "run", dm)


def test_every_rank_records_its_own_micro_batches_under_the_models_own_names(ddp_run):
    run = ckptlab.open_run(ddp_run)
    assert run.world_size == dm.WORLD and run.ranks == [0, 1] and run.manifest["backend"] == "gloo"
    assert run.steps_of(0) == run.steps_of(1) == list(range(dm.FAULT_STEP + 1))
    batch, ids = run.batch(dm.FAULT_STEP, rank=1)
    assert batch["micro_rows"] == [dm.fm.BATCH] * dm.fm.ACCUM
    assert ids[dm.FAULT_MICRO * dm.fm.BATCH + dm.FAULT_ROW] == dm.FAULT_SAMPLE
    assert dm.FAULT_SAMPLE not in run.batch(dm.FAULT_STEP, rank=0)[1]
    m = run.metrics()
    rank_loss = m.scalars[m.index(dm.FAULT_STEP)]["rank_loss"]
    assert math.isfinite(rank_loss[0]) and math.isnan(rank_loss[1])  # the NaN came in on rank 1
    # Fabric's module around DDP around the model: neither prefix in the record
    assert run.param_names == [n for n, _ in dm.fm.GPT().named_parameters()]


@pytest.mark.parametrize("fold", [False, True], ids=["two-processes", "world-size-1"])
def test_replay_is_bit_exact_and_names_rank_micro_batch_row_and_sample(ddp_run, capfd, fold):
    """On the recorded 2 processes, and with `--world-size 1` in this one (both ranks' turns, the
    DDP under Fabric's module found through it, the micro-batches before the last under
    no_backward_sync): the same numbers bit for bit, the same rank, micro-batch and sample."""
    from ckptlab.cli import main

    capfd.readouterr()
    more = ["--world-size", "1", "--budget", "0"] if fold else []
    with pytest.raises(SystemExit) as done:
        main(["replay", "--run", str(ddp_run), "--step", str(dm.FAULT_STEP), "--from-step", "0", "--json", *more])
    out, err = capfd.readouterr()
    assert done.value.code == 0, err[-3000:]
    assert "_forward_module" not in out
    doc = json.loads(out)
    assert_replays_and_names_the_sample(doc, dm)
    assert doc["world_size"] == (1 if fold else None)
    assert "enters the model at `transformer.wte`" in doc["origin"]["detail"]
