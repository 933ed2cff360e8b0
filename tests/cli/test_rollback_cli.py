"""`ckptlab rollback`: candidates, dry run, export, rewind, before-anomaly, integrity first,
and finishing an interrupted rewind."""

import os
import shutil

import pytest

import ckptlab
from ckptlab.run import archive
from tests import act_models as am
from tests import models


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = tmp_path_factory.mktemp("rbcli") / "run"
    models.record_run(
        path,
        am.build_overfit,
        models.step_mlp,
        am.overfit_batches(60),
        ckpt_every=20,
        health_every=5,
        keep_last=10,
        validate=am.overfit_validate(5),
    )
    return path


@pytest.fixture
def run_dir(recorded, tmp_path):
    shutil.copytree(recorded, tmp_path / "run")
    return tmp_path / "run"


def listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_dry_run_changes_nothing(cli, run_dir):
    before = listing(run_dir)
    r = cli("rollback", "--run", run_dir, "--dry-run", "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["step"] == 30 and doc["by"] == "metric" and doc["action"]["dry_run"] is True
    assert doc["action"]["segments_split"] == ["journal/s000-000000020.log", "batches/rank0/s000-000000020.log"]
    assert [c["step"] for c in doc["candidates"] if c["chosen"]] == [30]
    assert listing(run_dir) == before


def test_rewind_and_table(cli, run_dir):
    r = cli("rollback", "--run", run_dir)
    assert r.code == 0, r.err
    assert "chosen: step 30" in r.out and "resume=True" in r.out
    run = ckptlab.open_run(run_dir)
    assert run.manifest["rollback"]["step"] == 30 and run.steps[-1] == 29
    assert len(run.archives) == 1


def test_export_to_dir(cli, run_dir, tmp_path):
    r = cli("rollback", "--run", run_dir, "--to", tmp_path / "best", "--json")
    assert r.code == 0, r.err
    assert r.json()["action"]["kind"] == "export"
    assert sorted(os.listdir(tmp_path / "best")) == ["export.json", "model.safetensors", "optimizer.pt"]
    assert ckptlab.open_run(run_dir).manifest["rollback"] is None  # export does not rewind


def test_before_anomaly(cli, tmp_path):
    def batches():
        for step, ((x, y), ids) in enumerate(am.regression_batches(50)):
            if step == 44:
                x = x.clone()
                x[0, 0] = float("nan")
            yield (x, y), ids

    models.record_run(tmp_path / "r", am.build_healthy, models.step_mlp, batches(), ckpt_every=10, keep_last=10)
    r = cli("rollback", "--run", tmp_path / "r", "--json")  # no validation: by health
    doc = r.json()
    assert doc["by"] == "before_anomaly" and doc["step"] == 40
    assert doc["first_anomaly"] == {"step": 44, "kind": "nonfinite_loss"}
    assert [c["healthy"] for c in doc["candidates"]] == [True] * 5


def test_conflicting_options_are_a_usage_error(cli, run_dir):
    assert cli("rollback", "--run", run_dir, "--before-anomaly", "--metric", "val_loss").code == 2


def test_another_metric_without_mode_is_refused(cli, tmp_path):
    # The run chooses by val_loss (min). `--metric val_acc` used to borrow that "min": early
    # stopping picked the least accurate checkpoint (step 10) and a rewind archived the best.
    acc = [0.5, 0.6, 0.8, 0.7, 0.65, 0.6]

    def validate(i, model):
        return {"val_loss": 1.0 - acc[i // 10], "val_acc": acc[i // 10]} if i % 10 == 9 else None

    path = tmp_path / "r"
    models.record_run(
        path, am.build_healthy, models.step_mlp, am.regression_batches(60), validate=validate, ckpt_every=20
    )
    before = listing(path)
    r = cli("rollback", "--run", path, "--metric", "val_acc")
    assert r.code == 1 and r.err.strip().count("\n") == 0, r.err
    assert "val_acc is not the run's val_metric (val_loss)" in r.err and "--mode" in r.err
    assert listing(path) == before and ckptlab.open_run(path).manifest["rollback"] is None
    assert (
        cli("rollback", "--run", path, "--metric", "val_acc", "--mode", "max", "--dry-run", "--json").json()["step"]
        == 30
    )
    assert cli("rollback", "--run", path, "--metric", "val_loss", "--dry-run", "--json").json()["step"] == 30


def test_corrupt_target_moves_nothing(cli, run_dir):
    model = run_dir / "checkpoints" / "step-000000030" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF
    model.write_bytes(bytes(data))
    before = listing(run_dir)
    r = cli("rollback", "--run", run_dir, "--no-verify")
    assert r.code == 1 and "sha256 does not match" in r.err
    assert listing(run_dir) == before
    doc = cli("rollback", "--run", run_dir, "--dry-run", "--json").json()  # verified: 30 is skipped
    assert doc["step"] == 25 and "sha256" in next(c["integrity"] for c in doc["candidates"] if c["step"] == 30)


def test_corrupt_best_checkpoint_is_named_in_a_note(cli, run_dir):
    # Checkpoint 30 (the best) exists but fails its check: the output must say so, not that
    # there is "no checkpoint at the best step" (the user would look for keep_best=False).
    model = run_dir / "checkpoints" / "step-000000030" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF
    model.write_bytes(bytes(data))
    doc = cli("rollback", "--run", run_dir, "--dry-run", "--json").json()
    assert doc["step"] == 25
    assert "checkpoint 30 failed its integrity check; using 25" in doc["notes"]
    assert "no checkpoint at the best step" not in doc["why"] and "failed its integrity check" in doc["why"]


def test_rerun_finishes_an_interrupted_rewind(cli, run_dir, monkeypatch):
    calls = {"n": 0}
    real = os.rename

    def dying_rename(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # a stand-in for the process dying mid-move
        return real(*a, **k)

    monkeypatch.setattr(os, "rename", dying_rename)
    with pytest.raises(KeyboardInterrupt):
        archive.rewind(run_dir, 30)
    monkeypatch.setattr(os, "rename", real)
    assert cli("rollback", "--run", run_dir, "--dry-run").code == 1
    r = cli("rollback", "--run", run_dir)
    assert r.code == 0 and "finished the interrupted rollback to step 30" in r.out
    assert archive.unfinished_rollback(run_dir) is None
    assert ckptlab.open_run(run_dir).steps[-1] == 29
