"""A newcomer's first hour (#31 items 5-7): mistakes that point the way (a healthy step, the
wrong run, a diff whose shape changed, a .pt holding a list), a comment that no longer blocks
replay, and `info` and `replay` agreeing on which file a recorded function runs from."""

import importlib
import json
import math
import shutil
import sys

import pytest
import torch

from tests import models

USER_CODE = """import torch


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
NAN_STEP = 5


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
    """(run, the user's own train file): 7 steps of a user module outside the run, a NaN
    input at step 5 (recorded, the run goes on), checkpoints every 2 steps."""
    root = tmp_path_factory.mktemp("newcomer")
    src = root / "src"
    src.mkdir()
    (src / "newcomer_train.py").write_text(USER_CODE)
    sys.path.insert(0, str(src))
    try:
        user = importlib.import_module("newcomer_train")
        batches = list(models.mlp_batches(7))
        (x, y), ids = batches[NAN_STEP]
        batches[NAN_STEP] = ((torch.full_like(x, math.nan), y), ids)
        models.record_run(root / "runs" / "nan", user.build, user.step, batches, ckpt_every=2, on_nonfinite="record")
    finally:
        sys.modules.pop("newcomer_train", None)
    yield root / "runs" / "nan", src / "newcomer_train.py"
    sys.path.remove(str(src))
    sys.modules.pop("newcomer_train", None)


@pytest.fixture
def fresh_announcements(monkeypatch):
    from ckptlab.training import userfns

    monkeypatch.setattr(userfns, "_announced", set())  # said once per process: this test's turn


QUICK = ("--no-trace", "--no-counterfactuals", "--budget", "0")


# --- item 6: a comment is not a change of code -----------------------------------------------------


def test_a_comment_in_your_own_file_does_not_block_replay(cli, user_run, fresh_announcements):
    run, train = user_run
    try:
        edited = USER_CODE.replace("def step(", "# the NaN hunt starts here\n\n\ndef step(").replace(
            "loss = model(batch[0]).pow(2).mean()", "loss  =  model( batch[0] ).pow(2).mean()  # squared"
        )
        train.write_text(edited)
        r = cli("replay", "--run", run, "--step", NAN_STEP, "--json", *QUICK)
        assert r.code == 0, r.err
        assert f"running step_fn from {train} (the recorded code: changed since recording only in comments" in r.err
        doc = r.json()
        assert doc["reproduced"] and doc["root_step"] == NAN_STEP
        assert f"{train} changed since recording only in comments, blank lines or formatting" in "".join(doc["notes"])
        info = cli("info", "--run", run, "--no-verify")
        assert "comments/formatting only" in info.out and "replay runs it" in info.out

        train.write_text(edited.replace("pow(2)", "pow(4)"))  # a real change of code: today's rule
        r = cli("replay", "--run", run, "--step", NAN_STEP, *QUICK)
        assert r.code == 1 and "Traceback" not in r.err
        assert "changed since recording (its code, not only comments or formatting)" in r.err
        assert "--trust-run-code" in r.err
    finally:
        train.write_text(USER_CODE)


def test_same_code_tokens_is_strict_about_code():
    from ckptlab.run.manifest import same_code_tokens

    base = b"def f(x):\n    return x + 1  # one\n"
    assert same_code_tokens(base, b"# header\ndef f( x ):\n\n\n  return x+1\n")  # 2-space indent too
    assert not same_code_tokens(base, b"def f(x):\n    return x + 2\n")
    assert not same_code_tokens(base, b'def f(x):\n    "doc"\n    return x + 1\n')  # a docstring is code
    assert not same_code_tokens(base, b"def f(x):\n    pass\nreturn x + 1\n")
    assert not same_code_tokens(b"def f(:\n  (", b"def f(:\n  (")  # cannot be tokenized: never equal


# --- item 7: info and replay agree on where the code is ----------------------------------------------


def test_info_and_replay_agree_on_ckptlabs_own_module(cli, user_run, tmp_path):
    """A run recorded with ckptlab's bundled example, elsewhere: its recorded path is gone, and
    replay runs the installed module; info says the same (it said 'file not found')."""
    run = tmp_path / "run"
    shutil.copytree(user_run[0], run)
    manifest = json.loads((run / "manifest.json").read_text())
    for role, qualname in (("build_fn", "build"), ("step_fn", "step")):
        manifest["functions"][role] = {
            "module": "ckptlab.examples.tiny_lm",
            "qualname": qualname,
            "file": "/gone/site-packages/ckptlab/examples/tiny_lm.py",
            "file_rel": "../../gone/tiny_lm.py",
            "sha256": "0" * 64,
        }
    (run / "manifest.json").write_text(json.dumps(manifest))
    from ckptlab.training.userfns import trusted_file

    replays, _ = trusted_file(manifest["functions"]["build_fn"], "build_fn", run)
    r = cli("info", "--run", run, "--no-verify", "--json")
    f = r.json()["functions"]["build_fn"]
    assert f["found"] and f["installed"] and f["runs"] == str(replays)
    text = cli("info", "--run", run, "--no-verify").out
    assert "file not found" not in text and "ckptlab's installed module" in text


# --- item 5: mistakes that point the way -------------------------------------------------------------


def test_a_healthy_step_points_to_the_anomalies_and_the_command(cli, user_run):
    run, _ = user_run
    r = cli("replay", "--run", run, "--step", NAN_STEP - 1, "--json", *QUICK)
    assert r.code == 0, r.err  # the replay ran and found the step as recorded (docs/replay.md)
    assert not r.json()["fault_recorded"] and "nothing to explain" in r.json()["verdict"]
    assert f"anomalies were recorded at steps {NAN_STEP} (nonfinite_loss" in r.err  # 5 and 6
    assert f"ckptlab replay --run {run} --step {NAN_STEP}" in r.err


def test_the_run_that_has_the_step_is_named_or_picked(cli, user_run, tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    shutil.copytree(user_run[0], runs / "nan")
    models.record_run(runs / "short", models.build_mlp, models.step_mlp, models.mlp_batches(3))  # the newest
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CKPTLAB_RUN", raising=False)
    r = cli("replay", "--step", NAN_STEP, "--json", *QUICK)  # ckptlab picks the run: the one that has it
    assert r.code == 0, r.err
    assert f"using run runs/nan instead, the run beside it that has step {NAN_STEP}" in r.err
    assert r.json()["root_step"] == NAN_STEP
    r = cli("replay", "--run", "runs/short", "--step", NAN_STEP, *QUICK)  # you chose it: named, not swapped
    assert r.code == 1 and "Traceback" not in r.err
    assert f"step {NAN_STEP} was not recorded (recorded: 0..2); runs/nan has step {NAN_STEP}" in r.err
    assert f"ckptlab replay --run runs/nan --step {NAN_STEP}" in r.err


def test_a_changed_shape_is_the_headline_of_a_diff(cli, tmp_path):
    from tests.io.checkpoints import toy_state, write

    a = toy_state()
    b = {k: v + 0.01 for k, v in a.items() if k != "lm_head.weight"}  # every tensor trained a little ...
    b["blocks.3.ln.bias"] = a["blocks.3.ln.bias"].clone()  # ... but one bias: frozen
    b["blocks.1.mlp.fc.weight"] = torch.randn(128, 16) * 0.1  # and a layer that grew: 64x16 -> 128x16
    pa, pb = write(tmp_path / "a", a, "pt"), write(tmp_path / "b", b, "safetensors")
    r = cli("diff", pa, pb)
    assert r.code == 0, r.err
    head = r.out.splitlines()[2]
    assert head.startswith("shape changed: blocks.1.mlp.fc.weight (module blocks.1.mlp.fc): from 64x16 in A to")
    assert "128x16 in B (float32): not compared" in head
    assert r.out.splitlines()[3].startswith("top flagged tensor: blocks.3.ln.bias: unchanged")
    doc = cli("diff", pa, pb, "--json").json()
    assert doc["verdict"]["kind"] == "shape_changed" and doc["verdict"]["parameter"] == "blocks.1.mlp.fc.weight"
    assert list(doc).index("verdict") < list(doc).index("ranked")  # the headline before the ranking
    assert doc["mismatched"][0]["shape_b"] == [128, 16] and doc["ranked"][0]["name"] == "blocks.3.ln.bias"


def test_a_pt_holding_a_list_says_so_in_one_line(cli, tmp_path):
    linear = torch.nn.Linear(3, 2)
    torch.save(linear.state_dict(), tmp_path / "sd.pt")
    torch.save(list(linear.parameters()), tmp_path / "params.pt")
    torch.save([0.5, 0.25], tmp_path / "losses.pt")
    r = cli("diff", tmp_path / "params.pt", tmp_path / "sd.pt")
    assert r.code == 1 and r.err.count("\n") == 1 and "Traceback" not in r.err
    assert (
        "params.pt holds a list of 2 tensors, not a state dict of named tensors: they are named by position (0..1)"
        in r.err
    )
    assert "sd.pt has 2 like 'weight'" in r.err and "nothing" not in r.err
    r = cli("diff", tmp_path / "sd.pt", tmp_path / "losses.pt")
    assert r.code == 1 and "losses.pt holds a list of 2 items (float) and no tensors, not a state dict" in r.err
    r = cli("diff", tmp_path / "params.pt", tmp_path / "params.pt")  # two lists: compared by position
    assert r.code == 0 and "identical" in r.out and "named by position" in r.err


def test_without_the_recorded_copy_a_changed_file_keeps_todays_rule(user_run, tmp_path):
    """An older run (or one whose sources/ copy is gone): nothing to compare the code with."""
    from ckptlab.errors import UntrustedCodeError
    from ckptlab.training.userfns import trusted_file

    run, train = user_run
    desc = dict(json.loads((run / "manifest.json").read_text())["functions"]["step_fn"])
    desc.pop("source_copy")
    try:
        train.write_text(USER_CODE + "# a comment\n")
        with pytest.raises(UntrustedCodeError, match="sha256 differs; the run holds no copy of the recorded file"):
            trusted_file(desc, "step_fn", run)
    finally:
        train.write_text(USER_CODE)
