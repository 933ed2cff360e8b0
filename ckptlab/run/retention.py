"""Retention: keep storage proportional to `ckpt_every`, not to run length.

Kept: the last `keep_last` checkpoints, plus protected ones (best validation, last healthy
before the first anomaly); the batch segments from the oldest of the last `keep_last`
checkpoints on, plus those covering a protected step range (the last healthy checkpoint up to
the first anomaly, so that anomaly stays replayable). Batches before the oldest kept
checkpoint cannot be replayed (no state to start from), so they go. The journal (per-step
health) is small and always kept whole. What a live reader leased (a replay's start
checkpoint and batches: run/lock.py) is kept while it reads.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ckptlab.jsonable import is_int
from ckptlab.run.checkpoint import list_checkpoints, retire_checkpoint
from ckptlab.run.layout import batches_root, segments
from ckptlab.run.lock import guard, live_leases


def apply_retention(
    run_dir: Path, keep_last: int, protected: set[int], protected_range: tuple[int, int] | None
) -> list[Path]:
    """Delete what the policy does not keep; returns what was deleted."""
    checkpoints, _ = list_checkpoints(run_dir)
    if keep_last <= 0 or len(checkpoints) <= keep_last:
        return []
    recent = checkpoints[-keep_last:]
    kept_steps = {c.step for c in recent} | set(protected)
    ranges = [protected_range] if protected_range else []
    deleted, doomed = [], []
    with guard(run_dir):  # no lease is taken while we decide and retire
        for lease in live_leases(run_dir):
            kept_steps |= {s for s in lease["checkpoints"] if is_int(s)}
            if len(lease["steps"]) == 2 and all(is_int(s) for s in lease["steps"]):
                ranges.append(tuple(lease["steps"]))
        for c in checkpoints:
            if c.step not in kept_steps:
                doomed.append(retire_checkpoint(c.path))
                deleted.append(c.path)
        deleted += _retire_segments(run_dir, recent[0].step, ranges)
    for path in doomed:  # renamed away: no reader lists them any more
        shutil.rmtree(path, ignore_errors=True)
    return deleted


def _retire_segments(run_dir: Path, oldest: int, ranges: list) -> list[Path]:
    """Delete the batch segments that end at or before `oldest` and hold no step of `ranges`."""
    deleted = []
    batch_root = batches_root(run_dir)
    for rank_dir in sorted(batch_root.iterdir()) if batch_root.is_dir() else []:
        segs = segments(rank_dir)
        for i, (_, first, path) in enumerate(segs):
            end = segs[i + 1][1] if i + 1 < len(segs) else None  # exclusive; None: still open
            if end is None or end > oldest:
                continue
            if any(first <= last and end > start for start, last in ranges):
                continue
            path.unlink(missing_ok=True)
            deleted.append(path)
    return deleted
