"""Replay is bit-exact, survives resumes, and fails clearly on bad input."""

import importlib
import shutil
import sys
import textwrap

import pytest

import ckptlab
from tests import fault_models as fm
from tests import models


def test_every_replayed_loss_equals_the_record(run_dir):
    losses = models.record_run(run_dir, models.build_lm, models.step_lm, models.lm_batches(25), ckpt_every=10)
    report = ckptlab.replay(run_dir, 24)
    assert report.start_checkpoint == 20 and not report.fault_recorded and report.root_step is None
    assert [c.step for c in report.steps] == [20, 21, 22, 23, 24]
    assert [c.loss for c in report.steps] == losses[20:25]  # == on floats: bit for bit
    assert all(c.match for c in report.steps) and report.deterministic
    assert "healthy" in report.verdict


def test_replay_across_a_resumed_session(run_dir):
    batches = list(models.mlp_batches(30))
    models.record_run(run_dir, models.build_mlp, models.step_mlp, batches[:15], ckpt_every=10)
    model, opt = models.build_mlp()
    with ckptlab.Recorder(
        run_dir, model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp, ckpt_every=10, resume=True
    ) as rec:
        assert rec.next_step == 15 and rec.restored_step == 10
        resumed = [rec.step(b, sample_ids=i).item() for b, i in batches[15:30]]
    run = ckptlab.open_run(run_dir)
    assert 15 in run.checkpoints  # a resumed session starts with a checkpoint
    report = ckptlab.replay(run, 18)
    assert report.start_checkpoint == 15  # never across the session boundary
    assert [c.loss for c in report.steps] == resumed[:4]
    assert report.deterministic


def test_unknown_step_is_a_clear_error(run_dir):
    models.record_run(run_dir, models.build_mlp, models.step_mlp, models.mlp_batches(12), ckpt_every=5)
    with pytest.raises(ckptlab.ReplayError, match="step 99 was not recorded"):
        ckptlab.replay(run_dir, 99)


def test_pruned_step_is_a_clear_error(run_dir):
    models.record_run(run_dir, models.build_mlp, models.step_mlp, models.mlp_batches(40), ckpt_every=5, keep_last=2)
    with pytest.raises(ckptlab.ReplayError, match="before the first retained checkpoint|pruned"):
        ckptlab.replay(run_dir, 3)


def _user_module(tmp_path, name, hidden=16):
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(f"""
        import torch
        import torch.nn.functional as F

        def build():
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(8, {hidden}), torch.nn.ReLU(), torch.nn.Linear({hidden}, 1))
            return m, torch.optim.SGD(m.parameters(), lr=0.01)

        def step(model, opt, batch):
            loss = F.mse_loss(model(batch[0]), batch[1])
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
    """)
    )
    # (a rewrite of the same size within the same second would load the first one's bytecode)
    shutil.rmtree(tmp_path / "__pycache__", ignore_errors=True)
    sys.path.insert(0, str(tmp_path))
    sys.modules.pop(name, None)
    return importlib.import_module(name)


def test_missing_build_module_says_what_to_do(tmp_path, run_dir):
    mod = _user_module(tmp_path, "ckl_user_gone")
    models.record_run(run_dir, mod.build, mod.step, models.mlp_batches(6), ckpt_every=5)
    (tmp_path / "ckl_user_gone.py").unlink()
    sys.modules.pop("ckl_user_gone")
    with pytest.raises(ckptlab.UntrustedCodeError, match="ckl_user_gone.py, is not on this machine.*--trust-run-code"):
        ckptlab.replay(run_dir, 5)
    with pytest.raises(ckptlab.ReplayError, match="cannot import ckl_user_gone"):
        ckptlab.replay(run_dir, 5, trust_code=True)  # trusted, but nothing to import it from


def test_model_that_no_longer_matches_the_checkpoint(tmp_path, run_dir):
    mod = _user_module(tmp_path, "ckl_user_changed")
    models.record_run(run_dir, mod.build, mod.step, models.mlp_batches(6), ckpt_every=5)
    _user_module(tmp_path, "ckl_user_changed", hidden=32)  # the code moved on
    with pytest.raises(ckptlab.ReplayError, match="does not fit the model.*shape"):
        ckptlab.replay(run_dir, 5, trust_code=True)


def test_changed_source_is_reported(tmp_path, run_dir):
    mod = _user_module(tmp_path, "ckl_user_edited")
    models.record_run(run_dir, mod.build, mod.step, models.mlp_batches(6), ckpt_every=5)
    path = tmp_path / "ckl_user_edited.py"
    path.write_text(path.read_text() + "\nEDITED = True  # an edit of code (a comment alone is not one)\n")
    with pytest.raises(ckptlab.UntrustedCodeError, match="changed since recording"):
        ckptlab.replay(run_dir, 5)  # edited code is not the code that was recorded: opt in to run it
    report = ckptlab.replay(run_dir, 5, trust_code=True)
    assert any("source changed" in n for n in report.notes)
    assert report.deterministic  # the edit was harmless


def test_cli_json_and_errors(run_dir, cli):
    exp = fm.record_input_nan(run_dir)
    ok = cli("replay", "--run", run_dir, "--step", exp.symptom, "--json")
    assert ok.code == 0, ok.err
    doc = ok.json()
    assert doc["root_step"] == 27 and doc["samples"][0]["sample_id"] == 2704
    text = cli("replay", "--run", run_dir, "--step", exp.symptom)
    assert text.code == 0 and text.out.startswith("Step 27: the batch itself carries non-finite values")
    bad = cli("replay", "--run", run_dir, "--step", 500)
    assert bad.code == 1 and bad.out == ""
    assert bad.err.strip().count("\n") == 0 and "step 500 was not recorded" in bad.err
    usage = cli("replay", "--run", run_dir)
    assert usage.code == 2


def test_compiled_model_and_printing_build_fn(run_dir, cli):
    models.record_run(run_dir, models.build_compiled_noisy, models.step_mlp, models.mlp_batches(12), ckpt_every=5)
    run = ckptlab.open_run(run_dir)
    assert run.param_names[0] == "fc1.weight"  # no _orig_mod. prefix in the run
    tensors, _ = run.checkpoint(10).load_model()
    assert "fc1.weight" in tensors
    out = cli("replay", "--run", run_dir, "--step", 11, "--json")
    assert out.code == 0, out.err
    doc = out.json()  # the build_fn's print went to stderr, not into the JSON
    assert doc["deterministic"] is True
    assert "chatty build_fn" in out.err


def test_verdict_of_an_op_fault_with_no_row_to_blame():
    """A numeric origin found by the trace, but no batch row blamed (e.g. every row alone is
    healthy): the verdict names the op, and does not reach for a blamed row that is not there."""
    from ckptlab.replayer.findings import Origin, ReplayReport
    from ckptlab.replayer.verdict import verdict

    report = ReplayReport(
        run="r",
        requested_step=9,
        root_step=9,
        start_checkpoint=0,
        fault_recorded=True,
        reproduced=True,
        deterministic=True,
        first_divergence=None,
        origin=Origin(
            "numeric",
            "forward",
            "blocks.0.attn",
            "aten._softmax.default",
            None,
            "m.py:3",
            produced="NaN",
            inputs_finite=True,
        ),
        samples=[],
        parameters=[],
        chain=[],
        counterfactuals=[],
        steps=[],
        verdict="",
    )
    assert (
        verdict(report) == "Step 9: aten._softmax.default in `blocks.0.attn` (m.py:3) produced NaN from finite inputs."
    )


def test_a_damaged_start_checkpoint_is_named(run_dir):
    """A truncated checkpoint is passed over, and replay says so; one whose bytes were flipped
    in place is refused with the --from-step that works."""
    models.record_run(run_dir, models.build_mlp, models.step_mlp, models.mlp_batches(25), ckpt_every=10)
    model_file = run_dir / "checkpoints" / "step-000000020" / "model.safetensors"
    data = bytearray(model_file.read_bytes())
    data[-1] ^= 0xFF
    model_file.write_bytes(bytes(data))
    with pytest.raises(ckptlab.IntegrityError, match="checkpoint 20 is damaged.*--from-step 10"):
        ckptlab.replay(run_dir, 24)
    model_file.write_bytes(bytes(data[:-100]))
    report = ckptlab.replay(run_dir, 24)
    assert report.start_checkpoint == 10 and report.deterministic
    assert any("checkpoint 20 is damaged" in n for n in report.notes)
