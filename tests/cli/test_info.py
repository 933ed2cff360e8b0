"""`ckptlab info`: exit codes, the JSON keys, integrity, anomalies, disk use, changed sources."""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptlab.cli import main
from tests import models
from tests.run.test_bad_input import unclose

ROOT = Path(__file__).resolve().parents[2]
KEYS = {
    "run",
    "format_version",
    "created",
    "versions",
    "device",
    "world_size",
    "layout",
    "sessions",
    "steps",
    "checkpoints",
    "anomalies",
    "warnings",
    "validation",
    "disk",
    "functions",
    "environment",
    "recording",
    "problems",
    "damaged",
}


@pytest.fixture
def info(capsys):
    """Run `ckptlab info ARGS` in-process: (exit code, stdout, stderr)."""

    def run(*args):
        with pytest.raises(SystemExit) as e:
            main(["info", *map(str, args)])
        out, err = capsys.readouterr()
        return e.value.code, out, err

    return run


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One run with validation, a loss spike (step 20) and a non-finite loss (step 25)."""
    run_dir = tmp_path_factory.mktemp("info") / "run"
    batches = list(models.mlp_batches(30))
    x, y = batches[20][0]
    batches[20] = ((x, y + 1e4), batches[20][1])
    batches[25] = ((torch.full_like(x, math.nan), y), batches[25][1])
    models.record_run(
        run_dir,
        models.build_mlp,
        models.step_mlp,
        batches,
        ckpt_every=10,
        keep_last=5,
        on_nonfinite="record",
        validate=lambda i, m: {"val_loss": 1.0 / (i + 1)} if i in (4, 9) else None,
    )
    return run_dir


def copy_run(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    return dst


def test_json_has_the_documented_keys_and_verifies(recorded, info):
    code, out, err = info("--run", recorded, "--json")
    assert code == 0, err
    s = json.loads(out)
    assert set(s) == KEYS
    assert s["format_version"] == 2 and s["run"] == str(recorded)
    assert s["steps"] == {
        "recorded": 30,
        "first": 0,
        "last": 29,
        "batches_retained": [0, 29],
        "batch_ranges": [[0, 29]],
        "incomplete": [],
        "loss_not_known": [],
    }
    assert [c["step"] for c in s["checkpoints"]] == [0, 5, 10, 20]
    assert all(c["verified"] is True and c["problem"] is None for c in s["checkpoints"])
    assert [c["reason"] for c in s["checkpoints"]] == ["start", "best", "best", "periodic"]
    assert all(c["healthy"] for c in s["checkpoints"])  # each holds the state before its step ran
    assert s["validation"]["count"] == 2 and s["validation"]["best"] == {"step": 10, "value": 0.1}
    assert s["problems"] == [] and s["damaged"] == []


def test_docs_info_md_shows_the_keys_info_writes(recorded, info):
    """docs/info.md's example document has the keys of a real one, at each level it shows."""
    doc_text = (ROOT / "docs" / "info.md").read_text()
    shown = json.loads(doc_text.split("```json\n", 1)[1].split("```", 1)[0])
    real = json.loads(info("--run", recorded, "--json")[1])
    assert set(shown) == set(real) == KEYS
    assert set(shown["steps"]) == set(real["steps"]) and set(shown["disk"]) == set(real["disk"])
    assert set(shown["checkpoints"][0]) == set(real["checkpoints"][0])
    assert set(shown["validation"]) == set(real["validation"])
    assert set(shown["functions"]["build_fn"]) == set(real["functions"]["build_fn"])
    for key in KEYS:  # and the table says what each holds
        assert f"`{key}`" in doc_text.split("```json", 1)[1].split("```", 2)[-1], key


def test_anomalies_are_listed(recorded, info):
    code, out, _ = info("--run", recorded, "--json")
    kinds = [(a["step"], a["kind"]) for a in json.loads(out)["anomalies"]]
    assert (20, "loss_spike") in kinds and (25, "nonfinite_loss") in kinds and (25, "nonfinite_grad") in kinds
    assert kinds == sorted(kinds, key=lambda k: k[0])
    code, out, _ = info("--run", recorded)
    assert code == 0
    assert "first at step 20 (loss_spike)" in out and "nonfinite_loss" in out


def test_disk_use_per_part(recorded, info):
    disk = json.loads(info("--run", recorded, "--json")[1])["disk"]
    assert set(disk) == {"checkpoints", "batches", "journal", "sources", "archive", "total"}
    assert disk["checkpoints"] > 0 and disk["batches"] > 0 and disk["journal"] > 0 and disk["archive"] == 0
    assert disk["total"] >= sum(v for k, v in disk.items() if k != "total")
    out = info("--run", recorded)[1]
    assert "disk       checkpoints" in out and "total" in out


def test_text_output(recorded, info):
    code, out, err = info("--run", recorded)
    assert code == 0 and err == ""
    assert "steps      30 recorded: 0..29; batches kept for 0..29" in out
    assert "validation 2 points; best val_loss=0.1 at step 10" in out
    assert "step_fn    tests.models.step_mlp" in out and "unchanged" in out


def test_a_tampered_checkpoint_exits_1_naming_it(recorded, tmp_path, info):
    run_dir = copy_run(recorded, tmp_path / "run")
    model = run_dir / "checkpoints" / "step-000000010" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-1] ^= 0x80
    model.write_bytes(bytes(data))

    code, out, err = info("--run", run_dir, "--json")
    assert code == 1
    assert err == f"ckptlab: error: {model}: sha256 does not match the hash recorded at commit (tampered or corrupt)\n"
    s = json.loads(out)  # stdout is still the whole JSON document
    assert [c["verified"] for c in s["checkpoints"]] == [True, True, False, True]
    assert s["damaged"] == [s["checkpoints"][2]["problem"]]

    code, out, err = info("--run", run_dir)
    assert code == 1 and "FAILED" in out and err.count("ckptlab: error:") == 1
    assert info("--run", run_dir, "--no-verify")[0] == 0  # not hashed, not failed


def test_truncated_and_corrupt_files_exit_1(recorded, tmp_path, info):
    run_dir = copy_run(recorded, tmp_path / "a")
    state = run_dir / "checkpoints" / "step-000000005" / "state.safetensors"
    state.write_bytes(state.read_bytes()[:100])
    code, _, err = info("--run", run_dir)
    assert (code, err) == (
        1,
        f"ckptlab: error: {state.parent}: corrupt checkpoint (state.safetensors has the wrong size)\n",
    )

    run_dir = copy_run(recorded, tmp_path / "b")
    seg = sorted((run_dir / "batches" / "rank0").iterdir())[0]
    data = bytearray(seg.read_bytes())
    data[200] ^= 0xFF
    seg.write_bytes(bytes(data))
    code, out, err = info("--run", run_dir, "--json")
    assert code == 1 and f"ckptlab: error: {seg}: " in err and "(corrupt file)" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_a_crash_torn_tail_is_a_warning_not_a_failure(tmp_path, info):
    run_dir = tmp_path / "run"
    models.record_run(run_dir, models.build_mlp, models.step_mlp, models.mlp_batches(30))
    unclose(run_dir)  # killed: the Recorder never closed
    seg = sorted((run_dir / "journal").glob("*.log"))[-1]
    seg.write_bytes(seg.read_bytes()[:-5])
    code, out, err = info("--run", run_dir)
    assert code == 0
    assert "warning:" in err and "torn at the tail (an interrupted write), ignored" in err
    s = json.loads(info("--run", run_dir, "--json")[1])
    assert s["damaged"] == [] and len(s["problems"]) == 1
    assert s["steps"]["incomplete"] == [29]  # its batch is there, its health was torn


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: None, "no such directory"),
        (lambda d: d.mkdir(), "not a ckptlab run (no manifest.json)"),
        (
            lambda d: (d.mkdir(), (d / "manifest.json").write_text('{"format": "ckptlab-run", "format_version": 9}')),
            "written by a newer ckptlab (run format 9; this ckptlab reads up to 2) (upgrade ckptlab)",
        ),
    ],
)
def test_bad_runs_are_one_line_errors(tmp_path, info, setup, message):
    run_dir = tmp_path / "run"
    setup(run_dir)
    code, out, err = info("--run", run_dir)
    assert (code, out, err) == (1, "", f"ckptlab: error: {run_dir}: {message}\n")


def test_usage_error_exits_2(info):
    code, _, err = info("--bogus")
    assert code == 2 and "No such option" in err


def test_debug_after_the_command_shows_the_traceback(tmp_path, info):
    missing = tmp_path / "nope"
    code, out, err = info("--run", missing, "--debug")  # typed at the end, after a failure
    assert code == 1 and out == ""
    assert "Traceback" in err and err.endswith(f"ckptlab: error: {missing}: no such directory\n")
    code, _, err = info("--run", missing)
    assert (code, err) == (1, f"ckptlab: error: {missing}: no such directory\n")


SOURCE = """import torch


def build():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def step(model, optimizer, batch):
    loss = model(batch[0]).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss
"""


def test_changed_source_is_detected(tmp_path, monkeypatch, info):
    src = tmp_path / "src"
    src.mkdir()
    (src / "usercode_info.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(src))
    user = importlib.import_module("usercode_info")
    try:
        run_dir = tmp_path / "run"
        models.record_run(run_dir, user.build, user.step, models.mlp_batches(2))
    finally:
        sys.modules.pop("usercode_info", None)

    functions = json.loads(info("--run", run_dir, "--json")[1])["functions"]
    assert functions["step_fn"] == {
        "name": "usercode_info.step",
        "file": str(src / "usercode_info.py"),
        "found": True,
        "changed": False,
        "runs": str((src / "usercode_info.py").resolve()),
        "installed": False,
        "same_tokens": False,
    }

    (src / "usercode_info.py").write_text(SOURCE.replace("lr=0.1", "lr=0.2"))
    code, out, _ = info("--run", run_dir, "--json")
    assert code == 0 and json.loads(out)["functions"]["build_fn"]["changed"] is True
    assert "source changed since recording" in info("--run", run_dir)[1]

    (src / "usercode_info.py").unlink()
    functions = json.loads(info("--run", run_dir, "--json")[1])["functions"]
    assert functions["build_fn"]["found"] is False and functions["build_fn"]["changed"] is None
    assert "file not found" in info("--run", run_dir)[1]


def test_run_discovery(recorded, tmp_path, monkeypatch, info):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CKPTLAB_RUN", raising=False)
    code, _, err = info()
    assert code == 1 and "no run given and none found under ./runs (pass --run DIR or set CKPTLAB_RUN)" in err

    monkeypatch.setenv("CKPTLAB_RUN", str(recorded))
    assert json.loads(info("--json")[1])["run"] == str(recorded)

    monkeypatch.delenv("CKPTLAB_RUN")
    (tmp_path / "runs").mkdir()
    copy_run(recorded, tmp_path / "runs" / "old")
    models.record_run(tmp_path / "runs" / "new", models.build_mlp, models.step_mlp, models.mlp_batches(2))
    code, out, err = info("--json")
    assert code == 0 and json.loads(out)["run"] == "runs/new"
    assert "using run runs/new (the most recently written under ./runs; pass --run to choose)" in err


def test_as_a_process_stdout_is_only_json(recorded):
    done = subprocess.run(
        [sys.executable, "-m", "ckptlab", "info", "--run", str(recorded), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout)) == KEYS
    done = subprocess.run(
        [sys.executable, "-m", "ckptlab", "info", "--run", str(recorded / "nope")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == f"ckptlab: error: {recorded / 'nope'}: no such directory\n"
