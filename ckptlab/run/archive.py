"""Rewinding a run to one of its checkpoints: later steps are set aside, never deleted.

    plan = plan_rewind(run_dir, 120)          # what would move (`ckptlab rollback --dry-run`)
    done = rewind(run_dir, 120, info={...})   # do it; then Recorder(..., resume=True) restores
                                              # checkpoint 120 and records on from step 120

After rewinding RUN to step k into archive NAME:

    RUN/manifest.json              rollback = {"step": k, "archive": NAME, ...}
    RUN/checkpoints/step-*         the checkpoints at steps <= k
    RUN/journal, batches/rank*/    the frames of steps < k (and validation measured at k)
    RUN/archive/NAME/
        ROLLBACK.json              the intent: written first, "status": "done" written last
        manifest.json              the manifest as it was: the archive opens as a run
        checkpoints/step-k/        hard links to checkpoint k's files (archived steps replay)
        checkpoints/step-*/        the later checkpoints, moved
        journal/, batches/rankN/   segments holding frames >= k: moved whole; a segment that
                                   spans k is kept here intact, and RUN gets a trimmed copy
        sources/                   hard links to the recorded build_fn/step_fn copies

Crash safety: every change is one atomic rename (or a hard link, which only adds a name), in
an order where each file's data is always reachable under RUN or RUN/archive/NAME:
  1. ROLLBACK.json (status "in_progress") -- from here on `unfinished_rollback` reports it,
     the Recorder refuses to resume, and `finish_interrupted` completes it;
  2. the manifest copy, the source and checkpoint-k links;
  3. later checkpoints, newest first: rename into the archive;
  4. segments: a segment with no frame to keep is renamed into the archive; a segment that
     spans k is hard-linked into the archive, then replaced in RUN by a trimmed copy
     (temp file, fsync, rename over the original);
  5. RUN/manifest.json with `rollback` (temp file, fsync, rename);
  6. ROLLBACK.json "status": "done".
A kill anywhere leaves a state from which re-running the same rewind finishes the job
(each step above checks what is already done), and nothing is ever deleted.
A rewind (and finishing one) holds the run's lock (run/lock.py): it is refused while a
Recorder records the run, and no Recorder starts while it moves files.
Before anything moves, `refuse_links` refuses a run holding a symlink (or a special file)
anywhere: nothing is followed, so nothing outside the run is linked in or written to. Each
checkpoint is moved or linked from the folder it was listed in (folders inside it, such as a
sharded checkpoint's dcp/, are linked file by file).
See docs/rollback.md.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from ckptlab.errors import CkptlabError, CorruptFileError
from ckptlab.io.files import read_bytes, read_text
from ckptlab.run import framelog
from ckptlab.run.atomic import atomic_file, fsync_path, rename_durably, write_bytes_atomic, write_json_atomic
from ckptlab.run.checkpoint import list_checkpoints
from ckptlab.run.columns import summary_path
from ckptlab.run.layout import (
    MANIFEST,
    archive_dir,
    batches_root,
    journal_dir,
    parse_segment,
    segments,
    sources_dir,
)
from ckptlab.run.lock import acquire
from ckptlab.run.manifest import read_manifest, write_manifest

INTENT = "ROLLBACK.json"


@dataclass
class SegmentAction:
    path: Path  # the segment in the run
    rel: str  # its path relative to the run directory (the same under the archive)
    action: str  # "move" (every frame is archived) or "split" (frames on both sides of k)
    kept: int  # frames that stay in the run
    archived: int  # frames that go to the archive
    steps: tuple[int, int] | None  # first and last archived step


@dataclass
class RewindPlan:
    run: Path
    step: int  # the checkpoint the run goes back to
    archive: str  # archive/<name>
    checkpoints: list[int]  # moved (steps > k)
    segments: list[SegmentAction]
    last_step: int | None  # the last step recorded before the rewind
    notes: list[str] = field(default_factory=list)
    # The folders as listed (never rebuilt from a step number): checkpoint k's, and those of
    # `checkpoints`, in the same order.
    target: Path | None = None
    moved: list[Path] = field(default_factory=list)

    @property
    def archive_path(self) -> Path:
        return archive_dir(self.run) / self.archive

    @property
    def empty(self) -> bool:
        return not self.checkpoints and not self.segments

    def summary(self) -> dict:
        archived = [s.steps for s in self.segments if s.steps]
        return {
            "step": self.step,
            "archive": str(Path("archive") / self.archive),
            "checkpoints_moved": self.checkpoints,
            "segments_moved": [s.rel for s in self.segments if s.action == "move"],
            "segments_split": [s.rel for s in self.segments if s.action == "split"],
            "archived_steps": [min(a for a, _ in archived), max(b for _, b in archived)] if archived else None,
            "last_step": self.last_step,
        }


def keeps(kind: int, step: int, k: int) -> bool:
    """Whether a frame stays in the run rewound to step k: everything before step k, and
    validation logged *at* k (it was measured on the state checkpoint k holds)."""
    return step < k or (kind == framelog.VALIDATION and step == k)


def _segment_folders(run_dir: Path) -> list[Path]:
    folders = [journal_dir(run_dir)]
    root = batches_root(run_dir)
    if root.is_dir():
        folders += sorted(p for p in root.iterdir() if p.is_dir())
    return folders


def plan_rewind(run_dir: str | os.PathLike, step: int, *, archive: str | None = None) -> RewindPlan:
    """What rewinding to checkpoint `step` would move; changes nothing. Refuses (before
    anything moves) a run with a symlink or a special file anywhere in it."""
    run_dir = Path(run_dir)
    refuse_links(run_dir)
    found, _ = list_checkpoints(run_dir)
    target = next((c.path for c in found if c.step == step), None)
    if target is None:
        raise CkptlabError(f"no complete checkpoint at step {step} to roll back to", path=run_dir)
    actions, last = [], None
    for folder in _segment_folders(run_dir):
        for _, _, path in segments(folder):
            frames = framelog.scan(path).frames
            recorded = [f.step for f in frames if f.kind in (framelog.BATCH, framelog.STEP)]
            if recorded:
                last = max(last if last is not None else -1, max(recorded))
            kept = [f for f in frames if keeps(f.kind, f.step, step)]
            gone = [f for f in frames if not keeps(f.kind, f.step, step)]
            if kept and gone:
                action = "split"
            elif gone or (not kept and _first_step(path) >= step):  # incl. a segment holding only a torn tail
                action = "move"
            else:
                continue
            ran = [f.step for f in gone if f.kind in (framelog.BATCH, framelog.STEP)]
            span = (min(ran), max(ran)) if ran else None
            actions.append(SegmentAction(path, str(path.relative_to(run_dir)), action, len(kept), len(gone), span))
    later = sorted((c for c in found if c.step > step), key=lambda c: c.step, reverse=True)  # newest first
    name = archive or _new_archive_name(run_dir, step)
    return RewindPlan(
        run_dir, step, name, [c.step for c in later], actions, last, target=target, moved=[c.path for c in later]
    )


def refuse_links(run_dir: Path) -> None:
    """Rollback follows no symlink inside a run (it would hard-link files from outside into the
    run, or write outside it) and moves only folders and regular files: anything else anywhere
    under `run_dir` is refused, naming it, before anything moves. (`run_dir` itself may be a
    link to the run.)"""
    for root, dirs, files in os.walk(run_dir, followlinks=False):
        for name in sorted(dirs) + sorted(files):
            path = Path(root) / name
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(mode):
                raise CkptlabError(
                    f"is a symbolic link (to {os.readlink(path)}); rollback follows no link inside a run, "
                    "and moved nothing",
                    path=path,
                    hint="replace the link by what it points to (cp -a), or move it out of the run",
                )
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise CkptlabError(
                    "is neither a folder nor a regular file; rollback moved nothing",
                    path=path,
                    hint="move it out of the run",
                )


def _first_step(path: Path) -> int:
    parsed = parse_segment(path.name)
    return parsed[1] if parsed else -1


def _clear_abandoned(run_dir: Path) -> None:
    """Remove what a rewind killed before its intent was written leaves: an archive folder with
    no ROLLBACK.json, empty but for the intent's temp file (nothing had moved yet). We hold the
    lock, so no rewind is writing it now; a retried rewind then reuses the name."""
    root = archive_dir(run_dir)
    if not root.is_dir() or root.is_symlink():
        return
    for p in sorted(root.iterdir()):
        if _abandoned(p):
            for f in p.iterdir():
                f.unlink()
            p.rmdir()


def _abandoned(p: Path) -> bool:
    """An archive folder a rewind killed before its intent was written left (see above)."""
    if not p.name.startswith("rollback-") or p.is_symlink() or not p.is_dir() or (p / INTENT).exists():
        return False
    return all(f.name.startswith(f".{INTENT}.tmp-") and not f.is_symlink() and f.is_file() for f in p.iterdir())


def _new_archive_name(run_dir: Path, step: int) -> str:
    """rollback-NNN-to-SSSSSSSSS, NNN counting the rewinds so far (an abandoned folder, which
    the rewind clears before it writes, does not count: its name is reused)."""
    root = archive_dir(run_dir)
    taken = [p for p in root.iterdir() if p.name.startswith("rollback-") and not _abandoned(p)] if root.is_dir() else []
    n = 1 + len(taken)
    while True:
        name = f"rollback-{n:03d}-to-{step:09d}"
        if not (root / name).exists() or _abandoned(root / name):
            return name
        n += 1


# --- doing it --------------------------------------------------------------------------------------


def rewind(
    run_dir: str | os.PathLike, step: int, *, info: dict | None = None, archive: str | None = None
) -> RewindPlan:
    """Rewind the run to checkpoint `step` (see the module docstring). The caller verifies
    the checkpoint's integrity first. Holds the run's lock throughout: RunLockedError while a
    Recorder (or another rollback) holds it. Returns the plan it carried out."""
    run_dir = Path(run_dir)
    with acquire(run_dir, "rollback"):
        return _rewind(run_dir, step, info, archive)


def _rewind(run_dir: Path, step: int, info: dict | None, archive: str | None) -> RewindPlan:
    pending = unfinished_rollback(run_dir)
    if pending is not None:
        raise CkptlabError(
            f"a rollback into {pending} was interrupted; finish it first",
            path=run_dir,
            hint="run `ckptlab rollback` again",
        )
    _clear_abandoned(run_dir)
    plan = plan_rewind(run_dir, step, archive=archive)
    manifest = read_manifest(run_dir)
    intent = {
        "format_version": 1,
        "status": "in_progress",
        "step": step,
        "archive": plan.archive,
        "created": time.time(),
        "last_step": plan.last_step,
        **(info or {}),
    }
    dest = plan.archive_path
    dest.mkdir(parents=True, exist_ok=False)
    fsync_path(dest.parent)
    write_json_atomic(dest / INTENT, intent)
    archived_manifest = dict(manifest, rollback=None)
    write_json_atomic(dest / MANIFEST, archived_manifest)
    _carry_out(run_dir, dest, plan, intent, manifest)
    return plan


def finish_interrupted(run_dir: str | os.PathLike) -> RewindPlan | None:
    """Complete a rewind that a crash interrupted (None if there is none), holding the run's
    lock like `rewind`."""
    run_dir = Path(run_dir)
    with acquire(run_dir, "rollback"):
        return _finish_interrupted(run_dir)


def _finish_interrupted(run_dir: Path) -> RewindPlan | None:
    dest = unfinished_rollback(run_dir)
    if dest is None:
        return None
    intent = _read_intent(dest)
    try:
        step = int(intent["step"])
    except (KeyError, TypeError, ValueError):
        raise CorruptFileError("the rollback record names no step", path=dest / INTENT) from None
    plan = plan_rewind(run_dir, step, archive=dest.name)  # checks the run before anything is written
    manifest = read_manifest(run_dir)
    if not (dest / MANIFEST).exists():
        write_json_atomic(dest / MANIFEST, dict(manifest, rollback=None))
    _carry_out(run_dir, dest, plan, intent, manifest)
    return plan


def unfinished_rollback(run_dir: str | os.PathLike) -> Path | None:
    """The archive of a rewind that started but did not finish, if any."""
    root = archive_dir(Path(run_dir))
    if not root.is_dir():
        return None
    for p in sorted(root.iterdir()):
        if (p / INTENT).is_file():
            try:
                if _read_intent(p).get("status") != "done":
                    return p
            except CorruptFileError:
                return p
    return None


def _read_intent(dest: Path) -> dict:
    try:
        return json.loads(read_text(dest / INTENT))
    except (OSError, ValueError) as e:
        raise CorruptFileError(f"unreadable rollback record ({e})", path=dest / INTENT) from None


def _carry_out(run_dir: Path, dest: Path, plan: RewindPlan, intent: dict, manifest: dict) -> None:
    k = plan.step
    assert plan.target is not None, "plan_rewind always names the checkpoint it goes back to"
    _link_tree(sources_dir(run_dir), dest / "sources")
    _link_checkpoint(plan.target, dest / "checkpoints" / plan.target.name)
    for src in plan.moved:  # each folder as listed, under its own name
        target = dest / "checkpoints" / src.name
        target.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(target):
            _refuse(target)
        rename_durably(src, target)
    for seg in plan.segments:
        target = dest / seg.rel
        target.parent.mkdir(parents=True, exist_ok=True)
        # A journal segment's summary goes first (derived: no durability needed): killed
        # after it, the rerun moves or splits the segment, its summary already gone.
        summary = summary_path(seg.path)
        if seg.action == "move":
            if os.path.lexists(target):
                _refuse(target)
            with contextlib.suppress(FileNotFoundError):
                rename_durably(summary, summary_path(target))
            rename_durably(seg.path, target)
        else:
            summary.unlink(missing_ok=True)  # it describes the segment before the split
            _split(seg.path, target, k)
            fsync_path(target.parent)
            fsync_path(seg.path.parent)
    history = list(manifest.get("rollbacks") or [])
    record = {key: intent[key] for key in intent if key not in ("status", "format_version")}
    if not any(h.get("archive") == plan.archive for h in history):
        history.append(record)
    write_manifest(run_dir, dict(manifest, rollback=record, rollbacks=history))
    write_json_atomic(dest / INTENT, dict(intent, status="done", finished=time.time()))


def _refuse(target: Path) -> None:
    raise CkptlabError("already exists in the archive with different content; not overwriting", path=target)


def _split(path: Path, archived: Path, k: int) -> None:
    """Keep the frames < k in the run (a new, trimmed segment under the same name) and the
    original, intact, in the archive. Frames are copied byte for byte."""
    if os.path.lexists(archived):
        if not os.path.samefile(path, archived):
            _refuse(archived)
    else:
        _link_or_copy(path, archived)
    scan = framelog.scan(path)
    data = read_bytes(path)
    out = bytearray(data[: len(framelog.FILE_MAGIC)])  # the segment's own layout (its frames are copied as they are)
    for ref in scan.frames:
        if keeps(ref.kind, ref.step, k):
            out += data[ref.start : ref.offset + ref.length]
    write_bytes_atomic(path, bytes(out))  # a new inode: the archived link keeps the original


def _link_checkpoint(src: Path, target: Path) -> None:
    """Checkpoint k appears in the archive complete or not at all (temp folder + rename),
    folders inside it (a sharded checkpoint's `dcp/`) included."""
    if os.path.lexists(target):
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    for old in target.parent.glob(f".tmp-{target.name}-*"):  # a killed attempt's (we hold the lock)
        shutil.rmtree(old)
    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    os.mkdir(tmp)
    _link_folder(src, tmp)
    rename_durably(tmp, target)


def _link_folder(src: Path, target: Path) -> None:
    """Every file under `src` hard-linked (or copied) to the same relative path under the
    existing, empty `target`; sub-folders created. Follows no symlink (refuse_links refused
    them before anything moved; one that appeared since is refused here too)."""
    for name in sorted(os.listdir(src)):
        mode = os.lstat(src / name).st_mode
        if stat.S_ISDIR(mode):
            os.mkdir(target / name)
            _link_folder(src / name, target / name)
        elif stat.S_ISREG(mode):
            _link_or_copy(src / name, target / name)
        else:
            raise CkptlabError("is neither a folder nor a regular file; not archiving it", path=src / name)
    fsync_path(target)


def _link_tree(src: Path, target: Path) -> None:
    """The regular files directly in `src` (the recorded sources), linked into `target`."""
    if not os.path.isdir(src) or os.path.islink(src):
        return
    target.mkdir(parents=True, exist_ok=True)
    for name in sorted(os.listdir(src)):
        if stat.S_ISREG(os.lstat(src / name).st_mode) and not os.path.lexists(target / name):
            _link_or_copy(src / name, target / name)
    fsync_path(target)


def _link_or_copy(src: Path, target: Path) -> None:
    """A hard link (instant, no extra space); a copy where links are not supported. Neither
    follows a symlink: `src` is linked or copied itself, never what it points to."""
    try:
        os.link(src, target, follow_symlinks=False)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        if not stat.S_ISREG(os.lstat(src).st_mode):
            raise CkptlabError("is not a regular file; not archiving it", path=src) from None
        with atomic_file(target) as tmp:
            shutil.copyfile(src, tmp, follow_symlinks=False)
