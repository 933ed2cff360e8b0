"""Value statistics of a few retained checkpoints, for the weight detectors (non-finite
tensors, frozen layers, drift) and the HTML page's histograms."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ckptlab.run.reader import Run


@dataclass
class WeightSnapshot:
    """Value statistics of every stored tensor at one checkpoint (for histograms and drift)."""

    step: int
    stats: dict  # name -> ckptlab.stats.results.TensorStats
    digests: dict  # name -> content hash, so bit-identical tensors (a frozen layer) are found


def weight_snapshots(run: Run, limit: int = 6) -> list[WeightSnapshot]:
    """Tensor statistics of up to `limit` retained checkpoints (first, last, evenly between),
    read one tensor at a time, each with a content digest (no tensor is kept around)."""
    steps = run.checkpoints
    if len(steps) > limit:
        pick = np.unique(np.linspace(0, len(steps) - 1, limit).round().astype(int))
        steps = [steps[i] for i in pick]
    out = []
    for step in steps:
        snap = _snapshot(run, step)
        if snap is not None:
            out.append(snap)
    return out


def _snapshot(run: Run, step: int) -> WeightSnapshot | None:
    import hashlib

    import torch

    from ckptlab.io import open_checkpoint
    from ckptlab.stats.tensor import tensor_stats

    stats, digests = {}, {}
    try:  # any checkpoint layout (model.safetensors, or an FSDP run's DCP shards)
        with open_checkpoint(f"{run.path}@{step}", verify=False) as weights:
            for name in weights.refs:  # each stored tensor once (tied names share one)
                t = weights[name]
                stats[name] = tensor_stats(t)
                raw = t.contiguous().reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
                digests[name] = hashlib.blake2b(raw, digest_size=16).hexdigest()  # type: ignore[arg-type]  # ndarray is a buffer; numpy stubs declare __buffer__ only for Python >= 3.12
    except Exception as e:  # noqa: BLE001 - a corrupt checkpoint is skipped here, reported by info/rollback
        path = run.checkpoint(step).model_path
        run.problems.append(f"{path}: unreadable for weight statistics ({type(e).__name__}: {e})")
        return None
    return WeightSnapshot(step, stats, digests)
