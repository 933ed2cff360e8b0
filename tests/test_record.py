"""The Recorder (ckptlab/record/): what it writes, resumes and refuses (crash tests: tests/run/test_crash.py)."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

import ckptlab
from ckptlab.errors import RecordError
from ckptlab.run import framelog
from tests import models
from tests.run import strategies
from tests.run.bits import assert_same


def resume(run_dir, build=models.build_mlp, step=models.step_mlp, **kw) -> ckptlab.Recorder:
    built = build()
    sched = built[2] if len(built) > 2 else None
    return ckptlab.Recorder(
        run_dir, built[0], built[1], step_fn=step, build_fn=build, scheduler=sched, resume=True, **kw
    )


def step_ignoring_batch(model, optimizer, batch):
    """Trains on a fixed input whatever the batch holds: for recording arbitrary batches."""
    loss = model(torch.ones(2, 8)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=strategies.batches, ids=strategies.sample_ids)
def test_recorded_batches_read_back_bit_exact(batches, ids):
    """Through a real run: Recorder -> batch log -> open_run -> run.batch(n)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        model, opt = models.build_mlp()
        with ckptlab.Recorder(
            run_dir, model, opt, step_fn=step_ignoring_batch, build_fn=models.build_mlp, ckpt_every=2
        ) as rec:
            rec.step(batches, sample_ids=ids)
            rec.step([batches, "again"], sample_ids=ids)
        run = ckptlab.open_run(run_dir)
        for n, want in enumerate([batches, [batches, "again"]]):
            got, got_ids = run.batch(n)
            assert_same(got, want)
            assert got_ids == ids


def test_sample_ids_are_stored_as_plain_json(run_dir):
    model, opt = models.build_mlp()
    x = torch.zeros(3, 8)
    with ckptlab.Recorder(run_dir, model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp) as rec:
        rec.step((x, x[:, :1]), sample_ids=torch.tensor([3, 4, 5]))
        rec.step((x, x[:, :1]), sample_ids=np.array(["a", "b", "c"]))
        rec.step((x, x[:, :1]), sample_ids=(np.int64(7), 8, b"nine"))
    run = ckptlab.open_run(run_dir)
    assert [run.batch(n)[1] for n in range(3)] == [[3, 4, 5], ["a", "b", "c"], [7, 8, "nine"]]


def test_resume_continues_numbering_and_loses_nothing(run_dir):
    batches = list(models.mlp_batches(18))
    models.record_run(run_dir, models.build_mlp, models.step_mlp, batches[:12], ckpt_every=5, keep_last=0)
    before = ckptlab.open_run(run_dir)
    old_loss = before.metrics().loss.copy()

    with resume(run_dir, ckpt_every=5, keep_last=0) as rec:
        assert rec.next_step == 12 and rec.restored_step == 10
        tensors, _ = before.checkpoint(10).load_model()
        assert all(torch.equal(rec.model.state_dict()[k], v) for k, v in tensors.items())
        for batch, ids in batches[12:]:
            rec.step(batch, sample_ids=ids)

    run = ckptlab.open_run(run_dir)
    assert run.steps == list(range(18))
    assert run.metrics().step.tolist() == list(range(18))
    assert run.metrics().loss[:12].tolist() == old_loss.tolist()
    for n, (batch, ids) in enumerate(batches):
        got, got_ids = run.batch(n)
        assert_same(got, batch)
        assert got_ids == ids
    assert run.checkpoints == [0, 5, 10, 12, 15]
    assert [(s["session"], s["start_step"], s["restored_from"]) for s in run.manifest["sessions"]] == [
        (0, 0, None),
        (1, 12, 10),
    ]
    assert run.problems == []


def as_run_format_1(run_dir) -> None:
    """Rewrite a run as ckptlab wrote it before run format 2: LOG_V1 segments (no header
    CRC), manifest format_version 1."""
    for path in [*run_dir.glob("journal/*.log"), *run_dir.glob("batches/rank*/*.log")]:
        data, old = path.read_bytes(), framelog.LOG_V1
        frames = [
            framelog.pack_frame(
                ref.kind, ref.step, data[ref.offset : ref.offset + ref.length], flags=ref.flags, layout=old
            )
            for ref in framelog.scan(path, verify=True).frames
        ]
        path.write_bytes(old.file_magic + b"".join(frames))
    manifest = json.loads((run_dir / "manifest.json").read_text())
    (run_dir / "manifest.json").write_text(json.dumps({**manifest, "format_version": 1}))


def test_a_run_of_format_1_reads_and_resumes(run_dir):
    batches = list(models.mlp_batches(9))
    models.record_run(run_dir, models.build_mlp, models.step_mlp, batches[:6], ckpt_every=5, keep_last=0)
    want = ckptlab.open_run(run_dir).metrics().loss.tolist()
    as_run_format_1(run_dir)
    old = ckptlab.open_run(run_dir)
    assert old.manifest["format_version"] == 1 and old.metrics().loss.tolist() == want and old.problems == []

    with resume(run_dir, ckpt_every=5, keep_last=0) as rec:
        for batch, ids in batches[6:]:
            rec.step(batch, sample_ids=ids)
    run = ckptlab.open_run(run_dir)
    assert run.manifest["format_version"] == 2  # its new segments are LOG_V2
    heads = {p.read_bytes()[:16] for p in run_dir.glob("journal/*.log")}
    assert heads == {framelog.LOG_V1.file_magic, framelog.LOG_V2.file_magic}
    assert run.metrics().loss[:6].tolist() == want and run.steps == list(range(9))
    for n, (batch, ids) in enumerate(batches):
        assert_same(run.batch(n), (batch, ids))
    assert run.verify_logs() == [] and run.problems == []


def test_resume_after_a_checkpoint_past_the_last_step_leaves_no_gap(run_dir):
    """A best-validation checkpoint is taken after the last step returned: it is the state in
    which the next step starts, so the resumed session starts exactly there."""
    model, opt = models.build_mlp()
    batches = list(models.mlp_batches(8))
    with ckptlab.Recorder(
        run_dir, model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp, ckpt_every=100
    ) as rec:
        for batch, ids in batches[:5]:
            rec.step(batch, sample_ids=ids)
        rec.log_validation(val_loss=0.5)  # a new best: checkpoint at step 5
    commit = (run_dir / "checkpoints" / "step-000000005" / "COMMIT.json").read_text()

    with resume(run_dir, ckpt_every=100) as rec:
        assert (rec.next_step, rec.restored_step) == (5, 5)
        for batch, ids in batches[5:]:
            rec.step(batch, sample_ids=ids)
    run = ckptlab.open_run(run_dir)
    assert run.steps == list(range(8)) and run.checkpoints == [0, 5]
    assert (run_dir / "checkpoints" / "step-000000005" / "COMMIT.json").read_text() == commit  # not rewritten


def test_resume_keeps_protecting_earlier_sessions_checkpoints(run_dir):
    """Best-validation and last-healthy checkpoints survive retention in later sessions, and the
    first anomaly's batches stay replayable."""
    batches = list(models.mlp_batches(30))
    bad = (torch.full((4, 8), math.nan), torch.zeros(4, 1))
    val = {1: 1.0, 3: 0.5, 5: 0.9}  # best after step 3, i.e. at step 4

    def validate(i, model):
        return {"val_loss": val[i]} if i in val else None

    models.record_run(
        run_dir,
        models.build_mlp,
        models.step_mlp,
        [*batches[:7], (bad, [0] * 4), *batches[8:12]],
        ckpt_every=2,
        keep_last=2,
        on_nonfinite="record",
        validate=validate,
    )
    run = ckptlab.open_run(run_dir)
    assert run.events()[0]["step"] == 7
    assert {4, 6} <= set(run.checkpoints)

    with resume(run_dir, ckpt_every=2, keep_last=2, on_nonfinite="record") as rec:
        for batch, ids in batches[12:30]:
            rec.step(batch, sample_ids=ids)
    run = ckptlab.open_run(run_dir)
    assert 4 in run.checkpoints, "the best-validation checkpoint was deleted"
    assert 6 in run.checkpoints, "the last healthy checkpoint before the first anomaly was deleted"
    assert run.checkpoints[-2:] == [26, 28] and len(run.checkpoints) == 4
    batch, _ = run.batch(7)
    assert torch.isnan(batch[0]).all()  # the anomaly's batch is still there to replay
    assert {6, 7} <= set(run.steps)


def test_nonfinite_loss_is_recorded_then_raised(run_dir):
    model, opt = models.build_mlp()
    bad = (torch.full((4, 8), math.inf), torch.zeros(4, 1))
    with ckptlab.Recorder(run_dir, model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp) as rec:
        rec.step(next(models.mlp_batches(1))[0])
        with pytest.raises(ckptlab.NonFiniteLoss) as e:
            rec.step(bad)
    assert e.value.step == 1 and f"ckptlab replay --run {run_dir} --step 1" in str(e.value)
    run = ckptlab.open_run(run_dir)
    assert run.steps == [0, 1] and math.isnan(run.metrics().loss[1])
    assert run.events()[0]["kind"] == "nonfinite_loss" and run.events()[0]["step"] == 1


def test_on_nonfinite_record_keeps_going(run_dir):
    batches = [b for b, _ in models.mlp_batches(4)]
    batches[1] = (torch.full((4, 8), math.nan), torch.zeros(4, 1))
    losses = models.record_run(
        run_dir, models.build_mlp, models.step_mlp, [(b, None) for b in batches], on_nonfinite="record"
    )
    assert len(losses) == 4
    kinds = {(e["step"], e["kind"]) for e in ckptlab.open_run(run_dir).events()}
    assert (1, "nonfinite_loss") in kinds and (1, "nonfinite_grad") in kinds


def test_refuses_a_directory_that_is_not_a_run(run_dir):
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    model, opt = models.build_mlp()
    for resume_flag in (False, True):
        with pytest.raises(RecordError, match="exists and is not a ckptlab run; refusing to write into it"):
            ckptlab.Recorder(
                run_dir, model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp, resume=resume_flag
            )
    assert [p.name for p in run_dir.iterdir()] == ["notes.txt"]


def test_refuses_an_existing_run_without_resume(run_dir):
    models.record_run(run_dir, models.build_mlp, models.step_mlp, models.mlp_batches(3))
    manifest = (run_dir / "manifest.json").read_text()
    model, opt = models.build_mlp()
    with pytest.raises(RecordError, match="already holds a run.*pass resume=True"):
        ckptlab.Recorder(run_dir, model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp)
    assert (run_dir / "manifest.json").read_text() == manifest
    assert ckptlab.open_run(run_dir).steps == [0, 1, 2]


def test_a_first_session_killed_before_its_manifest_does_not_block_the_directory(run_dir):
    (run_dir / "sources").mkdir(parents=True)
    (run_dir / "sources" / "abc.py").write_text("def build(): ...\n")
    (run_dir / ".manifest.json.tmp-4242").write_text('{"form')
    models.record_run(run_dir, models.build_mlp, models.step_mlp, models.mlp_batches(2), resume=True)
    assert ckptlab.open_run(run_dir).steps == [0, 1]


@pytest.mark.parametrize("exists", [False, True])
def test_a_failed_start_leaves_the_directory_as_it_found_it(run_dir, monkeypatch, exists):
    """A Recorder that fails to start (here: the journal writer cannot start) takes back what
    it wrote, so the next attempt is not told the directory "already holds a run"."""
    import ckptlab.record.recorder as recorder

    if exists:
        run_dir.mkdir()
    model, opt = models.build_mlp()
    with pytest.raises(ckptlab.RecordError, match="optimizer is object, not a torch.optim.Optimizer"):
        ckptlab.Recorder(run_dir, model, object(), step_fn=models.step_mlp, build_fn=models.build_mlp)
    assert not run_dir.exists() if not exists else list(run_dir.iterdir()) == []

    def broken(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(recorder, "RunWriter", broken)
    with pytest.raises(OSError, match="No space left"):
        ckptlab.Recorder(run_dir, model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp)
    assert run_dir.exists() == exists and (not exists or list(run_dir.iterdir()) == [])
    monkeypatch.undo()
    models.record_run(run_dir, models.build_mlp, models.step_mlp, models.mlp_batches(2))  # then it records
    assert ckptlab.open_run(run_dir).steps == [0, 1]


def test_a_different_model_cannot_resume(run_dir):
    models.record_run(run_dir, models.build_mlp, models.step_mlp, models.mlp_batches(2))
    with pytest.raises(RecordError, match="the model differs from the recorded one"):
        resume(run_dir, build=models.build_lm, step=models.step_lm)


def test_manifest_describes_the_run(run_dir):
    models.record_run(
        run_dir, models.build_lm, models.step_lm, models.lm_batches(2), ckpt_every=7, data_info={"pad_id": 0}
    )
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["format"] == "ckptlab-run" and manifest["format_version"] == 2
    assert manifest["config"]["ckpt_every"] == 7 and manifest["config"]["has_scheduler"] is True
    assert manifest["functions"]["step_fn"]["qualname"] == "step_lm"
    assert (run_dir / manifest["functions"]["step_fn"]["source_copy"]).read_bytes() == Path(
        models.__file__
    ).read_bytes()
    assert manifest["data_info"] == {"pad_id": 0}
    assert [p["name"] for p in manifest["parameters"]][:2] == ["wte.weight", "wpe.weight"]
    assert "lm_head.weight" not in [p["name"] for p in manifest["parameters"]]  # tied: once


def test_options_as_a_config_or_as_keywords_and_unknown_ones_refused(run_dir):
    """One RecordConfig behind the Recorder's keywords; a typo fails before anything is written."""
    model, opt = models.build_mlp()[:2]
    config = ckptlab.RecordConfig(ckpt_every=7, health_every=2)
    with ckptlab.Recorder(
        run_dir, model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp, config=config, keep_last=4
    ) as rec:
        assert (rec.config.ckpt_every, rec.config.health_every, rec.config.keep_last) == (7, 2, 4)
    assert json.loads((run_dir / "manifest.json").read_text())["config"]["ckpt_every"] == 7
    with pytest.raises(RecordError, match="unknown Recorder option.*ckpt_evry"):
        ckptlab.Recorder(run_dir / "new", model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp, ckpt_evry=5)
    with pytest.raises(RecordError, match="ckpt_every and health_every must be >= 1"):
        ckptlab.RecordConfig(ckpt_every=0)
    with pytest.raises(RecordError, match="ckpt_snapshot must be 'live' or 'copy', not 'lve'"):
        ckptlab.RecordConfig(ckpt_snapshot="lve")
    # A misspelled 'warn' used to pass and fail at the first anomaly ("str is not callable").
    with pytest.raises(RecordError, match="on_anomaly must be a callback.*'warm'"):
        ckptlab.RecordConfig(on_anomaly="warm")
    assert not (run_dir / "new").exists()
