"""Names and places in a run directory. See docs/run-format.md.

    RUN/
      manifest.json                       what recorded this run, and how (format_version 2)
      journal/sNNN-SSSSSSSSS.log          rank 0: per-step health, validation, events
      batches/rank0/sNNN-SSSSSSSSS.log    each rank: exact batches, sample ids, RNG states
      checkpoints/step-SSSSSSSSS/         model.safetensors (or dcp/: sharded), state.safetensors, COMMIT.json
      sources/<sha256>.py                 the recorded build_fn/step_fn files, as recorded
      archive/<name>/...                  steps set aside by a rollback (same layout)
      .lock, .leases/                     the writer's lock; live readers' leases (run/lock.py)

Segments are named by session (NNN) and first step (S...); a new segment starts at every
checkpoint and at every session start, so whole segments can be retired with their checkpoint
and a resumed session never appends to a file a crash may have torn.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

# 2: log segments whose frame headers carry their own CRC (framelog.LOG_V2); a run of format 1
# holds LOG_V1 segments only, and is read as it is (a session resumed on it writes LOG_V2
# segments and raises its manifest to 2).
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
COMMIT = "COMMIT.json"
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.safetensors"
DCP_DIR = "dcp"  # a sharded checkpoint's torch.distributed.checkpoint folder
LOCK = ".lock"  # held (flock) by the process writing the run: see run/lock.py
LEASES = ".leases"  # what readers of a live run hold against retention: see run/lock.py

# Names are matched whole (fullmatch: `$` would accept a trailing newline) with ASCII digits
# only (`\d` accepts any Unicode digit), and must be the canonical spelling of their numbers
# (no extra leading zeros): one step, one name, so a folder found by its name is the folder
# that name builds, and no two folders claim the same checkpoint or segment.
SEGMENT_RE = re.compile(r"s([0-9]{3,})-([0-9]{9,})\.log")
CHECKPOINT_RE = re.compile(r"step-([0-9]{9,})")


def segment_name(session: int, first_step: int) -> str:
    return f"s{session:03d}-{first_step:09d}.log"


def parse_segment(name: str) -> tuple[int, int] | None:
    m = SEGMENT_RE.fullmatch(name)
    if not m:
        return None
    session, first = int(m.group(1)), int(m.group(2))
    return (session, first) if segment_name(session, first) == name else None


def checkpoint_name(step: int) -> str:
    return f"step-{step:09d}"


def parse_checkpoint(name: str) -> int | None:
    m = CHECKPOINT_RE.fullmatch(name)
    if not m:
        return None
    step = int(m.group(1))
    return step if checkpoint_name(step) == name else None


def journal_dir(run: Path) -> Path:
    return run / "journal"


def batches_root(run: Path) -> Path:
    return run / "batches"


def batches_dir(run: Path, rank: int = 0) -> Path:
    return batches_root(run) / f"rank{rank}"


def parse_rank(name: str) -> int | None:
    """The rank of a `batches/rankN` folder name (the canonical spelling only, as above)."""
    m = re.fullmatch(r"rank([0-9]+)", name)
    return int(m.group(1)) if m and f"rank{int(m.group(1))}" == name else None


def checkpoints_dir(run: Path) -> Path:
    return run / "checkpoints"


def checkpoint_dir(run: Path, step: int) -> Path:
    """Where the committed checkpoint at `step` lives."""
    return checkpoints_dir(run) / checkpoint_name(step)


def sources_dir(run: Path) -> Path:
    return run / "sources"


def archive_dir(run: Path) -> Path:
    return run / "archive"


def profiles_dir(run: Path) -> Path:
    """Where `ckptlab replay --profile` writes its Chrome traces."""
    return run / "profiles"


def profile_trace(run: Path, step: int) -> Path:
    """A new file for step `step`'s Chrome trace: `profiles/step-N.json`, else the first of
    `step-N-2.json`, `step-N-3.json`, ... that does not exist (none is ever overwritten)."""
    folder = profiles_dir(run)
    path, n = folder / f"step-{step}.json", 1
    while path.exists():
        n += 1
        path = folder / f"step-{step}-{n}.json"
    return path


def is_run(path: Path) -> bool:
    """A folder that holds a ckptlab run (its manifest)."""
    return (path / MANIFEST).is_file()


def lock_file(run: Path) -> Path:
    return run / LOCK


def leases_dir(run: Path) -> Path:
    return run / LEASES


def is_first_leftover(name: str) -> bool:
    """What a first session killed before its manifest was written leaves in the folder."""
    return name in ("sources", LOCK) or name.startswith(f".{MANIFEST}.tmp-")


def parts(run: Path) -> dict[str, Path]:
    """The run's top-level parts by name (`ckptlab info` reports disk use per part)."""
    return {
        "checkpoints": checkpoints_dir(run),
        "batches": batches_root(run),
        "journal": journal_dir(run),
        "sources": sources_dir(run),
        "archive": archive_dir(run),
    }


def last_written(run: Path) -> float:
    """When the run was last written to: the newest mtime of its manifest, journal, rank 0's
    batches and checkpoints (how the CLI picks the latest run under ./runs)."""
    latest = (run / MANIFEST).stat().st_mtime
    for d in (journal_dir(run), batches_dir(run, 0), checkpoints_dir(run)):
        if d.is_dir():
            latest = max([latest, d.stat().st_mtime, *(p.stat().st_mtime for p in d.iterdir())])
    return latest


def segments(folder: Path) -> list[tuple[int, int, Path]]:
    """(session, first_step, path) of every segment in `folder`, in recording order."""
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        parsed = parse_segment(p.name)
        if parsed:
            found.append((*parsed, p))
    return sorted(found)


def remove_new_entries(run: Path, before: set[str]) -> None:
    """Delete what a first session that failed to start wrote into `run` (every entry not in
    `before`, the names that were there when it began; the lock file is its holder's to go)."""
    for name in sorted(set(os.listdir(run)) - before - {LOCK}) if run.is_dir() else []:
        path = run / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def dir_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total
