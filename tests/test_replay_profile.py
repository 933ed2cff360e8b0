"""`ckptlab replay --step N --profile` (replayer/profile.py, timeline.py): a step slow in the
model is found slow again on replay, its time in the module and op of the planted slow path
(tests/slow_models.py); a step slowed by the loop's sleep outside step_fn is not, and is
called the environment's with the data wait the record shows; the Chrome trace is written
into the run without replacing a file."""

import contextlib
import io
import json

import pytest

import ckptlab
from ckptlab.cli import main
from ckptlab.run.layout import profile_trace
from tests import slow_models as sm

SLOW_LINE = next(  # the line of the planted slow op in tests/slow_models.py
    f"slow_models.py:{n}"
    for n, line in enumerate(open(sm.__file__, encoding="utf-8"), 1)
    if "x = torch.tanh(x @ self.slow)" in line
)


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "run"
    model, opt = sm.build()
    with ckptlab.Recorder(path, model, opt, step_fn=sm.step, build_fn=sm.build, ckpt_every=sm.CKPT_EVERY) as rec:
        for batch, ids in sm.loop_batches():
            rec.step(batch, sample_ids=ids)
    return path


@pytest.fixture(scope="module")
def slow_step(slow_run):
    """`ckptlab replay --step SLOW_STEP --profile --json`, its document."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(["replay", "--run", str(slow_run), "--step", str(sm.SLOW_STEP), "--profile", "--json"])
        except SystemExit as e:
            assert e.code in (0, None)
    return json.loads(out.getvalue())


def test_slow_path_comes_back_and_names_its_module_and_op(slow_step):
    p = slow_step["profile"]
    assert p["came_back"] is True
    assert "came back on replay" in p["verdict"] and "`mixer`" in p["verdict"]
    assert p["top_modules"][0]["module"] == "mixer"  # the model's own name, not a wrapper's
    assert p["top_ops"][0]["op"] in ("aten::mm", "aten::tanh")
    assert p["top_ops"][0]["source"].endswith(SLOW_LINE)
    assert p["top_ops"][0]["calls"] >= sm.SLOW_MATMULS
    assert p["neighbour_step"] == sm.SLOW_STEP - 1
    assert p["replayed_s"] >= 3 * p["neighbour_replayed_s"]
    rec = ckptlab.open_run(slow_step["profile"]["trace"].rsplit("/profiles/", 1)[0]).metrics()
    assert p["recorded_step_time"] == pytest.approx(float(rec.step_time[sm.SLOW_STEP]), abs=1e-6)
    assert p["ratio"] == pytest.approx(p["replayed_s"] / p["recorded_step_time"], rel=1e-3)
    assert slow_step["root_step"] is None  # a healthy step: no fault needed


def test_trace_is_written_into_the_run(slow_run, slow_step):
    trace = slow_run / "profiles" / f"step-{sm.SLOW_STEP}.json"
    assert slow_step["profile"]["trace"] == str(trace)
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "ckptlab.module: mixer" for e in events)
    # the next profile of the step takes a new name: none is ever overwritten
    assert profile_trace(slow_run, sm.SLOW_STEP).name == f"step-{sm.SLOW_STEP}-2.json"


def test_loop_sleep_is_the_environments(slow_run, tmp_path):
    trace = tmp_path / "sleepy.json"
    report = ckptlab.replay(slow_run, sm.SLEEPY_STEP, profile=trace, counterfactuals=False)
    p = report.profile
    assert p is not None and p.came_back is False
    assert "did not come back" in p.verdict and "environment" in p.verdict and "data_wait" in p.verdict
    assert p.record["data_wait"]["value"] >= sm.SLEEP
    assert p.recorded_excess_s >= sm.SLEEP / 2
    assert p.trace == str(trace) and json.loads(trace.read_text())["traceEvents"]


def test_existing_trace_file_is_refused_before_replaying(slow_run, tmp_path, cli):
    taken = tmp_path / "mine.json"
    taken.write_text("user data")
    r = cli("replay", "--run", slow_run, "--step", 3, "--profile", taken, "--json")
    assert r.code == 1 and "never overwrites" in r.err and len(r.err.strip().splitlines()) == 1
    assert taken.read_text() == "user data" and r.out == ""


def test_a_step_that_was_not_slow_has_nothing_to_come_back(slow_run, tmp_path):
    m = ckptlab.open_run(slow_run).metrics()
    quick = min(range(1, sm.STEPS), key=lambda s: m.wall_time[s])  # (the quickest: never slow, whatever the host did)
    p = ckptlab.replay(slow_run, quick, profile=tmp_path / "t.json", counterfactuals=False).profile
    assert p is not None and p.came_back is None
    assert p.verdict.startswith(f"Step {quick} was not slow when recorded")
    assert p.top_modules and p.replayed_s > 0


def test_a_run_on_several_processes_is_refused_up_front(slow_run, monkeypatch):
    run = ckptlab.open_run(slow_run)
    monkeypatch.setattr(type(run), "world_size", property(lambda self: 2))
    with pytest.raises(ckptlab.errors.ReplayError, match="--profile replays the step in this one process") as e:
        ckptlab.replay(run, 3, profile=True)
    assert "--rank R" in str(e.value)
    assert not (slow_run / "profiles" / "step-3.json").exists()
