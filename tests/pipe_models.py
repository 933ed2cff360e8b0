"""A two-stage pipeline (torch.distributed.pipelining) for the pipeline tests, 2 processes, gloo.

`python -m torch.distributed.run --standalone --nproc_per_node=2 tests/pipe_models.py RUN gpipe|1f1b`
records STEPS steps (`stage-module`: gives the Recorder the stage's module, which it refuses). Each stage is built from the whole model's modules, the others deleted (torch's
pipelining tutorial, torchtitan), so its parameters keep the whole model's names: stage 0 holds
`layers.0`, stage 1 `layers.1` and `head`. Both ranks record the whole batch; the first stage
feeds its inputs, the last its targets. Two faults, far apart:
- step NAN_STEP: a NaN in row NAN_ROW of the inputs (micro-batch NAN_MICRO, row NAN_MICRO_ROW
  within it), which enters the model at stage 0; the loop skips the update of a step whose
  gradients are not finite, so training goes on;
- step LR_STEP: the last stage's optimizer runs one step with learning rate LR_JUMP (its
  scheduler's bug, say); the loss shows it at the next step.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import ckptlab

STEPS, ROWS, MICRO = 16, 4, 2
NAN_STEP, NAN_ROW = 4, 2
NAN_MICRO, NAN_MICRO_ROW = 1, 0  # row 2 of 4, split into 2 micro-batches of 2 rows
LR_STEP, LR_JUMP, LR = 12, 5.0, 1e-2
LR_STAGE = 1


class Block(nn.Module):
    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"0": Block(8, 16), "1": Block(16, 16)})
        self.head: nn.Module | None = nn.Linear(16, 1)

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x) if self.head is not None else x


def _schedule(kind: str):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.manual_seed(0)
    model = Net()
    rank = dist.get_rank()
    if rank == 0:  # the first stage: layers.0
        del model.layers["1"]
        model.head = None
    else:  # the last: layers.1 and the head
        del model.layers["0"]
    stage = PipelineStage(model, rank, dist.get_world_size(), torch.device("cpu"))
    kind_of = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind]
    schedule = kind_of(stage, n_microbatches=MICRO, loss_fn=nn.functional.mse_loss)
    return schedule, torch.optim.AdamW(model.parameters(), lr=LR)


def build_gpipe():
    return _schedule("gpipe")


def build_1f1b():
    return _schedule("1f1b")


def step(schedule, optimizer, batch):
    """One step of the pipeline: the first stage feeds the inputs, the last the targets and
    returns the loss; a step whose gradients are not finite updates nothing."""
    x, y = batch
    optimizer.zero_grad()
    losses: list = []
    if dist.get_rank() == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    if all(torch.isfinite(p.grad).all() for g in optimizer.param_groups for p in g["params"]):
        optimizer.step()
    return torch.stack(losses).mean() if losses else None


def sample_ids(step: int) -> list[int]:
    return [100 * step + r for r in range(ROWS)]


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(ROWS, 8, generator=g)
    y = x[:, :1] * 0.5 + 0.1 * torch.randn(ROWS, 1, generator=g)
    if step == NAN_STEP:
        x[NAN_ROW, 3] = float("nan")
    return (x, y), sample_ids(step)


def _stage_module_refused(run_dir: str) -> None:
    """The stage's module given as the model, not its schedule: each rank's line of what the
    Recorder says."""
    schedule, optimizer = build_gpipe()
    try:
        ckptlab.Recorder(run_dir, schedule._stage.submod, optimizer, step_fn=step, build_fn=build_gpipe)
    except ckptlab.CkptlabError as e:
        os.write(1, f"rank {dist.get_rank()}: {e}\n".encode())


def main(run_dir: str, kind: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if kind == "stage-module":
        _stage_module_refused(run_dir)
        dist.destroy_process_group()
        os._exit(0)
    build = {"gpipe": build_gpipe, "1f1b": build_1f1b}[kind]
    schedule, optimizer = build()
    config = {"ckpt_every": 5, "on_anomaly": None, "on_nonfinite": "record"}
    with ckptlab.Recorder(run_dir, schedule, optimizer, step_fn=step, build_fn=build, **config) as rec:
        for s in range(STEPS):
            if rank == LR_STAGE:  # the loop sets the learning rate before each step
                optimizer.param_groups[0]["lr"] = LR_JUMP if s == LR_STEP else LR
            b, ids = batch(s)
            rec.step(b, sample_ids=ids)
    # (gloo can abort at exit while a worker thread frees a tensor: leave at once, all done)
    dist.barrier()
    dist.destroy_process_group()
    os.write(1, f"rank {rank} recorded {STEPS} steps\n".encode())  # (one write: the ranks share the pipe)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
