"""Bad input: each is one clear error naming the file, and nothing already recorded is lost.

Not a run, a newer format, corrupt/truncated/tampered files, and a disk that fills up during a
write (for real: a child process under RLIMIT_FSIZE; and ENOSPC injected into os.write).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import ckptlab
from ckptlab.errors import CorruptFileError, FormatVersionError, IntegrityError, NotARunError, RecordError
from tests import models
from tests.run.bits import assert_same

ROOT = Path(__file__).resolve().parents[2]


def record(run_dir, n=6, **kw):
    batches = list(models.mlp_batches(n))
    models.record_run(run_dir, models.build_mlp, models.step_mlp, batches, **kw)
    return batches


def assert_intact(run_dir, batches, steps):
    run = ckptlab.open_run(run_dir)
    assert set(steps) <= set(run.metrics().step.tolist())
    for n in steps:
        got, ids = run.batch(n)
        assert_same(got, batches[n][0])
        assert ids == batches[n][1]
    return run


def segment(run_dir, folder="batches/rank0", i=0) -> Path:
    return sorted((run_dir / folder).glob("s*.log"))[i]


# --- not a run, newer format ---------------------------------------------------------------------


def test_not_a_run(tmp_path):
    with pytest.raises(NotARunError, match="no such directory"):
        ckptlab.open_run(tmp_path / "nope")
    with pytest.raises(NotARunError, match=r"not a ckptlab run \(no manifest.json\)"):
        ckptlab.open_run(tmp_path)
    (tmp_path / "manifest.json").write_text('{"name": "some other tool"}')
    with pytest.raises(NotARunError, match="manifest.json is not a ckptlab run manifest"):
        ckptlab.open_run(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": "ckptlab-run", "format_ver')
    with pytest.raises(CorruptFileError, match="manifest.json: unreadable manifest"):
        ckptlab.open_run(tmp_path)


def test_a_run_from_a_newer_format_is_refused_untouched(run_dir):
    record(run_dir, 2)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["format_version"] = 3
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    with pytest.raises(
        FormatVersionError, match=r"newer ckptlab \(run format 3; this ckptlab reads up to 2\).*upgrade"
    ):
        ckptlab.open_run(run_dir)
    model, opt = models.build_mlp()
    with pytest.raises(FormatVersionError):
        ckptlab.Recorder(run_dir, model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp, resume=True)
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


# --- corrupt and truncated files -----------------------------------------------------------------


def test_a_corrupt_batch_frame_fails_only_its_own_step(run_dir):
    batches = record(run_dir, 6, ckpt_every=100)
    path = segment(run_dir)
    data = bytearray(path.read_bytes())
    ref = ckptlab.open_run(run_dir)._batch_index[2]
    data[ref.offset + ref.length // 2] ^= 0x40
    path.write_bytes(bytes(data))

    run = ckptlab.open_run(run_dir)
    assert run.steps == list(range(6))  # headers are intact: the index is whole
    with pytest.raises(CorruptFileError, match=rf"{path}: frame for step 2 at byte \d+ fails its CRC"):
        run.batch(2)
    assert_intact(run_dir, batches, [0, 1, 3, 4, 5])
    assert run.damaged and str(path) in run.damaged[0]  # reading it told the run it is damaged
    assert run.verify_logs()[1:] == [
        f"{path}: frame for step 2 at byte {ref.start} fails its CRC, with intact frames after it (corrupt file)"
    ]


def test_a_truncated_closed_segment_is_damage_not_a_torn_tail(run_dir):
    batches = record(run_dir, 6, ckpt_every=3)  # segments start at 0 and 3
    path = segment(run_dir, i=0)
    path.write_bytes(path.read_bytes()[:-100])
    run = ckptlab.open_run(run_dir)
    assert run.steps == [0, 1, 3, 4, 5]
    assert run.damaged == [
        f"{path}: truncated or damaged in its last frame, though its session went on to later segments (corrupt file)"
    ]
    assert_intact(run_dir, batches, [0, 1, 3, 4, 5])


def test_an_emptied_segment_is_damage_unless_a_kill_at_its_creation_explains_it(run_dir):
    record(run_dir, 6, ckpt_every=3)  # segments start at 0 and 3
    first, last = segment(run_dir, i=0), segment(run_dir, i=1)
    first.write_bytes(b"")  # a session that went on: it was whole once
    run = ckptlab.open_run(run_dir)
    assert run.steps == [3, 4, 5]
    assert run.damaged == [
        f"{first}: empty or cut inside its file header, though its session went on to later segments (corrupt file)"
    ]
    unclose(run_dir)  # killed; its last segment was being created: nothing was in it yet
    first.unlink()
    last.write_bytes(b"ckptlab")
    run = ckptlab.open_run(run_dir)
    assert run.steps == [] and run.damaged == []


def test_a_torn_tail_of_a_sessions_last_segment_is_only_a_note(run_dir):
    batches = record(run_dir, 4, ckpt_every=100)
    unclose(run_dir)  # killed: the Recorder never closed
    path = segment(run_dir, "journal")
    path.write_bytes(path.read_bytes()[:-7])  # what a kill during the last write leaves
    run = assert_intact(run_dir, batches, [0, 1, 2])
    assert run.metrics().step.tolist() == [0, 1, 2] and run.steps == [0, 1, 2, 3]
    assert run.damaged == [] and "torn at the tail" in run.problems[0]


def test_damage_after_a_clean_close_is_an_error_not_a_torn_tail(run_dir):
    """A closed session wrote its last frame whole: a short or flipped tail is damage."""
    record(run_dir, 4, ckpt_every=100)
    assert json.loads((run_dir / "manifest.json").read_text())["sessions"][-1]["closed"] > 0
    path = segment(run_dir, "journal")
    intact = path.read_bytes()
    for damaged in (intact[:-7], intact[:-2] + bytes([intact[-2] ^ 0xFF]) + intact[-1:]):
        path.write_bytes(damaged)
        run = ckptlab.open_run(run_dir)
        run.metrics()  # (from the segment's summary where it is current: the records as written)
        run.verify_logs()
        assert run.damaged == [
            f"{path}: truncated or damaged in its last frame, though its session was closed cleanly (corrupt file)"
        ]


def unclose(run_dir):
    """The manifest as a killed session leaves it: no clean-close mark."""
    manifest = json.loads((run_dir / "manifest.json").read_text())
    for session in manifest["sessions"]:
        session.pop("closed", None)
    (run_dir / "manifest.json").write_text(json.dumps(manifest))


def test_a_segment_that_is_not_a_log(run_dir):
    record(run_dir, 2)
    path = segment(run_dir)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + path.read_bytes())
    run = ckptlab.open_run(run_dir)
    assert run.steps == []
    assert run.damaged == [f"{path}: not a ckptlab log segment (bad file header)"]


@pytest.mark.parametrize(
    "damage, problem",
    [
        ("truncate", "corrupt checkpoint (model.safetensors has the wrong size)"),
        ("no_commit", "incomplete checkpoint (COMMIT.json missing)"),
        ("bad_commit", "corrupt checkpoint (Expecting value"),
    ],
)
def test_a_damaged_checkpoint_is_not_listed(run_dir, damage, problem):
    record(run_dir, 4, ckpt_every=2)
    folder = run_dir / "checkpoints" / "step-000000002"
    if damage == "truncate":
        model = folder / "model.safetensors"
        model.write_bytes(model.read_bytes()[:-10])
    elif damage == "no_commit":
        (folder / "COMMIT.json").unlink()
    else:
        (folder / "COMMIT.json").write_text("garbage")
    run = ckptlab.open_run(run_dir)
    assert run.checkpoints == [0]
    assert run.damaged[0].startswith(f"{folder}: {problem}")


def test_resuming_from_a_tampered_checkpoint_is_refused(run_dir):
    record(run_dir, 4, ckpt_every=2)
    state = run_dir / "checkpoints" / "step-000000002" / "state.safetensors"
    data = bytearray(state.read_bytes())
    data[-3] ^= 0x01
    state.write_bytes(bytes(data))
    manifest = (run_dir / "manifest.json").read_text()
    model, opt = models.build_mlp()
    with pytest.raises(IntegrityError, match=f"{state}: sha256 does not match"):
        ckptlab.Recorder(run_dir, model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp, resume=True)
    assert (run_dir / "manifest.json").read_text() == manifest  # no session was started


# --- a full disk ---------------------------------------------------------------------------------


class DiskFills:
    """os.write into `folder` writes part of its data, then fails with ENOSPC (as a full disk does)."""

    def __init__(self, monkeypatch, folder: Path):
        self.folder = str(folder)
        self.real = os.write
        self.full = False
        monkeypatch.setattr(os, "write", self.write)

    def write(self, fd, data):
        if not os.readlink(f"/proc/self/fd/{fd}").startswith(self.folder):
            return self.real(fd, data)
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.full = True
        return self.real(fd, bytes(data)[: len(data) // 2])


@pytest.mark.parametrize("folder", ["batches", "journal"])
def test_full_disk_stops_the_recording_with_a_clear_error(run_dir, monkeypatch, folder):
    batches = list(models.mlp_batches(10))
    model, opt = models.build_mlp()
    rec = ckptlab.Recorder(
        run_dir, model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp, ckpt_every=3, keep_last=0
    )
    for batch, ids in batches[:4]:
        rec.step(batch, sample_ids=ids)
    with monkeypatch.context() as m:
        DiskFills(m, run_dir / folder)
        with pytest.raises(RecordError) as e:
            rec.step(*batches[4])
        assert str(e.value) == (
            f"{run_dir}: no space left on device while writing step 4 to s000-000000003.log; everything "
            "recorded before this is intact (free space, then continue with Recorder(..., resume=True))"
        )
        with pytest.raises(RecordError, match="recording stopped at an earlier failure: no space left"):
            rec.step(*batches[4])
        rec.close()

    assert_intact(run_dir, batches, range(4))
    with resume_mlp(run_dir) as rec:
        # A batch that was written whole belongs to step 4, whose health was not: it stays a
        # step that never returned, and the numbering goes on after it.
        first = 5 if folder == "journal" else 4
        assert rec.next_step == first
        for batch, ids in batches[first:]:
            rec.step(batch, sample_ids=ids)
    run = assert_intact(run_dir, batches, [n for n in range(10) if n != 4])
    assert run.damaged == []


def resume_mlp(run_dir, **kw):
    model, opt = models.build_mlp()
    return ckptlab.Recorder(
        run_dir,
        model,
        opt,
        step_fn=models.step_mlp,
        build_fn=models.build_mlp,
        resume=True,
        ckpt_every=3,
        keep_last=0,
        **kw,
    )


def test_full_disk_while_writing_the_manifest(run_dir, monkeypatch):
    def full(*a, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("ckptlab.record.session.write_manifest", full)
    model, opt = models.build_mlp()
    with pytest.raises(RecordError, match="no space left on device while writing manifest.json"):
        ckptlab.Recorder(run_dir, model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp)


# A model whose checkpoint (~0.7 MB) is larger than the child's file size limit.
def build_wide():
    torch.manual_seed(0)
    model = nn.Linear(8, 20_000)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def step_wide(model, optimizer, batch):
    loss = model(batch[0][:4]).pow(2).mean()  # a few rows: what matters is the checkpoint's size
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def record_under_a_file_size_limit(run_dir: str, limit: int, wide: bool) -> None:
    """Runs in a child: record until a write fails, report what happened as JSON on stdout."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so the write fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    build, step = (build_wide, step_wide) if wide else (models.build_mlp, models.step_mlp)
    model, opt = build()
    rec = ckptlab.Recorder(run_dir, model, opt, step_fn=step, build_fn=build, ckpt_every=1000)
    out = {"returned": []}
    try:
        for n, (batch, ids) in enumerate(big_batches(40)):
            rec.step(batch, sample_ids=ids)
            out["returned"].append(n)
    except RecordError as e:
        out["error"] = str(e)
    try:
        rec.close()
    except RecordError:
        pass
    print(json.dumps(out))


def big_batches(n: int):
    """~64 KB of incompressible floats per step."""
    g = torch.Generator().manual_seed(3)
    for i in range(n):
        x = torch.randn(2000, 8, generator=g)
        yield (x, x[:, :1]), [i]


@pytest.mark.parametrize("wide, what", [(False, "writing step"), (True, "writing checkpoint 0")])
def test_a_real_file_size_limit_during_recording(run_dir, wide, what):
    code = f"from tests.run.test_bad_input import *; record_under_a_file_size_limit({str(run_dir)!r}, 400_000, {wide})"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert f"file too large (a file size limit was hit) while {what}" in out["error"]
    assert "everything recorded before this is intact" in out["error"]
    returned = out["returned"]  # (a failed checkpoint surfaces at the next write: maybe step 0's)
    assert returned == list(range(len(returned)))

    batches = list(big_batches(40))
    run = assert_intact(run_dir, batches, returned)
    assert run.checkpoints == ([] if wide else [0])
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))  # the failed commit cleaned up
    build, step = (build_wide, step_wide) if wide else (models.build_mlp, models.step_mlp)
    model, opt = build()
    with contextlib.ExitStack() as stack:
        if wide:  # no checkpoint survived: the resumed session says its model is the new start
            stack.enter_context(pytest.warns(UserWarning, match="resuming a run that has no checkpoint"))
        rec = stack.enter_context(
            ckptlab.Recorder(run_dir, model, opt, step_fn=step, build_fn=build, resume=True, ckpt_every=1000)
        )
        first = rec.next_step
        assert first == len(returned)  # the failed step left no complete record
        for batch, ids in batches[first : first + 3]:
            rec.step(batch, sample_ids=ids)
    run = assert_intact(run_dir, batches, [*returned, first, first + 1, first + 2])
    assert run.damaged == []
    assert run.checkpoints[-1] == first
