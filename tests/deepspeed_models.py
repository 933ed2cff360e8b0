"""DeepSpeed's engine with ZeRO (stages 1, 2 and 3), 2 processes, gloo on the CPU: the models,
data and faults of tests/test_deepspeed.py.

`python -m torch.distributed.run --standalone --nproc_per_node=2 tests/deepspeed_models.py RUN BUILD`
records STEPS steps of a tiny MLP trained by `deepspeed.initialize` with ZeRO stage BUILD (1, 2,
3) and a torch AdamW, or ("2-adam") ZeRO-2 and DeepSpeed's own Adam, or ("3-frozen") ZeRO-3 with
a frozen parameter and a buffer, its checkpoints written on the training thread
(`async_sharded=False`), a checkpoint every 5 steps. Two faults, far apart: rank 1 meets a NaN in row
NAN_ROW of its batch at step NAN_STEP (DeepSpeed finds the gradients non-finite and skips that
update, so training goes on), and the loop sets the learning rate to LR_FAULT before step
LR_STEP alone (the next step's loss explodes).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import ckptlab
from tests.models import MLP

NAN_STEP, NAN_RANK, NAN_ROW = 7, 1, 2
LR_STEP, LR_FAULT, LR = 12, 1e4, 1e-2
STEPS, ROWS = 14, 4
CLIP = 0.5  # DeepSpeed clips inside its step: the recorded norms are from before it
DS_CHECKPOINT = 10  # also saved by engine.save_checkpoint, into RUN/../deepspeed/global_step10


def mlp(frozen: bool = False) -> MLP:
    """The model; `frozen`: with a frozen parameter (ZeRO-3 partitions it too, with no optimizer
    state) and a buffer."""
    model = MLP()
    if frozen:
        model.fc1.bias.requires_grad_(False)
        model.register_buffer("scale", torch.tensor([1.5, 2.5]))
    return model


def _build(stage: int, deepspeed_adam: bool = False, frozen: bool = False):
    import deepspeed

    # The CPU accelerator builds its shared-memory all-reduce (~1 min of gcc on first use) when
    # the engine starts; it serves inference only, and gloo runs training's collectives.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    torch.manual_seed(0)
    model = mlp(frozen)
    # (no train_batch_size: it would hold the world size, and replay explains the root step in a
    # process group of one)
    config: dict = {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
    }
    if deepspeed_adam:  # DeepSpeed's own Adam from the config: FusedAdam's CPU build (C++, built on first use)
        config["optimizer"] = {"type": "Adam", "params": {"lr": LR}}
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        trained = [p for p in model.parameters() if p.requires_grad]
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(trained, lr=LR), config=config
        )
    return engine, optimizer


def build_zero1():
    return _build(1)


def build_zero2():
    return _build(2)


def build_zero3():
    return _build(3)


def build_zero2_adam():
    return _build(2, deepspeed_adam=True)


def build_zero3_frozen():
    return _build(3, frozen=True)


def step_engine(model, optimizer, batch):
    """One step as DeepSpeed's engine runs it: forward, engine.backward, engine.step."""
    x, y = batch
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    model.step()
    return loss


def sample_ids(step: int, rank: int) -> list[int]:
    return [10_000 * rank + 100 * step + r for r in range(ROWS)]


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(ROWS, 8, generator=g)
    y = x[:, :1] * 0.5 + 0.1 * torch.randn(ROWS, 1, generator=g)
    if (step, rank) == (NAN_STEP, NAN_RANK):
        x[NAN_ROW, 3] = float("nan")
    return (x, y), sample_ids(step, rank)


BUILDS = {
    "1": build_zero1,
    "2": build_zero2,
    "3": build_zero3,
    "2-adam": build_zero2_adam,
    "3-frozen": build_zero3_frozen,
}


def main(run_dir: str, build_name: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    build = BUILDS[build_name]
    engine, optimizer = build()
    with ckptlab.Recorder(
        run_dir, engine, optimizer, step_fn=step_engine, build_fn=build, ckpt_every=5, on_nonfinite="record",
        on_anomaly=None, async_sharded=build_name != "3-frozen",  # (that one: written on the training thread)
    ) as rec:  # fmt: skip
        for s in range(STEPS):
            if s == DS_CHECKPOINT:  # DeepSpeed's own checkpoint of the state the Recorder's of this step holds
                engine.save_checkpoint(str(Path(run_dir).parent / "deepspeed"), tag=f"global_step{s}")
            optimizer.param_groups[0]["lr"] = LR_FAULT if s == LR_STEP else LR  # the loop's bug at LR_STEP
            rec.step(batch(s, rank)[0], sample_ids=sample_ids(s, rank))
            if rank == 0:  # what DeepSpeed itself computed, before its clipping
                print(f"step {s} grad norm {float(engine.get_global_grad_norm())!r}", flush=True)
    print(f"rank {rank} recorded {STEPS} steps", flush=True)
    # gloo can abort a process at exit after its work is done (a worker thread frees a tensor
    # while Python shuts down): leave the group at a barrier and end without the interpreter's teardown.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
