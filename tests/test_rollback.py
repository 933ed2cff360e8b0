"""Rollback never loses data: a rewound run resumes bit-exactly, the archived steps stay
readable (and replayable from the hard-linked checkpoint), and a kill at any file operation
of a rewind leaves every frame and checkpoint reachable, a Recorder that refuses to resume,
and a state that re-running finishes into the same result."""

import os
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

import ckptlab
from ckptlab.analysis.rollback import choose
from ckptlab.run import archive, framelog
from ckptlab.run.layout import parse_checkpoint, parse_segment
from ckptlab.run.portable import export_checkpoint
from ckptlab.training.state import load_model, load_train_state, restore_rng
from tests import act_models as am
from tests import models

STEPS = 60


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The overfitting run: periodic checkpoints every 20 steps, a best-validation one at 30
    (mid-segment), validation every 5 steps."""
    path = tmp_path_factory.mktemp("rb") / "run"
    batches = list(am.overfit_batches(STEPS))
    losses = models.record_run(
        path,
        am.build_overfit,
        models.step_mlp,
        batches,
        ckpt_every=20,
        health_every=5,
        keep_last=10,
        validate=am.overfit_validate(5),
    )
    return path, batches, losses


@pytest.fixture
def run_dir(recorded, tmp_path):
    path = tmp_path / "run"
    shutil.copytree(recorded[0], path)
    return path


def frames_under(root: Path) -> set:
    """Every (kind, step, crc) frame in every segment under root (run and archives)."""
    out = set()
    for p in root.rglob("*.log"):
        if parse_segment(p.name):
            out |= {(f.kind, f.step, f.crc) for f in framelog.scan(p).frames}
    return out


def checkpoints_under(root: Path) -> set:
    return {
        (p.name, (p / "model.safetensors").read_bytes()) for p in root.rglob("step-*") if (p / "COMMIT.json").is_file()
    }


def main_state(run_dir: Path) -> tuple:
    run = ckptlab.open_run(run_dir)
    main_frames = set()
    for folder in (run_dir / "journal", run_dir / "batches" / "rank0"):
        for p in folder.glob("*.log"):
            main_frames |= {(f.kind, f.step, f.crc) for f in framelog.scan(p).frames}
    return frozenset(main_frames), tuple(run.checkpoints), run.manifest["rollback"]["step"]


def test_choose_best_validation_mid_segment(run_dir):
    choice = choose(ckptlab.open_run(run_dir))
    assert (choice.by, choice.step) == ("metric", 30)
    assert choice.early_stop.stop_step == 45
    assert [c.step for c in choice.candidates if c.chosen] == [30]
    assert all(c.integrity == "ok" for c in choice.candidates)


def test_rewind_then_resume_is_bit_exact_and_archive_stays_readable(run_dir, recorded):
    _, batches, losses = recorded
    before = ckptlab.open_run(run_dir)
    original = {s: before.batch(s) for s in range(40, STEPS)}
    plan = archive.rewind(run_dir, 30)
    assert plan.summary()["segments_split"] == ["journal/s000-000000020.log", "batches/rank0/s000-000000020.log"]

    run = ckptlab.open_run(run_dir)
    assert run.steps[-1] == 29 and run.metrics().step[-1] == 29
    assert run.checkpoints[-1] == 30
    assert [p["step"] for p in run.validation()][-1] == 30  # measured on the state checkpoint 30 holds
    assert run.manifest["rollback"]["step"] == 30

    arch = ckptlab.open_run(run.archives[0])
    assert arch.checkpoints == [30, 40]
    arch.checkpoint(30).verify()
    assert arch.metrics().loss[arch.metrics().window(30, STEPS - 1)].tolist() == losses[30:]
    batch, ids = arch.batch(45)
    assert torch.equal(batch[0], original[45][0][0]) and ids == original[45][1]

    model, opt = am.build_overfit()
    with ckptlab.Recorder(
        run_dir,
        model,
        opt,
        step_fn=models.step_mlp,
        build_fn=am.build_overfit,
        resume=True,
        ckpt_every=20,
        health_every=5,
        keep_last=10,
    ) as rec:
        assert (rec.restored_step, rec.next_step) == (30, 30)
        resumed = [rec.step(b, sample_ids=i).item() for b, i in batches[30:]]
    assert resumed == losses[30:]  # bit for bit

    run = ckptlab.open_run(run_dir)
    assert run.steps[-1] == STEPS - 1 and run.metrics().loss.tolist() == losses
    assert run.manifest["rollback"] is None and run.manifest["sessions"][-1]["restored_from"] == 30
    assert [h["step"] for h in run.manifest["rollbacks"]] == [30]
    arch = ckptlab.open_run(run.archives[0])  # still readable after the resumed run wrote on
    assert torch.equal(arch.batch(55)[0][0], original[55][0][0])
    _replay(run, 40, losses)
    _replay(arch, 40, losses)  # the archived timeline replays from its own checkpoints too


def _replay(run, start: int, losses: list[float]) -> None:
    """Restore checkpoint `start` and re-run the recorded steps: every loss matches the record."""
    model, opt = am.build_overfit()
    ckpt = run.checkpoint(start)
    load_model(model, *ckpt.load_model())
    state = ckpt.load_state()
    load_train_state(state, opt)
    restore_rng(state["rng"])
    for step in range(start, STEPS):
        batch, _ = run.batch(step)
        assert models.step_mlp(model, opt, batch).item() == losses[step], step


class Killed(BaseException):
    """Stands in for SIGKILL: raised at the n-th filesystem operation of a rewind."""


class KillAt:
    OPS = ("rename", "replace", "link")

    def __init__(self, n: int | None):
        self.n, self.count = n, 0

    def __enter__(self):
        self.saved = {name: getattr(os, name) for name in self.OPS}
        for name in self.OPS:
            setattr(os, name, self._wrap(self.saved[name]))
        return self

    def _wrap(self, fn):
        def op(*args, **kwargs):
            if self.n is not None and self.count == self.n:
                raise Killed()
            self.count += 1
            return fn(*args, **kwargs)

        return op

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(os, name, fn)
        return exc[0] is Killed


def test_a_kill_at_any_point_loses_nothing_and_rerunning_finishes(recorded, tmp_path):
    src = recorded[0]
    all_frames, all_ckpts = frames_under(src), checkpoints_under(src)
    clean = tmp_path / "clean"
    shutil.copytree(src, clean)
    with KillAt(None) as counter:
        archive.rewind(clean, 30)
    expected = main_state(clean)
    assert counter.count > 10
    interrupted = 0
    for n in range(counter.count):
        run_dir = tmp_path / f"kill{n}"
        shutil.copytree(src, run_dir)
        with KillAt(n):
            archive.rewind(run_dir, 30)
            pytest.fail("not killed")
        assert frames_under(run_dir) >= all_frames, n  # every frame reachable (main or archive)
        assert checkpoints_under(run_dir) >= all_ckpts, n
        pending = archive.unfinished_rollback(run_dir)
        if pending is not None:
            model, opt = am.build_overfit()
            with pytest.raises(ckptlab.RecordError, match="interrupted"):
                ckptlab.Recorder(run_dir, model, opt, step_fn=models.step_mlp, build_fn=am.build_overfit, resume=True)
            archive.finish_interrupted(run_dir)
            interrupted += 1
        else:  # killed before the intent was written: nothing moved yet; start again
            archive.rewind(run_dir, 30)
        assert main_state(run_dir) == expected, n
        assert frames_under(run_dir) >= all_frames and archive.unfinished_rollback(run_dir) is None
    assert interrupted == counter.count - 1  # only a kill before the intent file leaves nothing to finish


def test_rewind_refuses_while_one_is_unfinished(run_dir):
    with KillAt(8):
        archive.rewind(run_dir, 30)
    with pytest.raises(ckptlab.CkptlabError, match="interrupted"):
        archive.rewind(run_dir, 30)


def test_export_is_loadable_without_ckptlab(tmp_path):
    models.record_run(tmp_path / "lm", models.build_lm, models.step_lm, models.lm_batches(12), ckpt_every=5)
    ckpt = ckptlab.open_run(tmp_path / "lm").checkpoint(10)
    info = export_checkpoint(ckpt, tmp_path / "out")
    assert sorted(info["files"]) == ["model.safetensors", "optimizer.pt", "scheduler.pt"]
    model, opt, sched = models.build_lm()
    model.load_state_dict(
        safetensors.torch.load_file(tmp_path / "out" / "model.safetensors")
    )  # strict, tied names included
    opt.load_state_dict(torch.load(tmp_path / "out" / "optimizer.pt", weights_only=True))
    sched.load_state_dict(torch.load(tmp_path / "out" / "scheduler.pt", weights_only=True))
    assert model.lm_head.weight is model.wte.weight  # the tie survives loading
    tensors, _ = ckpt.load_model()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in tensors.items())
    with pytest.raises(ckptlab.CkptlabError, match="refusing to overwrite"):
        export_checkpoint(ckpt, tmp_path / "out")


# --- names and links: nothing a run directory holds can leave a rewind stuck or reach outside ----


@pytest.mark.parametrize(
    "name, keep_original",
    [
        ("step-000000040\n", False),  # `$` accepted a trailing newline
        ("step-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0664\u0660", False),  # `\d`: Arabic-Indic digits
        ("step-0000000040", True),  # a second spelling of step 40 next to the real one
    ],
)
def test_odd_checkpoint_names_are_not_checkpoints_and_rewinding_finishes(run_dir, name, keep_original, cli):
    real = run_dir / "checkpoints" / "step-000000040"
    odd = real.with_name(name)
    (shutil.copytree if keep_original else os.rename)(real, odd)
    assert 40 not in ckptlab.open_run(run_dir).checkpoints or keep_original
    r = cli("rollback", "--run", run_dir)
    assert r.code == 0, r.err
    assert archive.unfinished_rollback(run_dir) is None
    assert odd.is_dir() and (odd / "model.safetensors").is_file()  # ignored, left where it was
    run = ckptlab.open_run(run_dir)
    assert run.manifest["rollback"]["step"] == 30 and run.checkpoints[-1] == 30
    model, opt = am.build_overfit()
    with ckptlab.Recorder(run_dir, model, opt, step_fn=models.step_mlp, build_fn=am.build_overfit, resume=True) as rec:
        assert (rec.restored_step, rec.next_step) == (30, 30)


def test_names_are_matched_whole_in_ascii_digits_and_canonical():
    assert parse_checkpoint("step-000000040") == 40 and parse_checkpoint("step-1000000000") == 10**9
    assert parse_segment("s000-000000020.log") == (0, 20) and parse_segment("s1000-000000020.log") == (1000, 20)
    for bad in ("step-000000040\n", "step-0000000040", "step-00000004O", "step-\u0661" * 1, "xstep-000000040"):
        assert parse_checkpoint(bad) is None, bad
    for bad in ("s000-000000020.log\n", "s0000-000000020.log", "s000-0000000020.log", "s000-00000002\u0660.log"):
        assert parse_segment(bad) is None, bad


def _outside(tmp_path: Path) -> Path:
    out = tmp_path / "outside"
    out.mkdir()
    (out / "secret.py").write_text("# not part of the run\n")
    return out


def _link_sources(run_dir: Path, out: Path) -> Path:
    shutil.rmtree(run_dir / "sources")
    (run_dir / "sources").symlink_to(out, target_is_directory=True)
    return run_dir / "sources"


def _link_archive(run_dir: Path, out: Path) -> Path:
    (run_dir / "archive").symlink_to(out, target_is_directory=True)
    return run_dir / "archive"


def _link_in_checkpoint(run_dir: Path, out: Path) -> Path:
    link = run_dir / "checkpoints" / "step-000000030" / "notes.py"
    link.symlink_to(out / "secret.py")
    return link


def _link_segment(run_dir: Path, out: Path) -> Path:
    seg = run_dir / "journal" / "s000-000000040.log"
    shutil.move(seg, out / seg.name)
    seg.symlink_to(out / seg.name)
    return seg


@pytest.mark.parametrize("plant", [_link_sources, _link_archive, _link_in_checkpoint, _link_segment])
def test_a_symlink_in_the_run_is_refused_before_anything_moves(run_dir, tmp_path, plant, cli):
    out = _outside(tmp_path)
    link = plant(run_dir, out)
    before, outside = listing(run_dir), listing(out)
    r = cli("rollback", "--run", run_dir)
    assert r.code == 1 and f"{link}: is a symbolic link" in r.err and "moved nothing" in r.err, r.err
    assert len(r.err.strip().splitlines()) == 1 and "Traceback" not in r.err
    assert listing(run_dir) == before and listing(out) == outside  # nothing moved, nothing written outside
    assert os.stat(out / "secret.py").st_nlink == 1  # not hard-linked into the run
    assert cli("rollback", "--run", run_dir, "--dry-run").code == 1  # a dry run says so too


def test_a_symlink_planted_in_an_interrupted_rewind_is_refused_then_it_finishes(run_dir, tmp_path, cli):
    with KillAt(8):
        archive.rewind(run_dir, 30)
    pending = archive.unfinished_rollback(run_dir)
    out = _outside(tmp_path)
    shutil.rmtree(pending / "sources")
    (pending / "sources").symlink_to(out, target_is_directory=True)  # where the source links go
    r = cli("rollback", "--run", run_dir)
    assert r.code == 1 and "is a symbolic link" in r.err
    assert listing(out) == ["secret.py"] and archive.unfinished_rollback(run_dir) == pending
    (pending / "sources").unlink()
    r = cli("rollback", "--run", run_dir)
    assert r.code == 0 and "finished the interrupted rollback to step 30" in r.out
    assert ckptlab.open_run(run_dir).manifest["rollback"]["step"] == 30


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_rewind_moves_each_checkpoint_folder_as_listed(run_dir, monkeypatch):
    """The plan carries the folders it listed; nothing is rebuilt from a step number."""
    from ckptlab.run import checkpoint

    moved = run_dir / "checkpoints" / "step-000000040"
    elsewhere = run_dir / "checkpoints" / "listed-40"
    os.rename(moved, elsewhere)

    def listed(path):
        found, problems = checkpoint.list_checkpoints(path)
        if Path(path) == run_dir and (elsewhere / "COMMIT.json").exists():
            found = sorted([*found, checkpoint.Checkpoint(40, elsewhere, {"files": {}})], key=lambda c: c.step)
        return found, problems

    monkeypatch.setattr(archive, "list_checkpoints", listed)
    plan = archive.rewind(run_dir, 30)
    assert plan.checkpoints == [40] and plan.moved == [elsewhere]
    assert (plan.archive_path / "checkpoints" / "listed-40" / "model.safetensors").is_file()
    assert not elsewhere.exists()


@pytest.mark.parametrize("n", [0, 3, 9, -1])
def test_commands_say_a_rollback_was_interrupted_and_a_rerun_finishes_it(recorded, tmp_path, cli, n):
    """A rewind killed at its n-th file operation (-1: its last): info, report and replay say
    the run is half rewound and name the command that finishes it; `ckptlab rollback` then
    finishes into the archive name an uninterrupted rollback gets; the warning goes."""
    with KillAt(None) as counter:
        archive.rewind(shutil.copytree(recorded[0], tmp_path / "clean"), 30)
    run_dir = shutil.copytree(recorded[0], tmp_path / "run")
    with KillAt(n % counter.count):
        archive.rewind(run_dir, 30, archive=archive.plan_rewind(run_dir, 30).archive)
    half = archive.unfinished_rollback(run_dir) is not None
    assert half == (n != 0)  # a kill at the first operation comes before the intent is written
    for args in (["info"], ["report"], ["replay", "--step", "10", "--no-counterfactuals"]):
        r = cli(*args, "--run", run_dir)
        said = "rollback was interrupted" in r.err and f"ckptlab rollback --run {run_dir}" in r.err
        assert said == half, (args, r.err)
        assert r.code == 0, (args, r.err)
    r = cli("rollback", "--run", run_dir, "--json")
    assert r.code == 0, r.err
    assert r.json()["action"]["archive"] == "archive/rollback-001-to-000000030"
    assert r.json().get("finished_interrupted", False) == half
    assert sorted(p.name for p in (run_dir / "archive").iterdir()) == ["rollback-001-to-000000030"]
    assert "interrupted" not in cli("info", "--run", run_dir).err
