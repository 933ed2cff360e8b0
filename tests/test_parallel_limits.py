"""What ckptlab does not record (DeepSpeed's parts outside its engine, pipeline schedules of several
stages per rank, FSDP1 without the model's own parameters, meshes other than TP and FSDP2 x TP;
DeepSpeed setups it does not record: tests/test_deepspeed.py) is refused when the
Recorder starts, in one line, with nothing written: never a partial record that replays wrong."""

from __future__ import annotations

import pytest
import torch

import ckptlab
from ckptlab.analysis.diff.names import canonical
from ckptlab.errors import RecordError
from ckptlab.training.probe import named_parameters
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


def test_pipeline_objects_but_a_schedule_of_one_stage_per_rank_are_refused(run_dir):
    """Real pipelining objects, in a process group of one: a PipelineStage handed over instead
    of its schedule (step_fn runs the step through the schedule), and a schedule that runs
    several stages on one rank, which ckptlab does not record; each named in its one line."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    with solo_world(True):
        stages = [PipelineStage(MLP(), i, 2, torch.device("cpu")) for i in range(2)]
        _refused(run_dir, stages[0], r"given as its PipelineStage: give the Recorder the schedule that runs the stage")
        looped = ScheduleInterleaved1F1B(stages, n_microbatches=2, loss_fn=torch.nn.functional.mse_loss)
        _refused(run_dir, looped, r"pipeline schedule that runs several stages per rank \(ScheduleInterleaved1F1B\)")


def test_fsdp1_is_refused_only_where_it_hides_the_models_own_parameters(run_dir):
    """Real FSDP1 units (in a process group of one): with use_orig_params=False the model's
    parameters are flat shards named `_flat_param`; with True they are the model's own
    (recorded: tests/test_tensor_parallel.py)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from ckptlab.training.world import World

    cpu = torch.device("cpu")
    with solo_world(True):
        flat = FullyShardedDataParallel(MLP(), device_id=cpu)
        _refused(
            run_dir, flat, r"the model is wrapped by FSDP1 \(FullyShardedDataParallel\) with use_orig_params=False"
        )
        own = MLP()
        own.fc1 = FullyShardedDataParallel(own.fc1, device_id=cpu, use_orig_params=True)
        own = FullyShardedDataParallel(own, device_id=cpu, use_orig_params=True)
        world = World.detect(own)
        assert world.sharded and world.data_ranks is None
        names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
        assert [n for n, _ in named_parameters(own)] == names  # the probe's, the manifest's, replay's
        assert [canonical(n) for n, _ in own.named_parameters()] == names  # `ckptlab diff`'s, of a state dict


def test_meshes_other_than_tp_and_fsdp2_x_tp_are_refused(run_dir):
    """Real DTensors on real meshes of one process: HSDP (FSDP2 given a 2-D mesh: its replicas
    train on different batches) and a 3-D mesh are refused; TP on a 1-D mesh and FSDP2 x TP
    on a 2-D one are recorded, their processes' data-parallel ranks known."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from ckptlab.training.world import unsupported

    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    with solo_world(True):
        hsdp = MLP()
        fully_shard(hsdp, mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")))
        _refused(
            run_dir, hsdp, r"parameter fc1.weight is replicated along .* 2-D device mesh \(replicate, shard\) .*HSDP"
        )
        mesh3 = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        deep = MLP()
        parallelize_module(deep, mesh3["tp"], plan)
        fully_shard(deep, mesh=mesh3["dp_replicate", "dp_shard"])
        _refused(
            run_dir, deep, r"parameter fc1.weight is a DTensor on a 3-D device mesh \(dp_replicate, dp_shard, tp\)"
        )
        mesh2 = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        tp = MLP()
        parallelize_module(tp, mesh2["tp"], plan)
        assert unsupported(tp) is None
        fully_shard(tp, mesh=mesh2["dp"])  # FSDP2 over TP
        assert unsupported(tp) is None


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
