"""Rewinding a sharded (FSDP2) run: checkpoint folders hold a `dcp/` folder, and a rewind --
killed at any of its file operations -- is finished by running `ckptlab rollback` again, after
which the 2-process job resumes from the chosen checkpoint and records the same losses."""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import pytest

import ckptlab
from ckptlab.run import archive, framelog
from ckptlab.run.layout import parse_checkpoint, parse_segment
from tests import dist_models as dm
from tests import models
from tests.test_distributed import torchrun
from tests.test_rollback import KillAt, frames_under

K = 10  # rewind to checkpoint 10: checkpoint 15 moves, segments from 10 on move (journal, both ranks)


class KillAnyOp(KillAt):
    OPS = ("rename", "replace", "link", "mkdir")  # mkdir: the folders inside a checkpoint (dcp/)


def checkpoint_files_under(root: Path) -> set:
    """(checkpoint folder, file inside it, sha256) of every committed checkpoint under root."""
    out = set()
    for p in root.rglob("step-*"):
        if parse_checkpoint(p.name) is not None and (p / "COMMIT.json").is_file():
            for f in p.rglob("*"):
                if f.is_file():
                    out.add((p.name, str(f.relative_to(p)), hashlib.sha256(f.read_bytes()).hexdigest()))
    return out


def state(run_dir: Path) -> tuple:
    """What a finished rewind left: the run's frames, checkpoints and rollback step, and the
    archive's files."""
    run = ckptlab.open_run(run_dir)
    frames = set()
    for p in [*(run_dir / "journal").iterdir(), *(run_dir / "batches").rglob("*.log")]:
        if parse_segment(p.name):
            frames |= {(str(p.relative_to(run_dir)), f.kind, f.step, f.crc) for f in framelog.scan(p).frames}
    kept = sorted(str(p.relative_to(run_dir)) for p in (run_dir / "archive").rglob("*") if p.is_file())
    return frozenset(frames), tuple(run.checkpoints), run.manifest["rollback"]["step"], tuple(kept)


def test_rewinding_a_sharded_run_links_the_dcp_folder(fsdp_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(fsdp_run, run_dir)
    plan = archive.rewind(run_dir, K)
    assert plan.checkpoints == [15] and archive.unfinished_rollback(run_dir) is None
    run = ckptlab.open_run(run_dir)
    assert run.checkpoints == [5, 10] and run.steps[-1] == K - 1
    arch = ckptlab.open_run(run.archives[0])
    assert arch.checkpoints == [10, 15]
    for step in (10, 15):
        ck = arch.checkpoint(step)
        assert ck.sharded and (ck.path / "dcp" / "__1_0.distcp").is_file()
        ck.verify()
    linked = arch.checkpoint(K).path / "dcp" / "__0_0.distcp"
    assert linked.samefile(run.checkpoint(K).path / "dcp" / "__0_0.distcp")  # a hard link, no copy


def test_a_sharded_rewind_killed_anywhere_is_finished_by_rerunning_and_the_job_resumes(fsdp_run, tmp_path, cli):
    all_frames, all_files = frames_under(fsdp_run), checkpoint_files_under(fsdp_run)
    clean = tmp_path / "clean"
    shutil.copytree(fsdp_run, clean)
    with KillAnyOp(None) as counter:
        archive.rewind(clean, K)
    expected = state(clean)
    assert counter.count > 15
    interrupted = 0
    for n in range(counter.count):
        run_dir = tmp_path / f"kill{n}"
        shutil.copytree(fsdp_run, run_dir)
        with KillAnyOp(n):
            archive.rewind(run_dir, K)
            pytest.fail("not killed")
        assert frames_under(run_dir) >= all_frames, n  # nothing unreachable at any instant
        assert checkpoint_files_under(run_dir) >= all_files, n
        if archive.unfinished_rollback(run_dir) is not None:
            model, opt = models.build_mlp()
            with pytest.raises(ckptlab.RecordError, match="interrupted"):
                ckptlab.Recorder(run_dir, model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp, resume=True)
            r = cli("rollback", "--run", run_dir)
            assert r.code == 0, (n, r.err)
            assert f"finished the interrupted rollback to step {K}" in r.out
            interrupted += 1
        else:  # killed before the intent was written: nothing to finish; start again
            archive.rewind(run_dir, K)
        assert state(run_dir) == expected, n
        assert checkpoint_files_under(run_dir) >= all_files and archive.unfinished_rollback(run_dir) is None
        shutil.rmtree(run_dir)
    assert interrupted == counter.count - 4  # a kill at the archive's mkdirs or its intent leaves nothing to finish

    # The job restarts on 2 processes: every rank restores checkpoint K and records on from K,
    # the same losses as before the rewind (until the planted NaN stops it again).
    again = torchrun(clean, "fsdp", kill_step="resume")
    assert again.returncode == 0, again.stderr[-2000:]
    assert re.findall(r"rank 0 step (\d+) returned", again.stdout)[0] == str(K)
    run = ckptlab.open_run(clean)
    session = run.manifest["sessions"][-1]
    assert (session["start_step"], session["restored_from"]) == (K, K) and run.manifest["rollback"] is None
    before, after = ckptlab.open_run(fsdp_run).metrics(), run.metrics()
    assert after.step.tolist() == before.step.tolist() == list(range(dm.NAN_STEP + 1))
    assert after.loss[: dm.NAN_STEP].tolist() == before.loss[: dm.NAN_STEP].tolist()  # bit for bit
