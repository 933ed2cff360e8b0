"""The distributed view: which rank this process is, and how ranks agree.

    world = World.detect(model)      # World(rank=0, size=1) outside torch.distributed
    rows = world.gather(vector)      # (size, len) on every rank: one small all_gather
    world.is_main                    # rank 0 writes the manifest, journal and checkpoints

ckptlab's own collectives run on a separate gloo group, on CPU tensors, from the training
thread, in the same order on every rank (after each step), so they neither touch the user's
NCCL stream nor interleave with its collectives. Decisions that change control flow (raise
NonFiniteLoss, write a checkpoint) are taken on gathered values, so every rank takes the same
one: a rank that raised alone would leave the others blocked in the next collective.

Two layouts of parameters:
- replicated (DDP, or no wrapper): every rank holds whole parameters; gradients in the hooks
  are each rank's own, before DDP averages them. Per-parameter gradient norms are recorded as
  the root mean square over ranks of the local norms; each rank's own norm is kept too.
- sharded (FSDP2 `fully_shard`, FSDP1 with `use_orig_params=True`: training/fsdp1.py):
  parameters are shards; the hooks see the reduced gradient's local shard. Squared norms of
  the shards add up to the exact global norm.
- sharded on a mesh with tensor parallelism (TP on a 1-D mesh, FSDP2 x TP on a 2-D one:
  training/mesh.py): a parameter's shards add up, divided by how many ranks hold each element
  (its `Replicate` dimensions); the ranks of a TP group share one batch, and `data_ranks`
  says which data-parallel rank each process is.

- pipeline (torch.distributed.pipelining, one stage per rank: training/pipeline.py): each rank
  holds its stage's whole parameters, and fills its stage's slots of the whole model's vectors;
  the rows add up (`stages`).
- ZeRO (DeepSpeed's engine, stages 1-3: `zero` is the stage): each rank holds a part of the
  optimizer state, of the averaged gradients (the probe reads those) and, at stage 3, of the
  parameters; the parts' squared norms add up, as FSDP2's shards do (training/zero.py).

Nothing else: FSDP1 without the model's own parameters, DeepSpeed's pipeline engine or a
DeepSpeed setup that training/zero.py `problem` names, HSDP or a mesh of more than two
dimensions, or a schedule of several stages per rank, is refused when the Recorder starts
(`unsupported`), before anything is written: no layout would describe it, and a partial record
would replay wrong.

A process that a launcher started (torchrun, also under srun) knows its place from the
launcher's environment (`launched`): a replay there joins the job instead of spawning ranks.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ckptlab.training import fsdp1, pipeline
from ckptlab.training import zero as zero_engine
from ckptlab.training.mesh import MeshLayout, problem
from ckptlab.training.wrappers import module_chain, own_name, torch_module, unwrap


def local(t: torch.Tensor) -> torch.Tensor:
    """The local part of a DTensor (a shard), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def is_sharded(t: torch.Tensor) -> bool:
    return callable(getattr(t, "to_local", None))


@dataclass
class World:
    rank: int = 0
    size: int = 1
    sharded: bool = False
    group: Any = None
    backend: str | None = None
    stages: pipeline.Stages | None = None  # a pipeline: this rank's stage, and the others'
    zero: int | None = None  # DeepSpeed's ZeRO stage (training/zero.py), else None
    _ckpt_group: Any = field(default=None, repr=False)
    # Tensor parallelism (training/mesh.py): per parameter, how many ranks hold each element
    # of its gradient; per process, its data-parallel rank. None without a TP mesh.
    replicas: np.ndarray | None = field(default=None, repr=False)
    data_ranks: tuple[int, ...] | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def computes_loss(self) -> bool:
        """This rank's step returns the loss (a pipeline's stages before the last compute none)."""
        return self.stages is None or self.stages.is_last

    @property
    def checkpoints_sharded(self) -> bool:
        """Every rank writes its part of each checkpoint (DCP): FSDP2's shards, a pipeline's stages."""
        return self.sharded or self.stages is not None

    @property
    def gathers_whole(self) -> bool:
        """Each rank holds a part of the state (FSDP2, ZeRO): a snapshot is gathered whole on rank 0."""
        return self.sharded or self.zero is not None

    @staticmethod
    def detect(model: Any = None, optimizer: Any = None) -> World:
        """This process's world, for `model` (a pipeline: its schedule, and `optimizer`, the
        stage's). Collective in a distributed job: every rank calls it."""
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
        if model is not None and (why := unsupported(model, dist.get_world_size() if initialized else None)):
            from ckptlab.errors import RecordError

            raise RecordError(why, hint="docs/distributed.md, Limits, says what ckptlab records")
        if not initialized:
            return World()
        module = torch_module(model) if model is not None else None
        sharded = module is not None and (any(is_sharded(p) for p in module.parameters()) or bool(fsdp1.units(module)))
        engine = zero_engine.engine_of(model)
        zero = zero_engine.stage(engine) if engine is not None else None
        backend = str(dist.get_backend())
        if dist.get_world_size() == 1:  # one process; FSDP2 on one device still has DTensor shards
            return World(sharded=sharded, backend=backend, zero=zero)  # (the backend says: replay needs a group)
        # Every rank constructs its Recorder, so creating the group here is collective.
        group = dist.new_group(backend="gloo") if backend != "gloo" else None
        size = dist.get_world_size()
        layout = MeshLayout.of(module, size) if module is not None and sharded else None
        world = World(dist.get_rank(), size, sharded, group, backend, zero=zero)
        if layout is not None:
            world.replicas, world.data_ranks = layout.replicas, layout.data_ranks
        stage = pipeline.stage_of(model)
        if stage is not None:
            world.stages = pipeline.Stages.gather(stage, model, optimizer, world)
        elif module is not None:
            _same_models(world, module)
        return world

    def checkpoint_group(self) -> Any:
        """A gloo group of its own for background checkpoint writes (their collectives run on
        another thread, and must not interleave with the training's). Collective, the first
        time: every rank asks at the same step."""
        if not self.distributed:
            return None
        if self._ckpt_group is None:
            import torch.distributed as dist

            self._ckpt_group = dist.new_group(backend="gloo")
        return self._ckpt_group

    def gather(self, vec: np.ndarray) -> np.ndarray:
        """Every rank's `vec` (float64, same length on all ranks), as rows, on every rank."""
        vec = np.asarray(vec, dtype=np.float64)
        if not self.distributed:
            return vec[None, :]
        import torch.distributed as dist

        mine = torch.from_numpy(vec.copy())
        out = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(out, mine, group=self.group)
        return torch.stack(out).numpy()

    def combine(self, rows: np.ndarray) -> np.ndarray:
        """Per-parameter squared norms from every rank -> the global ones: shards (FSDP2's, ZeRO's
        parts, a pipeline's stages, each in its own slots) add up; replicated copies are averaged
        (root mean square of the ranks' norms); on a TP mesh, the shards' sum divided by how many
        ranks hold each element."""
        if self.replicas is not None:
            return rows.sum(axis=0) / self.replicas
        return rows.sum(axis=0) if self.gathers_whole or self.stages is not None else rows.mean(axis=0)

    def count(self, rows: np.ndarray) -> np.ndarray:
        """Per-parameter counts of elements (non-finite gradients) from every rank -> the
        total: each rank's own add up; on a TP mesh an element that several ranks hold (the
        same gradient on each) counts once."""
        total = rows.sum(axis=0)
        return np.rint(total / self.replicas) if self.replicas is not None else total

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def broadcast(self, obj: Any) -> Any:
        """`obj` from rank 0 to every rank (our own in-memory values, never file contents)."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out


@contextlib.contextmanager
def solo_world(needed: bool):
    """A process group of one, so a build_fn that wraps its model in DDP or fully_shard works
    in a single-process replay; with the launcher's variables of a job of one where none are set
    (deepspeed.initialize asserts that LOCAL_RANK is set)."""
    import torch.distributed as dist

    if not needed or not dist.is_available() or dist.is_initialized():
        yield
        return
    own = {k: v for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items() if k not in os.environ}
    os.environ.update(own)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        zero_engine.destroy_process_group()
        for k in own:
            os.environ.pop(k, None)


@dataclass(frozen=True)
class Launch:
    """This process as one rank of a job that a launcher started (torchrun, also under srun or
    an MPI-style scheduler that sets torchrun's variables)."""

    rank: int
    size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what torch's env:// rendezvous reads


def launched() -> Launch | None:
    """The job this process was launched into (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT), or None: not launched, or the variables are incomplete."""
    env = os.environ
    if not all(env.get(v) for v in LAUNCH_VARS):
        return None
    try:
        return Launch(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK") or env["RANK"]))
    except ValueError:
        return None


# --- what is not recorded: some DeepSpeed setups, meshes, FSDP1 and pipelines that nothing describes ---


def unsupported(model: Any, world_size: int | None = None) -> str | None:
    """Why `model` cannot be recorded (one line: what it is, what ckptlab records, what to do),
    or None. Told apart by class names and attributes, without importing DeepSpeed: a DeepSpeed
    engine set up as ckptlab does not record it (training/zero.py `problem`), a module of
    DeepSpeed's or a ZeRO-3 partitioned parameter outside its engine, a pipeline object other
    than a single-stage schedule over the whole job (training/pipeline.py `refusal`; the stage's
    module is checked as any model), FSDP1 that hides the model's own parameters
    (training/fsdp1.py), a DTensor parameter on a mesh that training/mesh.py does not describe
    (HSDP, more than two dimensions). A framework's wrapper (Fabric's module around a DeepSpeed
    engine) is looked through; parameters are named as the model names them
    (training/wrappers.py `unwrap`, `own_name`)."""
    if not isinstance(model, torch.nn.Module) and pipeline.is_pipelining(model):
        why = pipeline.refusal(model, world_size)
        return why or unsupported(torch_module(model))
    chain = module_chain(model) if isinstance(model, torch.nn.Module) else [model]
    engine = zero_engine.engine_of(model)
    if engine is not None and engine is not model:  # (Lightning Fabric's DeepSpeed strategy, say: not tested)
        return (
            f"cannot record a DeepSpeed model ({type(engine).__name__}) inside {type(model).__name__}: ckptlab "
            "records DeepSpeed's engine as deepspeed.initialize returns it"
        )
    if engine is not None:
        return zero_engine.problem(engine)
    other = next((m for m in chain if zero_engine.is_deepspeed(m)), None)
    if other is not None:
        return (
            f"cannot record a DeepSpeed model ({type(other).__name__}) outside its engine: record the "
            "DeepSpeedEngine that deepspeed.initialize returned, with its optimizer"
        )
    names = {f"{c.__module__}.{c.__qualname__}" for m in chain for c in type(m).__mro__}
    if any(n.startswith("torch.distributed.pipelining.") for n in names):  # (a Pipe: the split model)
        return pipeline.refusal(model, world_size)
    if not isinstance(model, torch.nn.Module):
        return None
    why = fsdp1.refusal(model)
    if why:
        return why
    import torch.distributed as dist

    size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    for name, p in unwrap(model).named_parameters():
        if hasattr(p, "ds_id") or hasattr(p, "ds_status"):
            return (
                f"cannot record this model: parameter {name} is partitioned by DeepSpeed ZeRO-3, and the model "
                "given is not its engine: record the DeepSpeedEngine that deepspeed.initialize returned"
            )
        why = problem(model, name, p, size)
        if why:
            return f"cannot record this model: parameter {own_name(name)} {why}"
    return None


def _same_models(world: World, module: torch.nn.Module) -> None:
    """Every rank holds the same model (by its parameters' full shapes: FSDP1's views into a
    shard count as their own shape): a pipeline stage's module given as the model is not one,
    and would fail mid-run. Collective."""
    shapes = fsdp1.full_shapes(module)
    mine = tuple(tuple(shapes.get(id(p)) or zero_engine.shape_of(p)) for p in module.parameters())
    if len({*world.gather_objects(mine)}) > 1:
        from ckptlab.errors import RecordError

        raise RecordError(
            "the ranks' models have different parameters (a pipeline stage's module given as the model?): "
            "give the Recorder the pipeline's schedule, or on every rank the whole model"
        )
