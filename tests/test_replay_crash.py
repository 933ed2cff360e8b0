"""A step whose step_fn raised: recorded as an `exception` event (what, where), replayed, and
explained (the same error again, where in the user's code, the rows that raise it alone), or
called a transient when the replay runs through."""

import pytest
import torch

import ckptlab
from ckptlab.analysis.health import diagnose
from ckptlab.errors import ReplayError
from ckptlab.training.crash import describe, is_step_error

from . import crash_mod, models


def record_until_crash(run_dir, build, step_fn, batches, **kw):
    model, opt, *rest = build()
    rec = ckptlab.Recorder(
        run_dir, model, opt, step_fn=step_fn, build_fn=build, scheduler=rest[0] if rest else None, **kw
    )
    with pytest.raises(Exception) as raised:
        with rec:
            for b, ids in batches:
                rec.step(b, ids)
    return raised.value


def test_a_shape_error_is_recorded_and_reproduced_where_it_was_raised(tmp_path):
    batches = list(models.mlp_batches(6))
    (x, y), ids = batches[5]
    batches[5] = ((x[:3], y[:3]), ids[:3])
    err = record_until_crash(tmp_path / "run", models.build_mlp, crash_mod.step_needs_four_rows, batches, ckpt_every=4)
    assert isinstance(err, RuntimeError)  # the user's own exception, unchanged
    run = ckptlab.open_run(tmp_path / "run")
    (event,) = run.events()
    assert event["step"] == 5 and event["kind"] == "exception"
    assert event["error"] == "RuntimeError: expected 4 rows, got 3"
    assert event["source"].startswith("crash_mod.py:") and event["call"] == "step_needs_four_rows"
    (finding,) = [f for f in diagnose(run, weights=False, plots=False).findings if f.kind == "crash"]
    assert finding.steps == [5] and "raised RuntimeError: expected 4 rows, got 3" in finding.title

    report = ckptlab.replay(tmp_path / "run", 5)
    assert report.reproduced and report.root_step == 5 and report.start_checkpoint == 4
    assert report.origin.kind == "exception" and report.origin.op == "RuntimeError"
    assert report.origin.source == event["source"]
    assert report.steps[-1].error == report.steps[-1].recorded_error == event["error"]
    assert report.bit_exact  # step 4 matched, and step 5 raised as recorded
    assert report.samples == []  # every row alone raises it too (1 row, not 4): no row to blame
    assert any("every row raises RuntimeError alone" in n for n in report.notes)
    assert "raised RuntimeError: expected 4 rows, got 3 at crash_mod.py:" in report.verdict
    assert "as when recorded" in report.verdict


def bad_token_batches():
    batches = list(models.lm_batches(6))
    ids = batches[5][0]["ids"].clone()
    ids[2, 7] = 999  # out of the 64-token vocabulary: the embedding raises
    batches[5] = ({"ids": ids}, batches[5][1])
    return batches


def test_an_out_of_range_token_is_blamed_on_its_row_and_sample_from_the_cli(tmp_path, cli):
    err = record_until_crash(
        tmp_path / "run",
        models.build_lm,
        models.step_lm,
        bad_token_batches(),
        ckpt_every=4,
        data_info={"vocab_size": 64},
    )
    assert isinstance(err, IndexError)
    r = cli("replay", "--run", tmp_path / "run", "--step", 5, "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["reproduced"] and doc["root_step"] == 5
    assert doc["origin"]["kind"] == "exception" and doc["origin"]["op"] == "IndexError"
    assert doc["origin"]["module"] == "wte" and doc["origin"]["phase"] == "forward"
    assert [(s["row"], s["sample_id"]) for s in doc["samples"]] == [(2, "doc-5-2")]
    assert "outside [0, 64)" in doc["samples"][0]["reason"] and "raises IndexError alone" in doc["samples"][0]["reason"]
    assert doc["counterfactuals"][0]["fault"] is False  # without row 2 the step runs
    assert "row 2 (sample doc-5-2)" in doc["verdict"] and "Without those rows the step runs" in doc["verdict"]
    assert doc["verdict"].count("Without those rows") == 1  # said once, the crash's way
    r = cli("replay", "--run", tmp_path / "run", "--step", 5)
    assert r.code == 0 and "origin     exception (forward) module wte op IndexError" in r.out


def test_a_crash_that_does_not_repeat_is_called_transient(tmp_path, monkeypatch):
    batches = list(models.mlp_batches(6))
    monkeypatch.setenv(crash_mod.FLAKY_ENV, repr(float(batches[5][0][0][0, 0])))
    err = record_until_crash(tmp_path / "run", models.build_mlp, crash_mod.step_flaky, batches, ckpt_every=4)
    assert isinstance(err, OSError)
    monkeypatch.delenv(crash_mod.FLAKY_ENV)
    report = ckptlab.replay(tmp_path / "run", 5)
    assert not report.reproduced and report.fault_recorded
    assert report.recorded_error == "OSError: transient: the NFS mount went away"
    assert report.verdict.startswith("The crash did not reproduce: step 5 raised OSError")
    assert "Suspect a transient failure" in report.verdict


def test_ckptlab_failures_and_interrupts_are_not_the_steps_own():
    assert not is_step_error(ReplayError("x"))
    assert not is_step_error(KeyboardInterrupt())
    try:
        torch.zeros(2) @ torch.zeros(3)
    except RuntimeError as e:  # raised by torch called from here (a test file: not ckptlab)
        assert is_step_error(e)
        assert describe(e)["source"].startswith("test_replay_crash.py:")
