"""Models and data for the distributed tests (DDP and FSDP2, 2 processes, gloo on the CPU).

`python -m torch.distributed.run --standalone --nproc_per_node=2 tests/dist_models.py RUN ddp|ddp-wide|fsdp [KILL_STEP|resume]`
records a run (the DDP one's build_fn/step_fn write to fd 1); rank 1 meets a NaN in row 2 of its batch at step NAN_STEP.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

import ckptlab
from tests.models import MLP, step_mlp

NAN_STEP, NAN_RANK, NAN_ROW = 17, 1, 2
STEPS, ROWS = 30, 4
RAISE_STEP = 12  # "ddp-raise", "fsdp-raise": rank 1's batch there makes step_fn raise (before its backward)


def build_ddp():
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.write(1, b"chatty ddp build_fn\n")  # user code that prints: `replay --json` keeps it off stdout
    torch.manual_seed(0)
    model = DDP(MLP())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def build_ddp_wide():
    """DDP over a wider MLP (2,000 parameters, one bucket): over more than two processes the
    bucket's layout decides the bits of the averaged gradient (a ring all-reduce starts each
    chunk's sum at another rank), and DDP lays it out anew after its first step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(MLP(hidden=200))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)  # (Adam's update would hide a last bit)


def step_ddp(model, optimizer, batch):
    os.write(1, b"chatty ddp step_fn\n")
    return step_mlp(model, optimizer, batch)


def step_ddp_raise(model, optimizer, batch):
    """A data check in the user's step that fails on one rank's batch (a bad token id, say):
    the other rank goes on into the backward's all-reduce and waits there."""
    x, _ = batch
    if x.abs().max() > 1e6:
        raise ValueError("input out of range")
    return step_mlp(model, optimizer, batch)


def build_fsdp():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = MLP()
    fully_shard(model.fc1)
    fully_shard(model.fc2)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def sample_ids(step: int, rank: int) -> list[int]:
    return [10_000 * rank + 100 * step + r for r in range(ROWS)]


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(ROWS, 8, generator=g)
    y = x[:, :1] * 0.5 + 0.1 * torch.randn(ROWS, 1, generator=g)
    if (step, rank) == (NAN_STEP, NAN_RANK if int(os.environ.get("WORLD_SIZE", "2")) > 1 else 0):
        x[NAN_ROW, 3] = float("nan")
    if (step, rank) == (RAISE_STEP, 1) and os.environ.get("CKPTLAB_TEST_RAISE"):
        x[0, 0] = 1e9
    return (x, y), sample_ids(step, rank)


def main(run_dir: str, kind: str, kill_step: int | None = None, resume: bool = False) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if kind.endswith("-raise"):
        os.environ["CKPTLAB_TEST_RAISE"] = "1"
    build, step = {
        "ddp": (build_ddp, step_ddp),
        "ddp-wide": (build_ddp_wide, step_mlp),
        "ddp-raise": (build_ddp, step_ddp_raise),
        "fsdp-raise": (build_fsdp, step_ddp_raise),
    }.get(kind, (build_fsdp, step_mlp))
    model, opt = build()
    with ckptlab.Recorder(
        run_dir, model, opt, step_fn=step, build_fn=build, ckpt_every=5, on_anomaly=None, resume=resume
    ) as rec:
        for s in range(rec.next_step, STEPS):  # (a resumed run continues its numbering)
            if s == kill_step and rank == 1:
                if kind == "ddp":  # (rank 0 writes its checkpoints in the background: the test checks one survives)
                    _committed(run_dir, (s - 1) // 5 * 5)
                os.kill(os.getpid(), signal.SIGKILL)
            b, ids = batch(s, rank)
            try:
                rec.step(b, sample_ids=ids)
            except ckptlab.NonFiniteLoss:
                break
            print(f"rank {rank} step {s} returned", flush=True)
    # gloo can abort at exit while a worker thread frees a tensor: leave without the teardown
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _committed(run_dir: str, step: int, wait_s: float = 120.0) -> None:
    """Wait until checkpoint `step` is committed (rank 0 writes a DDP run's in the background)."""
    import time

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if step in ckptlab.open_run(run_dir).checkpoints:
            return
        time.sleep(0.05)


if __name__ == "__main__":
    extra = sys.argv[3] if len(sys.argv) > 3 else None
    main(sys.argv[1], sys.argv[2], int(extra) if extra and extra.isdigit() else None, resume=extra == "resume")
