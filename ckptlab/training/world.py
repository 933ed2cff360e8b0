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
- sharded (FSDP2 `fully_shard`): parameters are DTensor shards; the hooks see the reduced
  gradient's local shard. Squared norms of the shards add up to the exact global norm.

- ZeRO (DeepSpeed's engine, stages 1-3: `zero` is the stage): each rank holds a part of the
  optimizer state, of the averaged gradients (the probe reads those) and, at stage 3, of the
  parameters; the parts' squared norms add up, as FSDP2's shards do (training/zero.py).

Nothing else: a model under FSDP1, DeepSpeed's pipeline engine or a DeepSpeed setup that
training/zero.py `problem` names, with tensor-parallel DTensors or on a mesh of more than one
dimension, or a pipeline stage, is refused when the Recorder starts (`unsupported`), before
anything is written: no layout would describe it, and a partial record would replay wrong.

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

from ckptlab.training import zero as zero_engine
from ckptlab.training.wrappers import module_chain, unwrap


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
    zero: int | None = None  # DeepSpeed's ZeRO stage (training/zero.py), else None
    _ckpt_group: Any = field(default=None, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def gathers_whole(self) -> bool:
        """Each rank holds a part of the state (FSDP2, ZeRO): a snapshot is gathered whole on rank 0."""
        return self.sharded or self.zero is not None

    @staticmethod
    def detect(model: torch.nn.Module | None = None) -> World:
        import torch.distributed as dist

        if model is not None and (why := unsupported(model)):
            from ckptlab.errors import RecordError

            raise RecordError(why, hint="docs/distributed.md, Limits, says what ckptlab records")
        if not (dist.is_available() and dist.is_initialized()):
            return World()
        sharded = model is not None and any(is_sharded(p) for p in model.parameters())
        engine = zero_engine.engine_of(model)
        zero = zero_engine.stage(engine) if engine is not None else None
        backend = str(dist.get_backend())
        if dist.get_world_size() == 1:  # one process; FSDP2 on one device still has DTensor shards
            return World(sharded=sharded, backend=backend, zero=zero)  # (the backend says: replay needs a group)
        # Every rank constructs its Recorder, so creating the group here is collective.
        group = dist.new_group(backend="gloo") if backend != "gloo" else None
        return World(dist.get_rank(), dist.get_world_size(), sharded, group, backend, zero)

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
        parts) add up; replicated copies are averaged (root mean square of the ranks' norms)."""
        return rows.sum(axis=0) if self.gathers_whole else rows.mean(axis=0)

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


# --- what is not recorded: some DeepSpeed setups, tensor and pipeline parallelism -------------------------------


def unsupported(model: Any) -> str | None:
    """Why `model` cannot be recorded (one line: what it is, what ckptlab records, what to do),
    or None. Told apart by class names and attributes, without importing DeepSpeed: a DeepSpeed
    engine set up as ckptlab does not record it (training/zero.py `problem`), a module of
    DeepSpeed's or a ZeRO-3 partitioned parameter outside its engine, a pipeline stage, FSDP1's
    wrapper, a DTensor parameter on a mesh of more than one dimension or outside FSDP2 (tensor
    parallelism). A framework's wrapper (Fabric's module around a DeepSpeed engine) is looked
    through; parameters are named as the model names them (training/wrappers.py `unwrap`)."""
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
    if any(n.startswith("torch.distributed.pipelining.") for n in names):
        return (
            f"cannot record a pipeline-parallel model ({type(model).__name__}): a stage holds part of the "
            "model and sees part of each step; record the whole model under DDP or FSDP2"
        )
    if not isinstance(model, torch.nn.Module):
        return None
    fsdp1 = next((n for n, m in model.named_modules() if _is_fsdp1(m)), None)
    if fsdp1 is not None:
        return (
            f"cannot record this model: {f'module {fsdp1}' if fsdp1 else 'it'} is wrapped by FSDP1 "
            "(FullyShardedDataParallel), whose flat parameter shards neither layout describes; "
            "ckptlab records FSDP2: shard with torch.distributed.fsdp.fully_shard"
        )
    model = unwrap(model)
    for name, p in model.named_parameters():
        if hasattr(p, "ds_id") or hasattr(p, "ds_status"):
            return (
                f"cannot record this model: parameter {name} is partitioned by DeepSpeed ZeRO-3, and the model "
                "given is not its engine: record the DeepSpeedEngine that deepspeed.initialize returned"
            )
        why = _dtensor_problem(model, name, p)
        if why:
            return why
    return None


def _is_fsdp1(module: torch.nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "FullyShardedDataParallel" and cls.__module__.startswith("torch.distributed.fsdp")


def _dtensor_problem(model: torch.nn.Module, name: str, p: torch.Tensor) -> str | None:
    """A DTensor parameter that is not FSDP2's shard on a 1-D mesh: tensor parallelism (a
    mesh dimension named tp, a parameter FSDP2 does not manage) or a 2-D mesh (FSDP2 with TP,
    HSDP), whose shards' norms neither add up nor average to the global one."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None or not is_sharded(p):
        return None
    dims = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    ndim = int(getattr(mesh, "ndim", 1))
    named = f" ({', '.join(dims)})" if dims else ""
    what = None
    if ndim > 1:
        what = f"is a DTensor on a {ndim}-D device mesh{named} (tensor parallelism or HSDP)"
    elif any("tp" in d.lower() for d in dims):
        what = f"is tensor-parallel (a DTensor on mesh dimension {dims[0]})"
    elif not _under_fsdp2(model, name):
        placements = ", ".join(str(x) for x in getattr(p, "placements", ()))
        what = f"is a DTensor ({placements}) that FSDP2 does not manage (tensor parallelism)"
    if what is None:
        return None
    return (
        f"cannot record this model: parameter {name} {what}; ckptlab records DDP and FSDP2 on a 1-D mesh, "
        "not tensor parallelism or 2-D meshes; record with the model replicated (DDP) or fully_shard on a 1-D mesh"
    )


def _under_fsdp2(model: torch.nn.Module, name: str) -> bool:
    """Whether parameter `name` belongs to a module that FSDP2's `fully_shard` manages (its
    shards are FSDP2's own; a DTensor outside any is another engine's, tensor parallelism's)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    parts = name.split(".")[:-1]
    module = model
    managed = isinstance(module, FSDPModule)
    for part in parts:
        module = getattr(module, part)
        managed = managed or isinstance(module, FSDPModule)
    return managed
