"""Tensor parallelism, recorded and replayed: the MLP under `parallelize_module` on a 1-D mesh of
2 processes (every rank on the same batch), and FSDP2 over TP on a 2-D (dp, tp) mesh of 4
(tests/parallel_models.py), gloo on the CPU. One recording each holds a learning-rate spike
at step LR_STEP and a NaN sample at NAN_STEP; replay names both, bit for bit on every process,
in the model's own names, and the NaN's data-parallel rank."""

import json

import pytest

import ckptlab
from tests import parallel_models as pm


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    return pm.record("tp", tmp_path_factory.mktemp("tp") / "run")


@pytest.fixture(scope="module")
def mesh_run(tmp_path_factory):
    return pm.record("fsdp_tp", tmp_path_factory.mktemp("fsdp-tp") / "run")


def _replay_json(run_dir, step: int, capfd) -> dict:
    """`ckptlab replay --run RUN --step STEP --json`, in this process (it spawns the ranks)."""
    from ckptlab.cli import main

    capfd.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["replay", "--run", str(run_dir), "--step", str(step), "--json"])
    out, err = capfd.readouterr()
    assert done.value.code == 0, err[-3000:]
    return json.loads(out)


@pytest.mark.parametrize("kind", ["tp", "fsdp_tp"])
def test_a_dtensor_parameter_is_recorded_as_one_parameter_with_its_global_norm(kind, tp_run, mesh_run):
    run = ckptlab.open_run(tp_run if kind == "tp" else mesh_run)
    n = pm.WORLD[kind]
    assert (run.world_size, run.manifest["layout"], run.ranks) == (n, "sharded", list(range(n)))
    assert run.manifest["data_ranks"] == [pm.data_rank(kind, r) for r in range(n)]
    shapes = {"fc1.weight": [16, 8], "fc1.bias": [16], "fc2.weight": [1, 16], "fc2.bias": [1]}
    assert {p["name"]: p["shape"] for p in run.manifest["parameters"]} == shapes  # global, not a shard's
    m = run.metrics()
    # Shards add up, replicas (TP's Replicate bias, on every rank of its group) count once: the
    # norms of the whole model's gradient, computed here in one process.
    assert m.param_grad_norm[0].tolist() == pytest.approx(pm.reference_norms(kind), rel=1e-5)
    # every element's gradient went NaN at the NaN step, each counted once (not once per TP rank)
    nonfinite = next(e for e in run.events() if e["kind"] == "nonfinite_grad")
    assert (nonfinite["step"], nonfinite["value"]) == (pm.NAN_STEP, sum(16 * k for k in (8, 1, 1)) + 1)
    # Every process of a TP group trains on its data-parallel rank's batch, and says so
    nan = m.scalars[m.index(pm.NAN_STEP)]["rank_loss"]
    assert [pm.data_rank(kind, r) == pm.NAN_DATA_RANK[kind] for r in range(n)] == [v != v for v in nan]
    for r in range(n):
        assert run.batch(pm.NAN_STEP, rank=r)[1] == pm.sample_ids(pm.NAN_STEP, pm.data_rank(kind, r))
    ck = run.checkpoint(run.checkpoints[-1])
    assert ck.sharded and {f"dcp/__{r}_0.distcp" for r in range(n)} <= set(ck.commit["files"])
    ck.verify()
    tensors, _ = ck.load_model()  # every process's shards, assembled in one process
    assert {k: list(v.shape) for k, v in tensors.items()} == shapes


def test_tp_replay_names_the_nan_sample_on_data_parallel_rank_0(tp_run, capfd):
    doc = _replay_json(tp_run, pm.NAN_STEP, capfd)
    pm.assert_nan_replay(doc, "tp")
    assert doc["processes"] == [0, 1] and "on data-parallel rank 0 (processes 0, 1)" in doc["verdict"]
    assert "enters the model at `fc1`" in doc["origin"]["detail"]


def test_tp_replay_names_the_learning_rate_spike(tp_run):
    pm.assert_lr_replay(ckptlab.replay(tp_run, pm.LR_STEP))


def test_one_process_of_a_tp_group_replays_its_batch_alone_with_the_model_whole(tp_run):
    report = ckptlab.replay(tp_run, pm.NAN_STEP, rank=1)  # a quick look, in this process
    assert report.root_step == pm.NAN_STEP
    assert [s.sample_id for s in report.samples] == [pm.sample_ids(pm.NAN_STEP, 0)[pm.NAN_ROW]]
    assert any("data-parallel rank 0 of 1" in n and "tensor-parallel shards" in n for n in report.notes)


def test_fsdp_x_tp_replay_names_the_data_parallel_rank_that_held_the_sample(mesh_run, capfd):
    doc = _replay_json(mesh_run, pm.NAN_STEP, capfd)
    pm.assert_nan_replay(doc, "fsdp_tp")
    assert doc["processes"] == [2, 3] and "on data-parallel rank 1 (processes 2, 3)" in doc["verdict"]


def test_fsdp_x_tp_replay_names_the_learning_rate_spike(mesh_run):
    pm.assert_lr_replay(ckptlab.replay(mesh_run, pm.LR_STEP))
