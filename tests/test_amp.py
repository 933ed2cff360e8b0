"""Mixed precision end to end: float16 autocast with a GradScaler, bfloat16 autocast (CPU).

A step the GradScaler skips is recorded as skipped, never as a fault; replay restores the
scaler's state (its scale is compared with the record every step); an overflow that exists
only in float16 is found and named `precision`.
"""

import json
import math

import pytest

import ckptlab
from ckptlab.errors import RecordError, ReplayError
from ckptlab.training import state
from tests import amp_models as am

PLANTED = 25  # step whose row 3 is ~150x typical: fc1 overflows float16 (not float32)


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("amp") / "run"
    losses = am.record(run_dir, am.build_fp16, am.step_fp16, steps=30, plant={PLANTED: (3, 400.0)})
    assert len(losses) == PLANTED + 1 and math.isnan(losses[-1])  # NonFiniteLoss stopped it
    return run_dir


def test_scaler_skips_are_recorded_as_skipped_not_as_faults(fp16_run, cli):
    run = ckptlab.open_run(fp16_run)
    m = run.metrics()
    skipped = [int(s) for s in m.step[m.scaler_skipped]]
    # the scale starts too high: the first steps overflow and the scale backs off
    assert skipped[:3] == [0, 1, 2] and PLANTED in skipped
    assert m.scalars[0]["grad_scale"] == am.INIT_SCALE and m.scalars[3]["grad_scale"] == am.INIT_SCALE / 8
    assert not math.isfinite(m.grad_norm[0])  # the skipped step's overflowed gradients, as they were
    # the only recorded anomaly is the planted overflow's loss
    assert [(e["step"], e["kind"]) for e in run.events()] == [(PLANTED, "nonfinite_loss")]

    r = cli("report", "--run", fp16_run, "--json")
    code, out = r.code, r.out
    assert code == 0
    kinds = {f["kind"]: f for f in json.loads(out)["findings"]}
    assert "nonfinite_gradient" not in kinds
    assert kinds["scaler_skips"]["steps"][:3] == [0, 1, 2]

    r = cli("dirty", "--run", fp16_run, "--json", "--no-attribute")
    code, out = r.code, r.out
    assert code == 0
    flagged = {f["step"] for f in json.loads(out)["steps"]}
    assert flagged.isdisjoint(skipped[:-1])  # the skips before the fault are not flagged

    report = ckptlab.replay(fp16_run, 1)  # a skipped step replays as skipped: nothing to explain
    assert not report.fault_recorded and not report.reproduced and report.bit_exact
    assert "healthy" in report.verdict


def test_float16_only_overflow_is_named_precision(fp16_run, cli):
    r = cli("replay", "--run", fp16_run, "--step", PLANTED, "--json")
    code, out = r.code, r.out
    assert code == 0
    doc = json.loads(out)
    assert doc["root_step"] == PLANTED and doc["reproduced"] and doc["deterministic"] and doc["bit_exact"]
    assert doc["samples"][0] == {**doc["samples"][0], "row": 3, "sample_id": 100 * PLANTED + 3}
    origin = doc["origin"]
    assert (origin["kind"], origin["module"], origin["dtype"]) == ("precision", "fc1", "float16")
    assert origin["phase"] == "forward" and origin["op"] == "aten.addmm.default"
    assert "only in reduced precision" in doc["verdict"] and "2503" in doc["verdict"]
    assert any("float32" in c["question"] and c["fault"] is False for c in doc["counterfactuals"])
    # one level up: fc1 run in float32 (autocast off there) keeps the step finite
    assert origin["float32_module"] == "fc1" and "keep it in float32" in doc["verdict"]
    assert doc["start_checkpoint"] == 20  # the scaler's state came back from checkpoint 20
    assert doc["compiled"] is False and doc["trace_eager"] is False


def test_replay_reproduces_the_scaler_state(fp16_run, monkeypatch):
    assert ckptlab.replay(fp16_run, 24, trace=False).bit_exact
    real = state.load_train_state

    def forget_scaler(train_state, optimizer, scheduler=None, scaler=None):
        real(train_state, optimizer, scheduler, None)  # the scaler starts afresh at INIT_SCALE

    monkeypatch.setattr(state, "load_train_state", forget_scaler)
    report = ckptlab.replay(fp16_run, 24, trace=False)
    div = report.first_divergence
    assert not report.deterministic and div["step"] == 20
    assert (div["grad_scale"], div["recorded_grad_scale"]) == (am.INIT_SCALE, 2.0**16)


def test_a_scaler_run_whose_build_fn_returns_no_scaler_is_refused(run_dir):
    model, opt, _, scaler = am.build_fp16()
    with ckptlab.Recorder(
        run_dir, model, opt, step_fn=am.step_fp16, build_fn=am.build_fp16_without_scaler, scaler=scaler
    ) as rec:
        rec.step(am.xy(0), sample_ids=am.ids(0))
    with pytest.raises(ReplayError, match="recorded with a GradScaler, but build_fn returns none"):
        ckptlab.replay(run_dir, 0)


def test_a_step_fn_that_takes_a_scaler_needs_one(run_dir):
    model, opt, _, _ = am.build_fp16()
    with pytest.raises(RecordError, match="step_fn takes a `scaler` but no GradScaler was given"):
        ckptlab.Recorder(run_dir, model, opt, step_fn=am.step_fp16, build_fn=am.build_fp16)
    assert not run_dir.exists()  # refused before anything was written


def test_bfloat16_autocast_records_and_replays_bit_exact(run_dir, cli):
    losses = am.record(run_dir, am.build_bf16, am.step_bf16, steps=16, plant={13: (2, float("nan"))})
    assert len(losses) == 14
    r = cli("replay", "--run", run_dir, "--step", 13, "--json")
    code, out = r.code, r.out
    assert code == 0
    doc = json.loads(out)
    assert doc["root_step"] == 13 and doc["deterministic"] and doc["bit_exact"]
    assert doc["origin"]["kind"] == "data" and doc["samples"][0]["sample_id"] == 1302
