"""Retention: keep storage proportional to `ckpt_every`, not to run length.

Kept: the last `keep_last` checkpoints, plus protected ones (best validation, last healthy
before the first anomaly); the batch segments from the oldest of the last `keep_last`
checkpoints on, plus those covering a protected step range (the last healthy checkpoint up to
the first anomaly, so that anomaly stays replayable). Batches before the oldest kept
checkpoint cannot be replayed (no state to start from), so they go. The journal (per-step
health) is small and always kept whole.
"""

from __future__ import annotations

from pathlib import Path

from ckptlab.run.checkpoint import list_checkpoints, remove_checkpoint
from ckptlab.run.layout import batches_root, segments


def apply_retention(
    run_dir: Path, keep_last: int, protected: set[int], protected_range: tuple[int, int] | None
) -> list[Path]:
    """Delete what the policy does not keep; returns what was deleted."""
    checkpoints, _ = list_checkpoints(run_dir)
    if keep_last <= 0 or len(checkpoints) <= keep_last:
        return []
    recent = checkpoints[-keep_last:]
    kept_steps = {c.step for c in recent} | set(protected)
    deleted = []
    for c in checkpoints:
        if c.step not in kept_steps:
            remove_checkpoint(c.path)
            deleted.append(c.path)
    oldest = recent[0].step
    batch_root = batches_root(run_dir)
    for rank_dir in sorted(batch_root.iterdir()) if batch_root.is_dir() else []:
        segs = segments(rank_dir)
        for i, (_, first, path) in enumerate(segs):
            end = segs[i + 1][1] if i + 1 < len(segs) else None  # exclusive; None: still open
            if end is None or end > oldest:
                continue
            if protected_range and first <= protected_range[1] and end > protected_range[0]:
                continue
            path.unlink(missing_ok=True)
            deleted.append(path)
    return deleted
