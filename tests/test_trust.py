"""The trust rule: a run directory someone sent you is data. Its manifest names the code that
recorded it; ckptlab runs only your own files, unchanged since recording, unless you opt in
(--trust-run-code / CKPTLAB_TRUST_RUN_CODE=1). Never code shipped inside the run, never from
a folder the manifest names."""

import hashlib
import json
import os
import shutil
import sys
import time

import pytest

from tests import act_models as am
from tests import models

# What a hostile run ships: importing it leaves a mark (a real exploit would do worse).
EVIL = """
import os, pathlib
pathlib.Path(os.environ["CKL_TRUST_MARKER"]).write_text("ran")

def build():
    return None

def step(model, optimizer, batch):
    return None
"""


@pytest.fixture(scope="module")
def spiky_run(tmp_path_factory):
    """A real recorded run with a loss spike (so `dirty` wants to attribute a step)."""
    path = tmp_path_factory.mktemp("trust") / "run"
    models.record_run(path, am.build_healthy, models.step_mlp, am.spiky_regression_batches(60, 40), ckpt_every=20)
    return path


@pytest.fixture
def received(spiky_run, tmp_path, monkeypatch):
    """The run as received: its manifest points build_fn/step_fn at a module whose file is not
    on this machine, with the evil code shipped inside the run (`sources/`) and in the folder
    its `cwd` names."""
    run = tmp_path / "received"
    shutil.copytree(spiky_run, run)
    sha = hashlib.sha256(EVIL.encode()).hexdigest()
    (run / "sources" / f"{sha}.py").write_text(EVIL)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "ckl_evil.py").write_text(EVIL)
    manifest = json.loads((run / "manifest.json").read_text())
    for role, qualname in (("build_fn", "build"), ("step_fn", "step")):
        manifest["functions"][role] = {
            "module": "ckl_evil",
            "qualname": qualname,
            "file": "/nonexistent/project/ckl_evil.py",
            "file_rel": f"sources/{sha}.py",
            "sha256": sha,
            "cwd": str(elsewhere),
            "source_copy": f"sources/{sha}.py",
        }
    (run / "manifest.json").write_text(json.dumps(manifest))
    marker = tmp_path / "marker"
    monkeypatch.setenv("CKL_TRUST_MARKER", str(marker))
    monkeypatch.delenv("CKPTLAB_TRUST_RUN_CODE", raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield run, marker, elsewhere
    sys.modules.pop("ckl_evil", None)


def _nothing_ran(marker, elsewhere):
    assert not marker.exists(), "code from the run was executed"
    assert "ckl_evil" not in sys.modules and str(elsewhere) not in sys.path


def test_replay_refuses_code_that_came_with_the_run(cli, received):  # noqa: F811
    run, marker, elsewhere = received
    r = cli("replay", "--run", run, "--step", "40")
    assert r.code == 1 and "Traceback" not in r.err
    assert "is not on this machine" in r.err and "--trust-run-code" in r.err and "CKPTLAB_TRUST_RUN_CODE=1" in r.err
    _nothing_ran(marker, elsewhere)


def test_dirty_scans_but_does_not_attribute_with_code_from_the_run(cli, received):  # noqa: F811
    run, marker, elsewhere = received
    r = cli("dirty", "--run", run, "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["attribution"]["status"] == "unavailable" and "--trust-run-code" in doc["attribution"]["note"]
    assert any(f["step"] == 40 for f in doc["flagged"])  # the data scans still ran
    assert "attribution skipped" in r.err
    _nothing_ran(marker, elsewhere)


def test_export_with_gradients_refuses_before_running_anything(cli, received, tmp_path):  # noqa: F811
    run, marker, elsewhere = received
    r = cli("export", "--run", run, "--tensorboard", tmp_path / "tb")
    assert r.code == 1 and "--trust-run-code" in r.err and "Traceback" not in r.err
    _nothing_ran(marker, elsewhere)


def test_info_does_not_call_a_file_inside_the_run_unchanged(cli, received):  # noqa: F811
    run, marker, elsewhere = received
    functions = cli("info", "--run", run, "--json", "--no-verify").json()["functions"]
    assert functions["build_fn"]["found"] is False and functions["build_fn"]["changed"] is None
    _nothing_ran(marker, elsewhere)


@pytest.mark.parametrize("module", ["__main__", "ckl_evil"])
def test_a_file_shipped_beside_the_run_with_the_recorded_hash_is_not_trusted(cli, received, module):  # noqa: F811
    """A received archive holding the run and, beside it, a file whose sha256 its manifest
    names (as a moved project would be found): the hash proves nothing, the manifest came with
    the file. Only the recorded absolute path counts as the user's own."""
    run, marker, elsewhere = received
    beside = run.parent / "ckl_evil.py"
    beside.write_text(EVIL)
    manifest = json.loads((run / "manifest.json").read_text())
    for desc in manifest["functions"].values():
        desc.update(module=module, file_rel="../ckl_evil.py", cwd="/nonexistent")
    (run / "manifest.json").write_text(json.dumps(manifest))
    for args in (("replay", "--step", "40"), ("dirty", "--json")):
        r = cli(*args, "--run", run)
        assert "Traceback" not in r.err
        assert "not known to be yours" in r.err or "not known to be yours" in r.out, r.err
        _nothing_ran(marker, elsewhere)
    assert str(run.parent) not in sys.path
    r = cli("replay", "--run", run, "--step", "40", "--trust-run-code")  # the user says it is theirs
    assert marker.read_text() == "ran"


def test_the_opt_in_runs_it_and_says_so(cli, received):  # noqa: F811
    run, marker, _ = received
    r = cli("replay", "--run", run, "--step", "40", "--trust-run-code")
    assert marker.read_text() == "ran"  # the user asked for it
    assert "NOT verified" in r.err and "build_fn must return" in r.err


@pytest.mark.parametrize("inside", [True, False], ids=["in-the-run", "elsewhere"])
def test_importing_code_the_run_holds_writes_no_bytecode_into_it(tmp_path, monkeypatch, inside):
    """Python writes bytecode beside what it imports, by default: not into a run directory
    (its `sources/` copy, imported with the opt-in), which replay only reads."""
    import importlib

    from ckptlab.training.userfns import _no_bytecode_in

    run = tmp_path / "run"
    folder = run / "sources" if inside else tmp_path / "project"
    folder.mkdir(parents=True)
    (folder / "ckl_held.py").write_text("X = 1\n")
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # (Python's default)
    monkeypatch.setattr(sys, "path", [str(folder), *sys.path])
    with _no_bytecode_in(run, folder / "ckl_held.py"):
        assert importlib.import_module("ckl_held").X == 1
    sys.modules.pop("ckl_held")
    assert (folder / "__pycache__").exists() is not inside and sys.dont_write_bytecode is False


def test_your_own_unchanged_code_runs_and_is_named(cli, spiky_run, monkeypatch):  # noqa: F811
    from ckptlab.training import userfns

    monkeypatch.setattr(userfns, "_announced", set())  # said once per process: this test's turn
    r = cli("replay", "--run", spiky_run, "--step", "3", "--json", "--no-trace", "--no-counterfactuals")
    assert r.code == 0, r.err
    assert f"running step_fn from {models.__file__} (unchanged since recording)" in r.err


def test_auto_discovery_ignores_a_run_from_the_future(cli, spiky_run, tmp_path, monkeypatch):  # noqa: F811
    runs = tmp_path / "runs"
    shutil.copytree(spiky_run, runs / "mine")
    shutil.copytree(spiky_run, runs / "downloaded")
    future = time.time() + 365 * 86400
    for root, dirs, files in os.walk(runs / "downloaded"):
        for name in dirs + files:
            os.utime(os.path.join(root, name), (future, future))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CKPTLAB_RUN", raising=False)
    r = cli("info", "--json", "--no-verify")
    assert r.code == 0, r.err
    assert r.json()["run"].endswith("mine") and "ignoring runs/downloaded: written in the future" in r.err


def test_export_checks_its_optional_dependency_before_running_any_code(cli, received, tmp_path, monkeypatch):  # noqa: F811
    run, marker, elsewhere = received
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # tensorboard not installed
    r = cli("export", "--run", run, "--tensorboard", tmp_path / "tb", "--trust-run-code")
    assert r.code == 1 and "needs the tensorboard package" in r.err
    _nothing_ran(marker, elsewhere)


def test_a_manifest_that_names_no_function_is_a_clear_replay_error(tmp_path):
    from ckptlab.errors import ReplayError
    from ckptlab.training.userfns import load

    with pytest.raises(ReplayError, match="does not name the module and function of step_fn"):
        load({"file": "train.py", "sha256": "0" * 64}, "step_fn", tmp_path)


def test_ckptlabs_own_step_functions_survive_an_upgrade(tmp_path):
    """An integration's training_step lives in ckptlab: a newer ckptlab is still ckptlab's code."""
    from ckptlab.training.userfns import trusted_file

    desc = {
        "module": "ckptlab.integrations._common",
        "qualname": "end_step",
        "file": "/old/site-packages/x.py",
        "sha256": "0" * 64,
    }
    path, unchanged = trusted_file(desc, "step_fn", tmp_path)
    assert unchanged and path.name == "_common.py" and path.parent.name == "integrations"


def test_strings_from_a_run_reach_the_terminal_inert(cli, spiky_run, tmp_path):  # noqa: F811
    """A checkpoint's reason is run data: escape sequences and rich markup are shown, not obeyed."""
    run = tmp_path / "run"
    shutil.copytree(spiky_run, run)
    commit = next(run.glob("checkpoints/step-*/COMMIT.json"))
    doc = json.loads(commit.read_text())
    doc["reason"] = "\x1b[2J\x1b]0;owned\x07[bold red]pwned[/]"
    commit.write_text(json.dumps(doc))
    for args in (("info", "--no-verify"), ("rollback", "--dry-run", "--no-verify", "--before-anomaly")):
        r = cli(*args, "--run", run)
        assert "\x1b" not in r.out + r.err and "\x07" not in r.out + r.err
        assert "\\x1b[2J" in r.out and "pwned[/]" in r.out  # shown as typed (the table may wrap it)


def test_the_same_code_imported_from_another_copy_is_still_your_own(tmp_path, monkeypatch):
    """A package installed in site-packages beside its source checkout, or ckptlab's own bundled
    example recorded from another checkout: the name imports a file with the recorded hash."""
    from ckptlab.training import userfns

    code = "def build():\n    return 'built'\n"
    for folder in ("checkout", "site"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "ckl_twin.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "ckl_twin", raising=False)
    desc = {
        "module": "ckl_twin",
        "qualname": "build",
        "file": str(tmp_path / "checkout" / "ckl_twin.py"),
        "sha256": hashlib.sha256(code.encode()).hexdigest(),
    }
    fn, unchanged = userfns.load(desc, "build_fn", tmp_path / "run")
    assert fn() == "built" and unchanged
    example = {
        "module": "ckptlab.examples.tiny_lm",
        "qualname": "build",
        "file": "/elsewhere/ckptlab/examples/tiny_lm.py",
        "sha256": "0" * 64,
    }
    assert callable(userfns.load(example, "build_fn", tmp_path / "run")[0])


NON_UTF8_SCRIPT = """
import torch, ckptlab

def build():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)

def step(model, optimizer, batch):
    loss = ((model(batch[0]) - batch[1]) ** 2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss

if __name__ == "__main__":
    model, optimizer = build()
    torch.manual_seed(1)
    with ckptlab.Recorder("run", model, optimizer, step_fn=step, build_fn=build, ckpt_every=4) as rec:
        for i in range(4):
            x, y = torch.randn(3, 4), torch.randn(3, 1)
            if i == 3:
                x[1, 0] = float("nan")
            try:
                rec.step((x, y), sample_ids=[3 * i, 3 * i + 1, 3 * i + 2])
            except ckptlab.NonFiniteLoss:
                pass
"""


@pytest.mark.skipif(sys.platform != "linux", reason="a file name that is not UTF-8 is a Linux (bytes) path")
def test_a_script_in_a_folder_whose_name_is_not_utf8_records_and_replays(cli, tmp_path):
    """The folder's name holds the byte 0xff (undecodable: Python carries it as a surrogate);
    replay imports the recorded __main__ script from there (it used to end in an internal
    UnicodeEncodeError)."""
    import subprocess

    folder = tmp_path / os.fsdecode(b"r\xffun")
    folder.mkdir()
    (folder / "train.py").write_text(NON_UTF8_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "train.py"], cwd=folder, env=env, check=True, capture_output=True)
    r = cli("replay", "--run", folder / "run", "--step", 3, "--json")
    assert r.code == 0, r.err
    report = json.loads(r.out)
    assert report["reproduced"] and report["root_step"] == 3 and report["samples"][0]["sample_id"] == 10
