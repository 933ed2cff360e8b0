"""Live checkpoints (ckpt_snapshot="live", the default on a CPU model): a checkpoint is written
from the parameters and optimizer state themselves, in the background, and the optimizer's next
step waits until their bytes are written. The files must hold exactly the state of their step
(the same bytes as a copied snapshot), however slow the write; a tensor changed in place
before it is written is caught and the checkpoint taken again by copy."""

import time

import pytest
import torch
from safetensors.torch import load_file

import ckptlab
import ckptlab.run.checkpoint as checkpoint_mod
from ckptlab.run.layout import MODEL_FILE, STATE_FILE
from ckptlab.training import state as state_mod

from . import models


@pytest.fixture
def small_tensors_live(monkeypatch):
    """The test models are tiny: let every tensor be written live."""
    monkeypatch.setattr(state_mod, "LIVE_MIN_BYTES", 0)


@pytest.fixture
def slow_writes(monkeypatch):
    """Each checkpoint file is written 0.3 s late: long after the step's optimizer wants to
    change the tensors it is written from."""
    real = checkpoint_mod.write_safetensors

    def slow(path, tensors, metadata):
        time.sleep(0.2)
        return real(path, tensors, metadata)

    monkeypatch.setattr(checkpoint_mod, "write_safetensors", slow)


def record(run_dir, batches, step_fn=models.step_mlp, **kw):
    model, opt = models.build_mlp()
    with ckptlab.Recorder(run_dir, model, opt, step_fn=step_fn, build_fn=models.build_mlp, **kw) as rec:
        for b, ids in batches:
            rec.step(b, ids)
    return ckptlab.open_run(run_dir)


def checkpoint_bytes(run, step):
    folder = run.checkpoint(step).path
    return load_file(folder / MODEL_FILE), load_file(folder / STATE_FILE)


def assert_same_tensors(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_live_snapshot_shares_parameters_and_optimizer_state_and_copies_the_rest(small_tensors_live):
    model, opt = models.build_mlp()
    for b, _ in models.mlp_batches(2):
        models.step_mlp(model, opt, b)
    model.register_buffer("seen", torch.zeros(3))
    model.fc1.weight.grad = torch.ones_like(model.fc1.weight)  # left over between steps
    snap = state_mod.snapshot(2, model, opt, live=True)
    live = {t.data_ptr() for t, _ in snap.live}
    assert snap.model["fc1.weight"].data_ptr() == model.fc1.weight.data_ptr() in live
    assert snap.model["seen"].data_ptr() != model.seen.data_ptr()  # buffers: copied
    exp_avg = opt.state[model.fc1.weight]["exp_avg"]
    assert exp_avg.data_ptr() in {t.data_ptr() for t in snap.state_tensors.values()} and exp_avg.data_ptr() in live
    grads = [t for k, t in snap.state_tensors.items() if k.startswith("state/grads")]
    assert grads and all(g.data_ptr() != model.fc1.weight.grad.data_ptr() for g in grads)  # grads: copied
    assert not snap.released.is_set()
    assert snap.release() and snap.released.is_set()

    flat = torch.zeros(200)  # parameters that are views into one flat buffer: copied
    model.fc1.weight.data = flat[:128].view(16, 8)
    model.fc2.weight.data = flat[128:144].view(1, 16)
    views = state_mod.snapshot(2, model, opt, live=True)
    assert views.model["fc1.weight"].data_ptr() != flat.data_ptr()
    views.release()

    copied = state_mod.snapshot(2, model, opt)  # the default: copies, nothing to wait for
    assert not copied.live and copied.released.is_set()
    assert copied.model["fc1.weight"].data_ptr() != model.fc1.weight.data_ptr()


def test_a_slow_live_checkpoint_holds_the_state_of_its_step(tmp_path, small_tensors_live, slow_writes):
    batches = list(models.mlp_batches(6))
    copy = record(tmp_path / "copy", batches, ckpt_every=2, ckpt_snapshot="copy", health_every=1)
    live = record(tmp_path / "live", batches, ckpt_every=2, health_every=1)
    assert live.manifest["config"]["ckpt_snapshot"] == "live"
    assert copy.checkpoints == live.checkpoints == [0, 2, 4]
    for step in (2, 4):  # same bytes: nothing changed them before they were written
        for a, b in zip(checkpoint_bytes(copy, step), checkpoint_bytes(live, step)):
            assert_same_tensors(a, b)
    # The optimizer's step waited for the write, and the step says so.
    assert live.metrics().scalars[2]["ckpt_wait"] > 0.1
    assert (live.metrics().loss == copy.metrics().loss).all()


def test_training_thread_runs_forward_and_backward_while_the_checkpoint_is_written(
    tmp_path, small_tensors_live, monkeypatch
):
    """The checkpoint's write overlaps the step: the optimizer waits, the forward pass does not."""
    written, seen = [], []
    real = checkpoint_mod.write_safetensors

    def slow(path, tensors, metadata):
        time.sleep(0.2)
        record = real(path, tensors, metadata)
        written.append(path.name)
        return record

    monkeypatch.setattr(checkpoint_mod, "write_safetensors", slow)
    model, opt = models.build_mlp()
    model.fc2.register_forward_hook(lambda *_: seen.append(len(written)))
    with ckptlab.Recorder(tmp_path / "run", model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp) as rec:
        b, ids = next(models.mlp_batches(1))
        t0 = time.perf_counter()
        rec.step(b, ids)  # step 0 checkpoints first
        took = time.perf_counter() - t0
    assert seen == [0]  # the forward pass ran before either file was written
    assert took >= 0.4  # the optimizer's step waited for both


def nudge_step(model, optimizer, batch):
    """A step that changes a weight in place before its forward pass (outside optimizer.step)."""
    with torch.no_grad():
        model.fc1.weight.mul_(0.999)
    return models.step_mlp(model, optimizer, batch)


def test_a_tensor_changed_while_written_is_caught_and_the_checkpoint_taken_again(
    tmp_path, small_tensors_live, slow_writes
):
    batches = list(models.mlp_batches(7))
    with pytest.warns(UserWarning, match=r"checkpoint of step 0 was not committed.*ckpt_snapshot='copy'"):
        run = record(tmp_path / "run", batches, step_fn=nudge_step, ckpt_every=2, keep_last=10)
    # Step 0's files were still being written when the step nudged the weight: not committed,
    # taken again (by copy) when step 1 starts; every later checkpoint is a copy.
    assert run.checkpoints == [1, 2, 4, 6]
    assert run.checkpoint(1).commit["reason"] == "retake"
    assert not list((run.path / "checkpoints").glob(".tmp-*"))  # the torn one left nothing behind
    reference = record(tmp_path / "copy", batches, step_fn=nudge_step, ckpt_every=2, ckpt_snapshot="copy")
    for step in (2, 4, 6):
        for a, b in zip(checkpoint_bytes(reference, step), checkpoint_bytes(run, step)):
            assert_same_tensors(a, b)
    # Replay from the retaken checkpoint reproduces the recorded steps bit for bit.
    assert ckptlab.replay(run.path, step=1, from_step=1, trace=False).bit_exact


def test_bad_option_is_refused(tmp_path):
    model, opt = models.build_mlp()
    with pytest.raises(ckptlab.RecordError, match="ckpt_snapshot must be 'live' or 'copy'"):
        ckptlab.Recorder(
            tmp_path / "run", model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp, ckpt_snapshot="lazy"
        )
