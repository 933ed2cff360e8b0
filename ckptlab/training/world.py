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
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


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
    _ckpt_group: Any = field(default=None, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @staticmethod
    def detect(model: torch.nn.Module | None = None) -> World:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return World()
        sharded = model is not None and any(is_sharded(p) for p in model.parameters())
        backend = str(dist.get_backend())
        if dist.get_world_size() == 1:  # one process; FSDP2 on one device still has DTensor shards
            return World(sharded=sharded, backend=backend)  # (the backend says: replay needs a group)
        # Every rank constructs its Recorder, so creating the group here is collective.
        group = dist.new_group(backend="gloo") if backend != "gloo" else None
        return World(dist.get_rank(), dist.get_world_size(), sharded, group, backend)

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
        """Per-parameter squared norms from every rank -> the global ones: shards add up;
        replicated copies are averaged (root mean square of the ranks' norms)."""
        return rows.sum(axis=0) if self.sharded else rows.mean(axis=0)

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
    in a single-process replay."""
    import torch.distributed as dist

    if not needed or not dist.is_available() or dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
