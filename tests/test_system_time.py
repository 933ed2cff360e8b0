"""Where each recorded step's time went (record/system.py): the data wait, the loop's whole
turn, samples and tokens, memory, garbage-collector pauses, recompilations, checkpoint time;
in `run.metrics()`, in the step records, and as `system/` points for the trackers; and what
`ckptlab report` makes of them (analysis/health/system.py): `input_bound` with the share of
the loop's time spent waiting, `slow_steps` with each planted step and its cause, and the HTML
page's chart of each step's time (rendered by headless Chromium)."""

import contextlib
import html
import io
import json
import re
import shutil
import subprocess
import time

import numpy as np
import pytest

import ckptlab
from ckptlab.cli import main
from ckptlab.trackers.points import health_points
from tests import system_models as sm


@pytest.fixture(scope="module")
def timed_run(tmp_path_factory):
    """The loop of tests/system_models.py, recorded; with the loop's own clocks: the time from
    the end of step 0 to the end of the last step, the time each step's batch took to load, and
    the time spent outside `rec.step` after step 0."""
    path = tmp_path_factory.mktemp("system") / "run"
    model, opt = sm.build()
    batches, loading, inside = sm.loop_batches(), [], 0.0
    with ckptlab.Recorder(path, model, opt, step_fn=sm.step, build_fn=sm.build, ckpt_every=20) as rec:
        for i in range(sm.STEPS):
            t = time.perf_counter()
            batch, ids = next(batches)
            loading.append(time.perf_counter() - t)
            t = time.perf_counter()
            rec.step(batch, sample_ids=ids)
            if i == 0:
                t0 = time.perf_counter()
            else:
                inside += time.perf_counter() - t
        elapsed = time.perf_counter() - t0
    return path, elapsed, loading, elapsed - inside


def test_data_wait_is_the_loaders_sleep(timed_run):
    m = ckptlab.open_run(timed_run[0]).metrics()
    assert np.isnan(m.data_wait[0])  # (nothing before a session's first step)
    for step, slept in sm.SLEEPY.items():
        assert slept <= timed_run[2][step] <= m.data_wait[step] < timed_run[2][step] + 0.05
        assert m.wall_time[step] >= m.data_wait[step] + m.step_time[step]
    others = [i for i in range(1, sm.STEPS) if i not in sm.SLEEPY]
    assert np.median(m.data_wait[others]) < 0.02
    # the loop's turns add up to its time (from the end of step 0 to the end of the last)
    assert m.wall_time[1:].sum() == pytest.approx(timed_run[1], rel=0.02)


def test_samples_tokens_and_rates(timed_run):
    m = ckptlab.open_run(timed_run[0]).metrics()
    assert m.samples[0] == sm.ROWS and m.samples[sm.RECOMPILE_STEP] == sm.RECOMPILE_ROWS
    assert m.tokens[0] == sm.ROWS * sm.SEQ and m.tokens[sm.LONG_STEP] == sm.ROWS * sm.LONG_SEQ
    assert m.tokens_per_s[5] == pytest.approx(m.tokens[5] / m.wall_time[5])


def test_slow_path_recompiles_and_checkpoints(timed_run):
    m = ckptlab.open_run(timed_run[0]).metrics()
    assert m.step_time[sm.LONG_STEP] >= sm.SLOW_PATH
    assert m.recompiles[sm.RECOMPILE_STEP] == 1
    assert m.recompiles[0] == 1  # the first compile
    assert m.recompiles.sum() == 2
    assert m.ckpt_time[20] > 0 and m.ckpt_time[0] > 0  # (ckpt_every=20)
    assert (m.ckpt_time[[i for i in range(sm.STEPS) if i not in (0, 20)]] == 0).all()


def test_memory(timed_run):
    m = ckptlab.open_run(timed_run[0]).metrics()
    assert (m.mem_peak > 10 * 2**20).all()  # the process's resident set, at least torch's
    assert m.mem_limit[0] > m.mem_peak.max() and np.isnan(m.mem_limit[1:]).all()


def test_system_points_for_the_trackers(timed_run):
    run = ckptlab.open_run(timed_run[0])
    m = run.metrics()
    points = health_points(m.scalars[sm.RECOMPILE_STEP], {}, [])
    assert points["system/recompiles"] == 1.0 and points["system/gc_time"] >= 0.0
    assert points["system/data_wait"] == m.data_wait[sm.RECOMPILE_STEP]
    assert points["system/tokens_per_s"] == pytest.approx(m.tokens_per_s[sm.RECOMPILE_STEP])
    assert points["system/samples_per_s"] == pytest.approx(m.samples_per_s[sm.RECOMPILE_STEP])
    assert "system/data_wait" not in health_points(m.scalars[0], {}, [])


def test_gc_pauses_are_counted(tmp_path):
    """A collection between two steps is counted in the next step's gc_time; a checkpoint taken
    between two steps in its ckpt_time, not its data wait."""
    import gc

    model, opt = sm.build()
    with ckptlab.Recorder(tmp_path / "run", model, opt, step_fn=sm.step, build_fn=sm.build) as rec:
        batches = sm.loop_batches(3)
        rec.step(*next(batches))
        junk = [[] for _ in range(200_000)]
        for x in junk:
            x.append(x)  # cycles: a full collection has work to do
        del junk
        gc.collect()
        rec.step(*next(batches))
        rec.checkpoint()  # between two steps: ckptlab's time, in the next step's ckpt_time
        time.sleep(0.05)
        rec.step(*next(batches))
    m = ckptlab.open_run(tmp_path / "run").metrics()
    assert m.gc_time[1] > 0.001
    assert m.ckpt_time[1] == 0 and m.ckpt_time[2] > 0
    assert m.data_wait[2] >= 0.05  # (the sleep)


# --- what `ckptlab report` says of it ----------------------------------------------------------

PLANTED = {step: "data_wait" for step in sm.SLEEPY} | {sm.LONG_STEP: "long_batch", sm.RECOMPILE_STEP: "recompile"}


@pytest.fixture(scope="module")
def report_json(timed_run):
    """`ckptlab report --json` of the loop, its findings by kind."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(["report", "--run", str(timed_run[0]), "--json", "--no-weights"])
        except SystemExit as e:
            assert e.code in (0, None)
    return {f["kind"]: f for f in json.loads(out.getvalue())["findings"]}


def test_report_names_input_bound_with_the_share_the_loader_slept(timed_run, report_json):
    f = report_json["input_bound"]
    # the loop's own clocks: its time outside rec.step (the loader's sleeps, most of it) over its
    # time from step 0's end to the last step's
    _, elapsed, loading, outside = timed_run
    assert outside >= sum(loading[1:]) >= sum(sm.SLEEPY.values())
    assert f["evidence"]["share"] == pytest.approx(outside / elapsed, abs=0.01)
    assert f["severity"] == "warning" and f"{f['evidence']['share']:.0%}" in f["title"]
    assert set(sm.SLEEPY) <= set(f["steps"])
    assert any("num_workers" in r for r in f["remedies"])


def test_report_names_each_slow_step_with_its_cause(timed_run, report_json):
    f = report_json["slow_steps"]
    found = {s["step"]: s for s in f["evidence"]["steps"]}
    assert {step: found[step]["cause"] for step in PLANTED if step in found} == PLANTED
    # A shared host may make a usual step slow too: its cause is then only what the loop's own
    # clock shows (a loader that took long) or none (compute), never a recompile or a long batch.
    for step, s in found.items():
        if step not in PLANTED:
            assert s["cause"] in ("compute", "data_wait", "gc") or (s["cause"], step) == ("checkpoint", 20), s
            assert s["cause"] != "data_wait" or timed_run[2][step] >= 0.5 * s["data_wait"], s
    assert found[sm.RECOMPILE_STEP]["batch_shape"] == f"ids ({sm.RECOMPILE_ROWS}, {sm.SEQ}), y ({sm.RECOMPILE_ROWS},)"
    assert "torch.compile compiled 1 graph" in found[sm.RECOMPILE_STEP]["detail"]
    assert found[sm.LONG_STEP]["tokens"] == sm.ROWS * sm.LONG_SEQ and "16x the usual" in found[sm.LONG_STEP]["detail"]
    assert sorted(f["steps"]) == sorted(found)
    assert any("mark_dynamic" in r for r in f["remedies"]) and any("bucket" in r for r in f["remedies"])


# --- the HTML page's time chart ----------------------------------------------------------------


@pytest.mark.skipif(
    shutil.which("chromium") is None, reason="needs Debian's chromium package (apt-get install chromium)"
)
def test_html_shows_where_each_steps_time_went_in_headless_chromium(timed_run, tmp_path):
    page = tmp_path / "report.html"
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(["report", "--run", str(timed_run[0]), "--no-weights", "--html", str(page)])
        except SystemExit as e:
            assert e.code in (0, None)
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
    cmd += ["--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0"]
    done = subprocess.run([*cmd, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    dom = html.unescape(done.stdout)
    assert "where each step's time went" in dom
    for part in ("data wait", "step_fn", "checkpoint", "other"):
        assert f">{part}</text>" in dom  # the legend
    # one bar a step, its parts in its tooltip; the slow steps marked with their causes
    bars = re.findall(r"<title>step (\d+): data wait ([^ ]+) s, step_fn ([^ ]+) s", dom)
    assert [int(s) for s, _, _ in bars] == list(range(sm.STEPS))
    assert float(bars[sm.LONG_STEP][2]) >= sm.SLOW_PATH and float(bars[6][1]) >= sm.SLEEPY[6]
    assert f"slow step: recompile at step {sm.RECOMPILE_STEP}" in dom
    assert f"slow step: long batch at step {sm.LONG_STEP}" in dom
    problems = [line for line in done.stderr.splitlines() if re.search(r"CONSOLE|Uncaught|net::ERR|Refused to", line)]
    assert problems == [], problems


def test_tensorboard_export_has_the_system_points(timed_run, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(["export", "--run", str(timed_run[0]), "--tensorboard", str(tmp_path / "tb"), "--no-grads"])
        except SystemExit as e:
            assert e.code in (0, None)
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    m = ckptlab.open_run(timed_run[0]).metrics()
    waits = {e.step: e.value for e in acc.Scalars("system/data_wait")}
    assert waits[6] == pytest.approx(m.data_wait[6], rel=1e-6) and 0 not in waits
    recompiles = {e.step: e.value for e in acc.Scalars("system/recompiles")}
    assert recompiles[sm.RECOMPILE_STEP] == 1 and recompiles[5] == 0
    assert {"system/tokens_per_s", "system/samples_per_s", "system/mem_peak", "system/wall_time"} <= set(
        acc.Tags()["scalars"]
    )


def test_a_checkpoint_between_steps_is_ckptlabs_time_not_the_loops():
    from ckptlab.record.system import SystemMeter

    meter = SystemMeter(on_cuda=False)
    try:
        for wait in (0.0, 0.02):
            time.sleep(wait)
            meter.begin()
            meter.checkpointed(time.perf_counter(), taken=False, wait=0.0)
            fields = meter.end(0.0)
            meter.returned()
            meter.aside(time.sleep, 0.1)  # (a checkpoint that takes 0.1 s, between the steps)
    finally:
        meter.close()
    assert 0.02 <= fields["data_wait"] < 0.1 and fields["ckpt_time"] >= 0.1
    assert fields["wall_time"] >= fields["data_wait"] + fields["ckpt_time"]
