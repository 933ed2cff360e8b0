"""Pipeline stages (torch.distributed.pipelining): one stage per rank, under a single-stage
schedule (`ScheduleGPipe`, `Schedule1F1B`).

    stage = stage_of(schedule)                 # its PipelineStage, or None for anything else
    stages = Stages.gather(stage, schedule, optimizer, world)   # collective: every stage's names
    stages.spread(local, fill)                 # this stage's per-parameter numbers, in the whole's
    micro_row(row, rows, n)                    # (micro-batch, row within it), as the schedule splits

The Recorder and replay are given the schedule, and `step_fn` receives it; what ckptlab measures
and checkpoints is the stage's module (`stage.submod`, training/wrappers.py `torch_module`). The
stages' parameters together are the model's: the run's parameter list is the stages' lists in
stage order (a stage built from the whole model's modules, as torch's tutorial and torchtitan
do, keeps the whole model's names: `layers.3.attn.wq.weight`), and so are its learning rates
(each stage's optimizer's groups, in stage order). Each step's health is gathered as under FSDP2:
every rank puts its own numbers in its stage's slots of the whole vector (`spread`) and the
rows add up, exactly, since no slot has two writers; the loss is the last stage's.

A schedule splits each batch into its micro-batches along dimension 0 with `torch.tensor_split`
(the first `rows % n` micro-batches one row longer), after inferring the shapes it sends
between stages from its first step's micro-batch: a batch that does not split into micro-batches
of that shape cannot go through it (`split_fits`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptlab.errors import RecordError
from ckptlab.training.wrappers import PIPELINE_SINGLE as _SINGLE
from ckptlab.training.wrappers import stage_of, torch_optimizer, unwrap

__all__ = ["Stages", "is_pipelining", "micro_row", "micro_sizes", "refusal", "split_fits", "stage_of"]

# Schedules that run several stages on one rank (interleaved, looped, zero-bubble, DualPipeV):
# their base class, by name (told apart without importing torch.distributed.pipelining).
_MULTI = "torch.distributed.pipelining.schedules.PipelineScheduleMulti"
_STAGE = "torch.distributed.pipelining.stage._PipelineStageBase"


def _mro(obj: Any) -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in type(obj).__mro__}


def is_pipelining(obj: Any) -> bool:
    """Any object of torch.distributed.pipelining's (a schedule, a stage, a Pipe)."""
    return any(n.startswith("torch.distributed.pipelining.") for n in _mro(obj))


def refusal(obj: Any, world_size: int | None) -> str | None:
    """Why a torch.distributed.pipelining object given to the Recorder cannot be recorded (one
    line naming it), or None: a single-stage schedule whose stages span the whole job."""
    kind = type(obj).__name__
    names = _mro(obj)
    if _MULTI in names:
        return (
            f"cannot record a pipeline schedule that runs several stages per rank ({kind}): ckptlab records one "
            "stage per rank, under ScheduleGPipe or Schedule1F1B"
        )
    if _STAGE in names or _SINGLE not in names:
        return (
            f"cannot record a pipeline-parallel model given as its {kind}: give the Recorder the schedule that "
            "runs the stage (ScheduleGPipe or Schedule1F1B), which step_fn then receives"
        )
    stage = stage_of(obj)
    if stage is None:
        return f"cannot record this pipeline schedule ({kind}): it holds no stage"
    size = getattr(stage, "group_size", None)
    if world_size is not None and size is not None and size != world_size:
        return (
            f"cannot record pipeline stages inside a larger job ({size} stages in {world_size} processes: "
            "pipeline x data parallel): ckptlab records a pipeline whose stages are the whole job"
        )
    return None


@dataclass
class Stages:
    """The pipeline this rank is a stage of: its place, and where each stage's parameters and
    learning rates sit among the whole model's."""

    stage: int  # this rank's stage
    count: int  # stages in all (one per rank)
    schedule: str  # the schedule's class name
    micro_batches: int
    names: list[str]  # every stage's parameter names, in stage order
    param_slots: list[tuple[int, int]]  # each stage's (first, count) in `names`
    group_slots: list[tuple[int, int]]  # each stage's (first, count) among the learning rates

    @property
    def first(self) -> int:
        """This stage's first parameter among the whole model's."""
        return self.param_slots[self.stage][0]

    @property
    def is_last(self) -> bool:
        """This stage computes the loss."""
        return self.stage == self.count - 1

    @staticmethod
    def gather(stage, schedule, optimizer, world) -> Stages:
        """Collective (every rank, once): every stage's parameter names and group count, so
        that every rank knows the whole model's layout. RecordError when two stages name a
        parameter alike (stages split by hand, each with its own numbering): their slots in
        the run, and their checkpoints' keys, would collide."""
        index = int(stage.stage_index)
        if index != world.rank:
            raise RecordError(f"pipeline stage {index} runs on rank {world.rank}: ckptlab records stage i on rank i")
        mine = ([n for n, _ in unwrap(stage.submod).named_parameters()], len(torch_optimizer(optimizer).param_groups))
        every = world.gather_objects(mine)
        names: list[str] = []
        param_slots, group_slots, groups = [], [], 0
        for s, (stage_names, n_groups) in enumerate(every):
            clash = sorted(set(stage_names) & set(names))
            if clash:
                raise RecordError(
                    f"pipeline stage {s} names parameter {clash[0]} as an earlier stage does: build each stage from "
                    "the whole model's modules (deleting the others, as torch's pipelining tutorial does), so that "
                    "every parameter keeps the whole model's name"
                )
            param_slots.append((len(names), len(stage_names)))
            group_slots.append((groups, n_groups))
            names += stage_names
            groups += n_groups
        n = int(getattr(schedule, "_n_microbatches", 1))
        return Stages(index, len(every), type(schedule).__name__, n, names, param_slots, group_slots)

    def spread(self, local: np.ndarray, fill: float, *, groups: bool = False) -> np.ndarray:
        """This stage's values (one per parameter, or per parameter group) in the whole
        model's vector, `fill` in the other stages' slots."""
        first, count = (self.group_slots if groups else self.param_slots)[self.stage]
        total = sum(c for _, c in (self.group_slots if groups else self.param_slots))
        out = np.full(total, fill, dtype=np.float64)
        out[first : first + count] = np.asarray(local, dtype=np.float64)[:count]
        return out

    def describe(self) -> dict:
        """The manifest's `pipeline`."""
        return {
            "schedule": self.schedule,
            "stages": self.count,
            "micro_batches": self.micro_batches,
            "groups": [list(range(first, first + n)) for first, n in self.group_slots],
        }


def micro_sizes(rows: int, n: int) -> list[int]:
    """The rows of each micro-batch when `torch.tensor_split` splits `rows` into `n`."""
    q, r = divmod(rows, n)
    return [q + 1 if i < r else q for i in range(n)]


def micro_row(row: int, rows: int, n: int) -> tuple[int, int]:
    """(micro-batch, row within it) of batch row `row`, as a schedule splits `rows` into `n`."""
    first = 0
    for m, size in enumerate(micro_sizes(rows, n)):
        if row < first + size:
            return m, row - first
        first += size
    raise ValueError(f"row {row} is outside a batch of {rows} rows")


def split_fits(rows: int | None, recorded: int | None) -> bool:
    """Whether a batch of `rows` rows can go through a schedule whose shapes were inferred
    from batches of `recorded` rows (the same number: its micro-batches have the same shape)."""
    return rows is None or recorded is None or rows == recorded
