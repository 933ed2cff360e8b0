"""`--json`: stdout is one JSON document whatever the user's build_fn/step_fn print, by any
route (Python, fd 1, C, a subprocess, a DataLoader worker), for every command that runs them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import act_models as am
from tests import models
from tests import noisy_models as nm

ROOT = Path(__file__).resolve().parents[2]
SPIKE = 30


@pytest.fixture(scope="module")
def noisy_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("noisy") / "run"
    models.record_run(path, nm.build, nm.step, am.spiky_regression_batches(40, SPIKE), ckpt_every=10, keep_last=10)
    return path


def ckptlab(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "ckptlab", *map(str, args)], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)  # one document, nothing around it
    for mark in nm.MARKS:
        assert mark in done.stderr, (mark, done.stderr[-3000:])
    if sys.platform != "win32":
        assert nm.C_MARK in done.stderr
    return doc


def test_replay_json(noisy_run):
    doc = ckptlab("replay", "--run", noisy_run, "--step", SPIKE, "--json")
    assert doc["requested_step"] == SPIKE and doc["deterministic"] is True


def test_dirty_json_with_attribution(noisy_run):
    doc = ckptlab("dirty", "--run", noisy_run, "--json")
    assert doc["attribution"]["status"] not in ("off", "unavailable"), doc["attribution"]
    assert SPIKE in doc["attribution"]["steps"]


def test_export_json_with_gradients(noisy_run, tmp_path):
    pytest.importorskip("tensorboard")
    doc = ckptlab("export", "--run", noisy_run, "--tensorboard", tmp_path / "tb", "--json")
    assert doc["gradient_checkpoints"]


def test_the_claim_in_process_under_fd_capture(capfd):
    """In one process (a test's `main([...])`): the document reaches what was stdout, every
    other write to stdout (sys.stdout, fd 1) reaches stderr, and close() gives stdout back."""
    from ckptlab.cli.common import open_terminal
    from ckptlab.render.console import Terminal

    capfd.readouterr()
    term = Terminal(json_mode=True)
    term.claim_stdout()
    print("user print")
    os.write(1, b"user fd1\n")
    term.json({"a": 1})
    term.close()
    term.close()  # idempotent
    print("after")
    out, err = capfd.readouterr()
    assert out == json.dumps({"a": 1}, indent=2) + "\n" + "after\n"
    assert "user print" in err and "user fd1" in err
    assert open_terminal(True)._claim is None  # no click context: nothing to close it, so no claim
