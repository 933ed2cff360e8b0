"""What ckptlab does not record (DeepSpeed's parts outside its engine, tensor and pipeline
parallelism; DeepSpeed setups it does not record: tests/test_deepspeed.py) is refused when the
Recorder starts, in one line, with nothing written: never a partial record that replays wrong."""

from __future__ import annotations

import pytest
import torch

import ckptlab
from ckptlab.errors import RecordError
from ckptlab.training.world import solo_world
from tests.models import MLP, build_mlp, step_mlp


def _refused(run_dir, model, match: str) -> RecordError:
    """Recording `model` fails at the Recorder's construction, before anything is written."""
    opt = torch.optim.AdamW(MLP().parameters(), lr=1e-2)
    with pytest.raises(RecordError, match=match) as e:
        ckptlab.Recorder(run_dir, model, opt, step_fn=step_mlp, build_fn=build_mlp)
    assert not run_dir.exists()
    message = str(e.value)
    assert "\n" not in message and "docs/distributed.md" in message
    return e.value


def test_a_model_with_zero3_partitioned_parameters_is_refused(run_dir):
    """`engine.module` handed over instead of the engine: ZeRO-3's parameters give it away."""
    model = MLP()
    model.fc2.weight.ds_id = 3  # what deepspeed.zero.Init sets on each partitioned parameter
    _refused(run_dir, model, "parameter fc2.weight is partitioned by DeepSpeed ZeRO-3")


def test_a_pipeline_stage_is_refused(run_dir):
    stage = type("PipelineStage", (), {"__module__": "torch.distributed.pipelining.stage"})()
    _refused(run_dir, stage, r"cannot record a pipeline-parallel model \(PipelineStage\)")


def test_an_fsdp1_model_is_refused(run_dir):
    """FSDP1's FullyShardedDataParallel (here its class as ckptlab sees it) holds flat shards."""
    wrapper = type(
        "FullyShardedDataParallel",
        (torch.nn.Module,),
        {"__module__": "torch.distributed.fsdp.fully_sharded_data_parallel"},
    )
    model = MLP()
    model.fc1 = wrapper()
    _refused(run_dir, model, r"module fc1 is wrapped by FSDP1 \(FullyShardedDataParallel\).*fully_shard")


def test_tensor_parallel_and_2d_mesh_models_are_refused_and_fsdp2_is_not(run_dir):
    """Real DTensors, on a real 2-D DeviceMesh (1 x 1, in a process group of one)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from ckptlab.training.world import World

    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    with solo_world(True):
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        model = MLP()
        parallelize_module(model, mesh["tp"], plan)
        _refused(run_dir, model, r"parameter fc1.weight is tensor-parallel \(a DTensor on mesh dimension tp\)")
        fully_shard(model, mesh=mesh["dp"])  # FSDP2 over TP: a 2-D mesh
        _refused(run_dir, model, r"parameter fc1.weight is a DTensor on a 2-D device mesh \(dp, tp\)")
        unnamed = MLP()
        parallelize_module(unnamed, init_device_mesh("cpu", (1,)), plan)  # TP on a mesh with no names
        _refused(run_dir, unnamed, r"parameter fc1.weight is a DTensor \(S\(0\)\) that FSDP2 does not manage")
        sharded = MLP()
        fully_shard(sharded.fc1)
        fully_shard(sharded)
        assert World.detect(sharded).sharded  # FSDP2 on a 1-D mesh: recorded (tests/test_distributed.py)


def test_a_deepspeed_optimizer_beside_a_plain_module_is_refused(tmp_path):
    # ZeRO-1/2 with `engine.module` and `engine.optimizer` handed over: the model looks plain,
    # the optimizer is DeepSpeed's. Refused before anything is written.
    import ckptlab
    from tests import models

    ZeroOptimizer = type("DeepSpeedZeroOptimizer", (), {"__module__": "deepspeed.runtime.zero.stage_1_and_2"})
    model, _ = models.build_mlp()
    with pytest.raises(ckptlab.RecordError, match="DeepSpeed optimizer"):
        ckptlab.Recorder(tmp_path / "r", model, ZeroOptimizer(), step_fn=models.step_mlp, build_fn=models.build_mlp)
    assert not (tmp_path / "r").exists()
