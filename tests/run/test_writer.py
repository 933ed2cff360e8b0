"""run/writer.py: what makes a new segment's name durable (the data's own fsync is not enough)."""

from ckptlab.run import writer as run_writer
from tests import models


def test_new_segments_and_folders_have_their_parent_folders_synced(run_dir, monkeypatch):
    synced = []
    real = run_writer.fsync_path
    monkeypatch.setattr(run_writer, "fsync_path", lambda path: (synced.append(path), real(path)))
    models.record_run(run_dir, models.build_mlp, models.step_mlp, models.mlp_batches(4), ckpt_every=2)
    # batches/ and journal/ were created in the run directory, batches/rank0 in batches/; every
    # new segment file (at steps 0 and 2) lives in a folder synced after it appeared.
    assert {run_dir, run_dir / "batches", run_dir / "batches" / "rank0", run_dir / "journal"} <= set(synced)
    assert synced.count(run_dir / "journal") == 2 and synced.count(run_dir / "batches" / "rank0") == 2
