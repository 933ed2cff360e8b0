"""Models for the tensor-parallel and FSDP1 tests: the tiny MLP of tests/models.py under
`parallelize_module` on a 1-D mesh (2 processes, "tp"), FSDP2 x TP on a 2-D (dp, tp) mesh
(4 processes, "fsdp_tp"), and under torch's FSDP1 `FullyShardedDataParallel` (2 processes,
"fsdp1"), gloo on the CPU.

    python -m torch.distributed.run --standalone --nproc_per_node=N tests/parallel_models.py RUN tp|fsdp_tp|fsdp1

One run holds two faults far apart: the scheduler multiplies the learning rate of step LR_STEP
by LR_SPIKE (a bug in the schedule: the update explodes, the loss jumps at the step after it,
AdamW recovers), then at NAN_STEP the data-parallel rank NAN_DATA_RANK meets a NaN in row
NAN_ROW of its batch (every rank of its tensor-parallel group gets that same batch) and the
run stops. Each rank prints `rank R stopped at step S` (FAULT_STEP: where NonFiniteLoss came).
"""

from __future__ import annotations

import os
import re
import sys

import torch

import ckptlab
from tests.models import MLP, step_mlp

LR_STEP, LR_SPIKE = 6, 30.0  # the schedule's bug: step 6's learning rate x30
NAN_STEP, NAN_ROW = 12, 2
STEPS, ROWS, TP = 15, 4, 2
NAN_DATA_RANK = {"tp": 0, "fsdp_tp": 1, "fsdp1": 1}  # the only data-parallel rank of a 1-D TP mesh is 0
WORLD = {"tp": 2, "fsdp_tp": 4, "fsdp1": 2}


def _spike(step: int) -> float:
    return LR_SPIKE if step == LR_STEP else 1.0


def _optimize(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, _spike)


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def _tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


def build_tp():
    """Megatron-style TP over every process (data parallel degree 1). The mesh is made from
    the world's size: replay explains the root step in a process group of one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model = MLP()
    parallelize_module(model, init_device_mesh("cpu", (_world(),), mesh_dim_names=("tp",)), _tp_plan())
    return _optimize(model)


def build_fsdp_tp():
    """TP inside each pair of processes, FSDP2 across the pairs (torchtitan's layout)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    tp = min(TP, _world())
    mesh = init_device_mesh("cpu", (_world() // tp, tp), mesh_dim_names=("dp", "tp"))
    model = MLP()
    parallelize_module(model, mesh["tp"], _tp_plan())
    fully_shard(model.fc1, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return _optimize(model)


def build_fsdp1():
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    return _optimize(FullyShardedDataParallel(MLP(), device_id=torch.device("cpu"), use_orig_params=True))


def step_fsdp1(model, optimizer, batch):
    """FSDP1 clips with its own method: torch's clip_grad_norm_ would see this rank's shard only."""
    x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    model.clip_grad_norm_(1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


BUILDS = {"tp": build_tp, "fsdp_tp": build_fsdp_tp, "fsdp1": build_fsdp1}
STEPS_FN = {"tp": step_mlp, "fsdp_tp": step_mlp, "fsdp1": step_fsdp1}


def data_rank(kind: str, rank: int) -> int:
    """The data-parallel rank of process `rank`: processes of one TP group share a batch."""
    return 0 if kind == "tp" else rank // TP if kind == "fsdp_tp" else rank


def sample_ids(step: int, data: int) -> list[int]:
    return [10_000 * data + 100 * step + r for r in range(ROWS)]


def batch(kind: str, step: int, data: int):
    g = torch.Generator().manual_seed(1000 * data + step)
    x = torch.randn(ROWS, 8, generator=g)
    y = x[:, :1] * 0.5 + 0.1 * torch.randn(ROWS, 1, generator=g)
    if (step, data) == (NAN_STEP, NAN_DATA_RANK[kind]):
        x[NAN_ROW, 3] = float("nan")
    return (x, y), sample_ids(step, data)


def main(run_dir: str, kind: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    build = BUILDS[kind]
    model, opt, scheduler = build()
    stopped = STEPS
    with ckptlab.Recorder(
        run_dir,
        model,
        opt,
        scheduler=scheduler,
        step_fn=STEPS_FN[kind],
        build_fn=build,
        ckpt_every=5,
        health_every=1,
        on_anomaly=None,
    ) as rec:
        for s in range(STEPS):
            b, ids = batch(kind, s, data_rank(kind, rank))
            try:
                rec.step(b, sample_ids=ids)
            except ckptlab.NonFiniteLoss:
                stopped = s
                break
    print(f"rank {rank} stopped at step {stopped}", flush=True)
    # gloo's worker threads can abort the interpreter's exit (pytorch/pytorch#190489): leave
    # once every rank is done, without the shutdown that races them.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


# --- what the tests check (tests/test_tensor_parallel.py, tests/test_fsdp1.py) -------------------


def record(kind: str, run_dir):
    """Record `kind` under torchrun into `run_dir` (every rank stops at NAN_STEP)."""
    from tests.integrations.ddp_launch import torchrun

    said = "".join(torchrun("parallel_models.py", run_dir, WORLD[kind], kind))
    # (the ranks' lines share torchrun's stdout: two may come out on one line)
    assert sorted(re.findall(r"rank (\d+) stopped at step (\d+)", said)) == [
        (str(r), str(NAN_STEP)) for r in range(WORLD[kind])
    ], said
    return run_dir


def reference_norms(kind: str, step: int = 0) -> list[float]:
    """Each parameter's gradient norm at the first step, computed whole in this process: the
    mean of the data-parallel ranks' gradients (what FSDP's reduction makes), clipping aside."""
    torch.manual_seed(0)
    model = MLP()
    grads = []
    for data in sorted({data_rank(kind, r) for r in range(WORLD[kind])}):
        model.zero_grad()
        (x, y), _ = batch(kind, step, data)
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return [float(torch.stack(g).mean(0).norm()) for g in zip(*grads)]


def assert_nan_replay(doc: dict, kind: str) -> None:
    """`ckptlab replay --step NAN_STEP --json` of a `kind` run: every replayed step bit for bit
    on every process, the NaN's step, its data-parallel rank, row and sample, the data."""
    data = NAN_DATA_RANK[kind]
    assert (doc["root_step"], doc["rank"]) == (NAN_STEP, data), doc["verdict"]
    assert doc["reproduced"] and doc["deterministic"] and doc["bit_exact"]
    steps = doc["steps"]
    assert [s["step"] for s in steps] == list(range(10, NAN_STEP + 1)) and all(s["match"] for s in steps)
    assert all(s["rank_loss"] == s["recorded_rank_loss"] and len(s["rank_loss"]) == WORLD[kind] for s in steps)
    assert doc["origin"]["kind"] == "data"
    assert [(s["row"], s["sample_id"]) for s in doc["samples"]] == [(NAN_ROW, sample_ids(NAN_STEP, data)[NAN_ROW])]
    assert doc["counterfactuals"][0]["fault"] is False  # without that row, the step is healthy


def assert_lr_replay(report) -> None:
    """A replay of step LR_STEP: bit for bit, the optimizer's update blamed, no sample, and the
    step healthy at the recent learning rate; the worst parameter by the model's own name."""
    assert report.root_step == LR_STEP and report.reproduced, report.verdict
    assert report.deterministic and report.bit_exact and all(c.match for c in report.steps)
    assert report.origin.kind == "optimizer" and report.origin.param_group == 0 and report.samples == []
    assert report.origin.parameter in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
    assert f"{LR_SPIKE:g}x its recent value" in report.origin.detail
    lr_check = report.counterfactuals[0]
    assert "learning rate" in lr_check.question and lr_check.fault is False
    # traced in one process on the faulty rank's batch: compared with that rank's own loss
    assert not any("traced step" in n for n in report.notes), report.notes


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
