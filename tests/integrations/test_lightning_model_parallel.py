"""Lightning's ModelParallelStrategy (tests/integrations/lit_mp_models.py), gloo on the CPU:
FSDP2 in configure_model on 2 processes (bf16-mixed, 2 micro-batches a step), FSDP2 x TP on 4
(32-true). Every rank records its shards as under plain FSDP2, and `ckptlab replay` re-runs the
steps on the recorded processes bit for bit and names the learning-rate spike and the NaN
sample's rank, micro-batch, row and sample id."""

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

import ckptlab  # noqa: E402
from ckptlab.errors import ReplayError  # noqa: E402
from ckptlab.integrations import lightning as ckl  # noqa: E402
from tests.integrations import lit_mp_models as lmp  # noqa: E402
from tests.integrations.ddp_launch import torchrun  # noqa: E402

SHAPES = {"model.fc1.weight": [16, 8], "model.fc1.bias": [16], "model.fc2.weight": [1, 16], "model.fc2.bias": [1]}


def _record(kind: str, run_dir):
    said = torchrun("integrations/lit_mp_models.py", run_dir, lmp.WORLD[kind], kind)
    assert said == [f"rank {r} stopped at step {lmp.NAN_STEP}" for r in range(lmp.WORLD[kind])], said
    return run_dir


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    return _record("fsdp", tmp_path_factory.mktemp("lit-fsdp") / "run")


@pytest.fixture(scope="module")
def mesh_run(tmp_path_factory):
    return _record("fsdp_tp", tmp_path_factory.mktemp("lit-fsdp-tp") / "run")


def _replay_json(run_dir, step: int, capfd, *more: str) -> dict:
    """`ckptlab replay --run RUN --step STEP --json`, in this process (it spawns the ranks)."""
    from ckptlab.cli import main

    capfd.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["replay", "--run", str(run_dir), "--step", str(step), "--json", *more])
    out, err = capfd.readouterr()
    assert done.value.code == 0, err[-3000:]
    return json.loads(out)


def _data_rank(kind: str, process: int) -> int:
    return process // lmp.TENSOR_PARALLEL[kind]


@pytest.mark.parametrize("kind", ["fsdp", "fsdp_tp"])
def test_every_rank_records_its_shards_as_under_fsdp2(kind, fsdp_run, mesh_run):
    run = ckptlab.open_run(fsdp_run if kind == "fsdp" else mesh_run)
    n, tp = lmp.WORLD[kind], lmp.TENSOR_PARALLEL[kind]
    assert (run.world_size, run.manifest["layout"], run.ranks) == (n, "sharded", list(range(n)))
    assert {p["name"]: p["shape"] for p in run.manifest["parameters"]} == SHAPES  # the module's names, global shapes
    if kind == "fsdp_tp":  # the processes of one TP group share a data-parallel rank
        assert run.manifest["data_ranks"] == [_data_rank(kind, r) for r in range(n)]
    assert run.checkpoints == [0, 5, 10]
    ck = run.checkpoint(10)
    assert ck.sharded and {f"dcp/__{r}_0.distcp" for r in range(n)} <= set(ck.commit["files"])
    assert {k: list(v.shape) for k, v in ck.load_model()[0].items()} == SHAPES
    micro = range(lmp.ACCUMULATE[kind])
    for r in range(n):
        batch, ids = run.batch(lmp.NAN_STEP, rank=r)
        assert ids == [
            lmp.sample_id(kind, lmp.NAN_STEP, _data_rank(kind, r), row, m) for m in micro for row in range(4)
        ]
    assert (batch["lightning"]["precision"], batch["lightning"]["strategy"]) == (lmp.PRECISION[kind], "model_parallel")
    assert batch["lightning"]["mesh"] == {"data_parallel": lmp.DATA_PARALLEL, "tensor_parallel": tp}
    m = run.metrics()
    nan = m.scalars[m.index(lmp.NAN_STEP)]["rank_loss"]
    assert [v != v for v in nan] == [_data_rank(kind, r) == lmp.NAN_DATA_RANK for r in range(n)]


def _assert_nan_replay(doc: dict, kind: str) -> None:
    assert (doc["root_step"], doc["rank"]) == (lmp.NAN_STEP, lmp.NAN_DATA_RANK), doc["verdict"]
    assert doc["reproduced"] and doc["deterministic"] and doc["bit_exact"]
    steps = doc["steps"]
    assert [s["step"] for s in steps] == [10, 11, 12] and all(s["match"] for s in steps)
    assert all(s["rank_loss"] == s["recorded_rank_loss"] and len(s["rank_loss"]) == lmp.WORLD[kind] for s in steps)
    assert doc["origin"]["kind"] == "data"
    micro = lmp.nan_micro(kind) if lmp.ACCUMULATE[kind] > 1 else None
    assert [(s["micro_batch"], s["row"], s["sample_id"]) for s in doc["samples"]] == [
        (micro, lmp.NAN_ROW, lmp.nan_sample(kind))
    ]
    assert doc["counterfactuals"][0]["fault"] is False  # without that row, the step is healthy


def test_fsdp2_replay_is_bit_exact_and_names_the_rank_micro_batch_row_and_sample(fsdp_run, capfd):
    """bf16-mixed with 2 micro-batches a step: FSDP2 reduces the gradients after each one (the
    strategy blocks no sync), under the same autocast in replay."""
    doc = _replay_json(fsdp_run, lmp.NAN_STEP, capfd)
    _assert_nan_replay(doc, "fsdp")
    assert doc["verdict"].startswith(f"Step {lmp.NAN_STEP} on rank {lmp.NAN_DATA_RANK}: ")
    assert f"micro-batch {lmp.nan_micro('fsdp')} row {lmp.NAN_ROW} (sample {lmp.nan_sample('fsdp')})" in doc["verdict"]


def test_fsdp2_on_one_process_names_the_rank_micro_batch_row_and_sample(fsdp_run, capfd):
    """`--world-size 1`: the strategy's FSDP2 over a mesh of one, both ranks' micro-batches in
    turn (each reduced after it, as recorded), the checkpoint resharded whole."""
    doc = _replay_json(fsdp_run, lmp.NAN_STEP, capfd, "--world-size", "1", "--budget", "0")
    assert (doc["root_step"], doc["rank"], doc["origin"]["kind"], doc["world_size"]) == (
        lmp.NAN_STEP,
        lmp.NAN_DATA_RANK,
        "data",
        1,
    ), doc["verdict"]
    assert [(s["micro_batch"], s["row"], s["sample_id"]) for s in doc["samples"]] == [
        (lmp.nan_micro("fsdp"), lmp.NAN_ROW, lmp.nan_sample("fsdp"))
    ]
    # over two ranks a sum of two is the same in either order, and each rank's gradient norm is
    # measured on its recorded shard: every step as recorded, bit for bit
    assert doc["bit_exact"] and all(s["match"] for s in doc["steps"]), doc["verdict"]
    assert all(s["rank_loss"] == s["recorded_rank_loss"] for s in doc["steps"])


def test_fsdp2_replay_names_the_learning_rate_spike(fsdp_run):
    report = ckptlab.replay(fsdp_run, lmp.LR_STEP)
    assert report.root_step == lmp.LR_STEP and report.reproduced, report.verdict
    assert report.deterministic and report.bit_exact and all(c.match for c in report.steps)
    assert report.origin.kind == "optimizer" and report.origin.param_group == 0 and report.samples == []
    assert report.origin.parameter in SHAPES
    assert f"{lmp.LR_SPIKE:g}x its recent value" in report.origin.detail
    assert report.counterfactuals[0].fault is False  # at the recent learning rate, the step is healthy


def test_fsdp2_x_tp_replay_names_the_data_parallel_rank_that_held_the_sample(mesh_run, capfd):
    doc = _replay_json(mesh_run, lmp.NAN_STEP, capfd)
    _assert_nan_replay(doc, "fsdp_tp")
    assert doc["processes"] == [2, 3] and "on data-parallel rank 1 (processes 2, 3)" in doc["verdict"]


class _Mesh:
    """A DeviceMesh's sizes, as check_mesh reads them."""

    def __init__(self, dp: int, tp: int):
        self.sizes = {"data_parallel": dp, "tensor_parallel": tp}

    def __getitem__(self, dim):
        return SimpleNamespace(size=lambda: self.sizes[dim])

    def size(self):
        return self.sizes["data_parallel"] * self.sizes["tensor_parallel"]


@pytest.mark.parametrize(
    ("mesh", "message"),
    [
        (None, "has no device mesh"),
        (_Mesh(4, 1), "build_fn's device mesh is 4 x 1 (data_parallel x tensor_parallel); the trainer's was 2 x 2"),
    ],
)
def test_a_build_fn_whose_mesh_is_not_the_trainers_is_refused_in_one_line(mesh, message):
    """A build_fn that forgot tensor_parallel_size would shard the module unlike the
    checkpoint: the replayed step says so before running."""
    module = lmp.LitSharded()  # as build_fn would return it, unsharded (no process group here)
    optimizer = torch.optim.AdamW(module.parameters())
    if mesh is not None:
        module._device_mesh = mesh
    cfg = {"epoch": 0, "gradient_clip_val": None, "gradient_clip_algorithm": None, "scheduler_step": False}
    cfg |= {"precision": "32-true", "strategy": "model_parallel", "mesh": _Mesh(2, 2).sizes}
    batch = {"x": torch.zeros(4, 8), "y": torch.zeros(4, 1), "idx": torch.arange(4)}
    with pytest.raises(ReplayError, match="tensor_parallel_size") as raised:
        ckl.training_step(module, optimizer, {"batch": batch, "batch_idx": 0, "lightning": cfg})
    assert message in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("world_size", [1, 2])
def test_lightnings_deepspeed_strategy_is_not_recorded(tmp_path, world_size):
    """Lightning refuses DeepSpeedStrategy on the CPU itself; where it runs (GPUs, one process
    or several), the callback warns in one line naming it and writes nothing."""
    pytest.importorskip("deepspeed")
    from lightning.pytorch.strategies import DeepSpeedStrategy

    cb = ckl.CkptlabCallback(tmp_path / "run", build_fn=lmp.build_fsdp)
    trainer = SimpleNamespace(strategy=DeepSpeedStrategy(), world_size=world_size)
    with pytest.warns(UserWarning, match="recording Lightning's DeepSpeedStrategy is not supported"):
        cb.on_train_start(trainer, lmp.LitSharded())
    assert cb.rec is None and not (tmp_path / "run").exists()
