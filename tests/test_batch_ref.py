"""Batches stored by reference: the run keeps sample ids and a digest; replay rebuilds each
batch with the recorded batch_fn, proves it is the recorded one, and blames the sample."""

import pytest
import torch

import ckptlab
from ckptlab.run.records import batch_digest
from tests import ref_models as rm


def _batch_log_bytes(run_dir) -> int:
    return sum(p.stat().st_size for p in (run_dir / "batches").rglob("*") if p.is_file())


def test_batches_by_reference_are_small_and_replay_names_the_sample(run_dir, tmp_path, cli):
    rm.record(run_dir)
    whole = tmp_path / "whole"
    rm.record(whole, by_reference=False)
    assert _batch_log_bytes(run_dir) * 10 < _batch_log_bytes(whole)  # ids and a digest, not 18 KB images
    run = ckptlab.open_run(run_dir)
    batch, ids = run.batch(17)
    assert batch is None and ids == rm.ids(17)
    assert run.batch_record(17).ref["sha256"] == batch_digest(rm.batch_fn(rm.ids(17), 17))

    out = cli("replay", "--run", run_dir, "--step", 17, "--json", "--budget", 0)
    assert out.code == 0, out.err
    doc = out.json()
    assert doc["root_step"] == 17 and doc["reproduced"] and doc["deterministic"]
    assert [s["sample_id"] for s in doc["samples"]] == [rm.BAD_SAMPLE]
    assert "running batch_fn from" in out.err


def test_a_rebuilt_batch_that_differs_is_an_error_naming_the_step(run_dir, monkeypatch):
    rm.record(run_dir)
    monkeypatch.setitem(rm.AUGMENT, "flip", False)  # the augmentation changed since recording
    with pytest.raises(ckptlab.CkptlabError, match="batch_fn rebuilt a different batch for step 10"):
        ckptlab.replay(run_dir, 17)


def test_by_reference_needs_sample_ids(run_dir):
    model, opt = rm.build_convnet()
    with ckptlab.Recorder(
        run_dir,
        model,
        opt,
        step_fn=rm.step_convnet,
        build_fn=rm.build_convnet,
        batch_fn=rm.batch_fn,
        batch_ref_bytes=1024,
    ) as rec:
        with pytest.raises(ckptlab.RecordError, match="needs its sample_ids"):
            rec.step(rm.batch_fn(rm.ids(0), 0))


def test_small_batches_stay_whole_with_a_batch_fn(run_dir):
    model, opt = rm.build_convnet()
    with ckptlab.Recorder(
        run_dir, model, opt, step_fn=rm.step_convnet, build_fn=rm.build_convnet, batch_fn=rm.batch_fn
    ) as rec:  # the default threshold (1 MiB) is above this 18 KB batch
        rec.step(rm.batch_fn(rm.ids(0), 0), sample_ids=rm.ids(0))
    batch, _ = ckptlab.open_run(run_dir).batch(0)
    assert torch.equal(batch["image"], rm.batch_fn(rm.ids(0), 0)["image"])
