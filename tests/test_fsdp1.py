"""torch's FSDP1 (`FullyShardedDataParallel(use_orig_params=True)`, `device_id=cpu`), recorded and
replayed on 2 processes with gloo (tests/parallel_models.py "fsdp1"): one recording holds a
learning-rate spike at LR_STEP and a NaN sample on rank 1 at NAN_STEP; replay names both, bit
for bit on every rank, by the model's own parameter names."""

import json

import pytest

import ckptlab
from tests import parallel_models as pm


@pytest.fixture(scope="module")
def fsdp1_run(tmp_path_factory):
    return pm.record("fsdp1", tmp_path_factory.mktemp("fsdp1") / "run")


def test_fsdp1_records_the_models_own_parameters_and_dcp_shards(fsdp1_run):
    run = ckptlab.open_run(fsdp1_run)
    assert (run.world_size, run.manifest["layout"], run.manifest.get("data_ranks")) == (2, "sharded", None)
    shapes = {"fc1.weight": [16, 8], "fc1.bias": [16], "fc2.weight": [1, 16], "fc2.bias": [1]}
    # not `_fsdp_wrapped_module.fc1.weight`, nor the 1-D view of this rank's shard
    assert {p["name"]: p["shape"] for p in run.manifest["parameters"]} == shapes
    m = run.metrics()
    # rank 0's shard holds fc1.weight alone, rank 1's the rest: the shards' norms add up
    assert m.param_grad_norm[0].tolist() == pytest.approx(pm.reference_norms("fsdp1"), rel=1e-5)
    ck = run.checkpoint(run.checkpoints[-1])
    assert ck.sharded and {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(ck.commit["files"])
    ck.verify()
    tensors, _ = ck.load_model()
    assert {k: list(v.shape) for k, v in tensors.items()} == shapes
    report = ckptlab.diff(f"{fsdp1_run}@{run.checkpoints[0]}", f"{fsdp1_run}@{run.checkpoints[1]}")
    assert {f.name for f in report.ranked} == set(shapes) and not report.mismatched


def test_fsdp1_replay_names_the_rank_and_the_nan_sample(fsdp1_run, capfd):
    from ckptlab.cli import main

    capfd.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["replay", "--run", str(fsdp1_run), "--step", str(pm.NAN_STEP), "--json"])
    out, err = capfd.readouterr()
    assert done.value.code == 0, err[-3000:]
    doc = json.loads(out)
    pm.assert_nan_replay(doc, "fsdp1")
    assert doc["processes"] is None and "on rank 1:" in doc["verdict"]


def test_fsdp1_replay_names_the_learning_rate_spike(fsdp1_run):
    pm.assert_lr_replay(ckptlab.replay(fsdp1_run, pm.LR_STEP))


def test_fsdp1_on_fewer_processes_is_refused_in_one_line(fsdp1_run, cli):
    """A fold takes DDP's and FSDP2's reductions, not FSDP1's: said once build_fn has run, before a step."""
    done = cli("replay", "--run", fsdp1_run, "--step", pm.NAN_STEP, "--world-size", 1)
    assert done.code == 1 and "Traceback" not in done.err, done.err
    assert "--world-size: the model is wrapped in FSDP1 (FullyShardedDataParallel)" in done.err
    assert "leave --world-size out" in done.err
