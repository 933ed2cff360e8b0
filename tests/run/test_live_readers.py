"""Readers of a run that is still recording: retention never deletes what a replay holds, and
what it retires while a reader reads is left out of the answer, never called damage.

The long test trains in one process for 20 s (a checkpoint every 5 steps, retention
keeping 2) while three others call `info`, `report`/`dirty` and `replay` in a loop
(tests/live_worker.py)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ckptlab
from ckptlab.analysis.summary import summarize
from ckptlab.errors import RetiredError
from ckptlab.run import framelog, lock
from ckptlab.run.layout import leases_dir
from ckptlab.run.reader import open_run
from ckptlab.run.retention import apply_retention
from tests import live_worker as lw

ROOT = Path(__file__).resolve().parents[2]
READ_S = 20  # the readers' loops (~200 calls between them, ~30 of them replays): the run records throughout, pruning every few steps


def _python(*code_and_args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", *code_and_args], cwd=ROOT, **kw)


def _calls(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _json(out: str) -> dict:
    return json.loads(out)


@pytest.mark.slow
def test_readers_of_a_live_run_never_race_retention(tmp_path):
    run_dir, stop = tmp_path / "run", tmp_path / "stop"
    recorder = _python(
        "from tests import live_worker; live_worker.record()",
        str(run_dir),
        str(READ_S + 240),
        str(stop),
        stdout=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while not (run_dir / "checkpoints").is_dir() and time.monotonic() < deadline:
        time.sleep(0.1)
    readers = {
        kind: _python(
            "from tests import live_worker; live_worker.read()",
            str(run_dir),
            kind,
            str(READ_S),
            str(tmp_path / f"{kind}.jsonl"),
        )
        for kind in ("info", "report", "replay")
    }
    for p in readers.values():
        assert p.wait(timeout=READ_S + 120) == 0
    stop.touch()
    out, _ = recorder.communicate(timeout=120)
    assert recorder.returncode == 0
    steps = int(out.split()[-1])

    calls = {kind: _calls(tmp_path / f"{kind}.jsonl") for kind in readers}
    for kind, made in calls.items():
        assert len(made) >= 3, kind
        assert not [c for c in made if "internal" in c], [c["internal"] for c in made if "internal" in c][:3]
    # info, report and dirty on the healthy (recording) run: never an error, never "damaged"
    for c in calls["info"] + calls["report"]:
        assert c["code"] == 0, (c["args"], c.get("error"), c["out"][-500:])
    infos = [_json(c["out"]) for c in calls["info"]]
    assert [(i["damaged"], i["problems"]) for i in infos if i["damaged"] or i["problems"]] == []
    assert [(i["recording"], i["steps"]) for i in infos if i["recording"] is None or i["steps"]["incomplete"]] == []
    assert all(c["verified"] for i in infos for c in i["checkpoints"])
    assert all(lw.NAN_STEP - 5 in [c["step"] for c in i["checkpoints"]] for i in infos)  # the protected one
    # replay of the fault: the same answer every time, bit-exact
    faults = [c for c in calls["replay"] if c["args"][2] == str(lw.NAN_STEP)]
    assert faults and all(c["code"] == 0 for c in faults), [c.get("error") for c in faults]
    for c in faults:
        r = _json(c["out"])
        assert (r["root_step"], r["reproduced"], r["deterministic"]) == (lw.NAN_STEP, True, True)
        assert [s["sample_id"] for s in r["samples"]][:1] == [lw.sample_ids(lw.NAN_STEP)[lw.NAN_ROW]]
    # replay of a recent step (its checkpoint retired within a second): held by its lease
    recent = [c for c in calls["replay"] if c["args"][2] != str(lw.NAN_STEP)]
    done = [c for c in recent if c["code"] == 0]
    assert len(done) >= 2, [c.get("error") for c in recent]
    for c in recent:  # a step pruned between the test choosing it and the replay holding it: said plainly
        assert c["code"] == 0 or "pruned by retention" in c.get("error", ""), c.get("error")
    # retention pruned throughout, and the readers left no lease behind
    run = open_run(run_dir)
    assert steps > 40 * lw.CKPT_EVERY and len(run.checkpoints) <= lw.KEEP_LAST + 1
    assert not leases_dir(run_dir).exists()
    # a later step replays from the latest checkpoint before it, not from the protected one
    step = run.steps[-1]
    report = ckptlab.replay(run, step, trace=False, counterfactuals=False)
    assert report.start_checkpoint == max(c for c in run.checkpoints if c <= step) > lw.NAN_STEP
    assert report.deterministic


@pytest.fixture(scope="module")
def pruned_run(tmp_path_factory):
    """A finished run: 60 steps, a checkpoint every 5, retention keeping 2 (nothing deleted
    before the test's own retention calls: keep_last=0 while recording)."""
    run_dir = tmp_path_factory.mktemp("live") / "run"
    model, opt = lw.build()
    with ckptlab.Recorder(
        run_dir, model, opt, step_fn=lw.step_fn, build_fn=lw.build, ckpt_every=5, keep_last=0, on_anomaly=None
    ) as rec:
        for s in range(60):
            rec.step(lw.make_batch(s + 1000), sample_ids=lw.sample_ids(s))
    return run_dir


@pytest.fixture
def copy(pruned_run, tmp_path):
    return shutil.copytree(pruned_run, tmp_path / "run")


def test_retention_keeps_what_a_live_reader_leased_until_it_lets_go(copy):
    with lock.acquire(copy, "recorder"):  # as a recording Recorder holds it
        run = open_run(copy)
        assert run.hold([10], (10, 17))
        apply_retention(copy, 2, set(), None)
        assert open_run(copy).checkpoints == [10, 50, 55]
        assert run.batch(17)[1] == lw.sample_ids(17)
        assert [s for s in open_run(copy).steps if s < 50] == list(range(10, 20))  # its segments
        run.release()
        assert not leases_dir(copy).exists()
        apply_retention(copy, 2, set(), None)
        assert open_run(copy).checkpoints == [50, 55]


def test_a_dead_readers_lease_is_not_honoured(copy):
    code = (
        "import sys, os, signal; from ckptlab.run.reader import open_run; r = open_run(sys.argv[1]); "
        "assert r.hold([10], (10, 14)); print('held', flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    )
    with lock.acquire(copy, "recorder"):
        p = _python(code, str(copy), stdout=subprocess.PIPE, text=True)
        assert p.communicate(timeout=120)[0].strip() == "held" and p.returncode == -signal.SIGKILL
        assert len(list(leases_dir(copy).iterdir())) == 1  # left behind, its flock gone
        apply_retention(copy, 2, set(), None)
        assert open_run(copy).checkpoints == [50, 55]
        assert list(leases_dir(copy).iterdir()) == []


def test_no_lease_without_a_recorder_and_nothing_written(copy):
    before = sorted(p.name for p in copy.iterdir())
    assert open_run(copy).hold([10], (10, 14))  # nothing to hold it against
    assert sorted(p.name for p in copy.iterdir()) == before


def test_what_retention_retires_while_a_reader_reads_is_left_out_not_damage(copy, pruned_run, tmp_path, monkeypatch):
    run = open_run(copy)
    assert run.checkpoints[0] == 0 and 3 in run.steps  # listed (and indexed) before retention ran
    apply_retention(copy, 2, set(), None)
    summary = summarize(run)
    assert [c.step for c in summary.checkpoints] == [50, 55]
    assert summary.damaged == [] and summary.problems == []
    with pytest.raises(RetiredError, match=r"batch of step 3 was retired by retention while this command read it"):
        run.batch(3)
    # a segment listed, then retired before it was scanned: not there, and no damage
    other = shutil.copytree(pruned_run, tmp_path / "other")
    scan = framelog.scan

    def retired_first(path, **kw):
        if path.name == "s000-000000000.log":
            os.unlink(path)
        return scan(path, **kw)

    monkeypatch.setattr(framelog, "scan", retired_first)
    fresh = open_run(other)
    assert 3 not in fresh.steps and 5 in fresh.steps and fresh.damaged == [] and fresh.problems == []


def test_a_step_whose_batch_was_pruned_says_so_and_what_can_be_replayed(copy, cli):
    apply_retention(copy, 2, {10}, (10, 12))  # as around an anomaly at step 12
    r = cli("replay", "--run", copy, "--step", 30)
    assert r.code == 1
    assert (
        "the batch of step 30 was pruned by retention, so it cannot be replayed (batches kept: 10-14, 50-59)" in r.err
    )
    assert "Traceback" not in r.err


def _nan_weights_from(step: int):
    """Batches whose step `step` makes the weights NaN: every step after it is anomalous."""

    def batches():
        for s in range(60):
            x, y = lw.make_batch(s + 1000)
            if s == step:
                y[0] = float("inf")  # the loss is inf, its gradient NaN: the update poisons the weights
            yield (x, y), lw.sample_ids(s)

    return batches()


def test_a_step_late_in_a_long_episode_replays_from_the_latest_checkpoint_before_it(tmp_path, cli):
    run_dir = tmp_path / "run"
    model, opt = lw.build()
    with ckptlab.Recorder(
        run_dir,
        model,
        opt,
        step_fn=lw.plain_step,
        build_fn=lw.build,
        ckpt_every=5,
        keep_last=2,
        on_nonfinite="record",
        on_anomaly=None,
    ) as rec:
        for batch, ids in _nan_weights_from(12):
            rec.step(batch, sample_ids=ids)
    m = open_run(run_dir).metrics()
    assert math.isfinite(m.loss[11]) and not any(math.isfinite(x) for x in m.loss[13:])
    r = cli("replay", "--run", run_dir, "--step", 57, "--json", "--no-counterfactuals")
    assert r.code == 0, r.err
    # from 55, the latest before it, where the fault shows at once: so from 50 to look further back
    assert r.json()["start_checkpoint"] == 50
    assert "the anomaly episode that ends at step 57 began at step 12" in r.err
    assert f"ckptlab replay --run {run_dir} --step 12" in r.err


def test_the_frame_a_live_recorder_is_writing_is_not_a_torn_tail(copy):
    from ckptlab.run.manifest import read_manifest, write_manifest

    manifest = read_manifest(copy)
    del manifest["sessions"][-1]["closed"]  # as while its Recorder records
    write_manifest(copy, manifest)
    last = sorted((copy / "journal").glob("s000-*.log"))[-1]
    with last.open("ab") as f:
        f.write(b"\x01\x02\x03")  # a frame's first bytes, the rest not yet written
    with lock.acquire(copy, "recorder"):
        assert summarize(open_run(copy)).problems == []
    assert "3 bytes torn at the tail" in summarize(open_run(copy)).problems[0]  # idle: a crash's
