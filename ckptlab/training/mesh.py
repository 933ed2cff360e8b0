"""Tensor parallelism on a device mesh: what a rank's numbers mean for the whole model.

    layout = MeshLayout.of(model, world_size)   # None: no tensor parallelism
    layout.replicas        # per parameter: how many ranks hold each element of its gradient
    layout.data_ranks      # per process: its data-parallel rank (ranks of one TP group share it)

Two layouts are recorded (docs/distributed.md):
- TP over every process (`parallelize_module` on a 1-D mesh): every rank holds its shard of
  each DTensor parameter (`Shard`) or the whole of it (`Replicate`), and every rank trains on
  the same batch: data parallel degree 1, every process's data rank is 0.
- FSDP2 over TP on a 2-D mesh (`fully_shard(mesh=mesh["dp"])` around a model parallelized on
  `mesh["tp"]`): FSDP2 joins the two into one mesh, its own dimension first (torch's
  `FSDPParam._init_sharding_spec_tp`), so a process's data rank is its coordinate on
  dimension 0 and the ranks of one TP group share a batch.

A parameter's gradient has its parameter's placements (measured: a `RowwiseParallel` bias is
`Replicate` and its gradient is the same on every rank of the TP group), so the global squared
norm of a parameter is the sum over ranks of their shards' squared norms divided by how many
ranks hold each element: the product of the mesh's sizes along the `Replicate` dimensions. A
plain tensor beside them is every rank's whole copy (averaged, as under DDP).

Anything else on a mesh is refused with one line (`problem`): HSDP (FSDP2 given a 2-D mesh:
its replicas train on different batches, which is not what the data ranks above say), a mesh
of more than two dimensions, TP outside FSDP2 on more than one dimension, and TP that does
not span every process (its data-parallel copies are kept in step by nothing ckptlab sees).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ckptlab.training.wrappers import unwrap


@dataclass(frozen=True)
class MeshLayout:
    replicas: np.ndarray  # float64[P], in the probe's parameter order (`unwrap(model).named_parameters()`)
    data_ranks: tuple[int, ...]  # one per process

    @staticmethod
    def of(model: torch.nn.Module, size: int) -> MeshLayout | None:
        """The layout of a model with tensor-parallel DTensor parameters (None: there are
        none, e.g. plain FSDP2 or DDP). Assumes `problem` found nothing."""
        named = list(unwrap(model).named_parameters())
        spans = [_spans(model, n, p) for n, p in named]
        tp = next((s for s in spans if s is not None and s[1] < s[0].ndim), None)
        if tp is None:
            return None
        mesh, data_dims = tp
        grid = mesh.mesh.reshape(mesh.mesh.shape[0] if data_dims else 1, -1)
        data_ranks = [0] * size
        for row, ranks in enumerate(grid.tolist()):
            for r in ranks:
                data_ranks[r] = row
        return MeshLayout(np.array([_replicas(p, size) for _, p in named], dtype=np.float64), tuple(data_ranks))


def _spans(model: torch.nn.Module, name: str, p: torch.Tensor):
    """(the DTensor's mesh, how many of its leading dimensions are data parallel), or None
    for a plain tensor."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None or not callable(getattr(p, "to_local", None)):
        return None
    return mesh, 1 if under_fsdp2(model, name) else 0


def _replicas(p: torch.Tensor, size: int) -> float:
    mesh = getattr(p, "device_mesh", None)
    if mesh is None or not callable(getattr(p, "to_local", None)):
        return float(size)
    n = 1
    for dim, placement in enumerate(p.placements):  # type: ignore[attr-defined]
        if placement.is_replicate():
            n *= mesh.size(dim)
    return float(n)


def problem(model: torch.nn.Module, name: str, p: torch.Tensor, size: int) -> str | None:
    """What is not recorded about DTensor parameter `name` (its mesh, its placements), as the
    end of a sentence that begins with its name; None where it is recorded."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None or not callable(getattr(p, "to_local", None)):
        return None
    dims = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    named = f" ({', '.join(dims)})" if dims else ""
    fsdp = under_fsdp2(model, name)
    if mesh.ndim > 2:
        return f"is a DTensor on a {mesh.ndim}-D device mesh{named}: ckptlab records TP on a 1-D mesh and FSDP2 x TP on a 2-D one"
    if fsdp and mesh.ndim == 2 and p.placements[0].is_replicate():  # type: ignore[attr-defined]
        return (
            f"is replicated along the first dimension of its 2-D device mesh{named} by FSDP2 (HSDP, or "
            "replicate()), which ckptlab does not record; shard over one data-parallel dimension (fully_shard "
            "on a 1-D mesh, or FSDP2 x TP)"
        )
    if not fsdp and mesh.ndim == 2:
        return (
            f"is tensor-parallel on a 2-D device mesh{named} outside FSDP2, which ckptlab does not record; "
            "ckptlab records TP on a 1-D mesh and FSDP2 x TP on a 2-D one"
        )
    tp = mesh.ndim == 2 or not fsdp  # (a 1-D mesh under FSDP2 is plain FSDP2)
    if tp and mesh.mesh.numel() != size:
        return (
            f"is tensor-parallel over {mesh.mesh.numel()} of the {size} processes, with nothing ckptlab "
            "records keeping the copies in step (not FSDP2 on a 2-D mesh); ckptlab records TP over every process "
            "and FSDP2 x TP"
        )
    return None


def under_fsdp2(model: torch.nn.Module, name: str) -> bool:
    """Whether parameter `name` belongs to a module that FSDP2's `fully_shard` manages (its
    shards are FSDP2's own; a DTensor outside any is another engine's, tensor parallelism's)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    module = unwrap(model)
    managed = isinstance(module, FSDPModule)
    for part in name.split(".")[:-1]:
        module = getattr(module, part)
        managed = managed or isinstance(module, FSDPModule)
    return managed
