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
from ckptlab.record import snapshots
from ckptlab.run.checkpoint import CapturedState
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

    def slow(path, tensors, metadata, **kw):
        time.sleep(0.2)
        return real(path, tensors, metadata, **kw)

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

    def slow(path, tensors, metadata, **kw):
        time.sleep(0.2)
        record = real(path, tensors, metadata, **kw)
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


def test_the_optimizer_follows_a_slow_writer_tensor_by_tensor(tmp_path, small_tensors_live, monkeypatch):
    """AdamW on the CPU updates one parameter at a time: each update waits for the bytes of
    the tensors it touches alone, so the optimizer's step starts while the checkpoint is still
    being written, and the files still hold the state of their step."""
    seen = []  # (checkpoint step, fc1.weight's version) as the writer takes each tensor's bytes
    real = CapturedState.copied

    def slow_copied(self, ptr):
        time.sleep(0.03)
        seen.append((self.step, weight._version))
        real(self, ptr)

    monkeypatch.setattr(CapturedState, "copied", slow_copied)
    batches = list(models.mlp_batches(4))
    copy = record(tmp_path / "copy", batches, ckpt_every=2, ckpt_snapshot="copy")
    model, opt = models.build_mlp()
    weight = model.fc1.weight  # the optimizer's first parameter: in the first file
    with ckptlab.Recorder(
        tmp_path / "live", model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp, ckpt_every=2
    ) as rec:
        for b, ids in batches:
            rec.step(b, ids)
    live = ckptlab.open_run(tmp_path / "live")
    at_2 = [version for step, version in seen if step == 2]
    assert at_2[0] < at_2[-1]  # the optimizer had updated fc1.weight before the writer was done
    assert live.metrics().scalars[2]["ckpt_wait"] > 0.01  # and it waited for the rest
    assert copy.checkpoints == live.checkpoints == [0, 2]
    for a, b in zip(checkpoint_bytes(copy, 2), checkpoint_bytes(live, 2)):
        assert_same_tensors(a, b)
    live.checkpoint(2).verify()  # hashed when read back
    assert (live.metrics().loss == copy.metrics().loss).all()


class WithTeacher(torch.nn.Module):
    """A student trained by SGD and an EMA teacher of it, outside the optimizer (DINO, MoCo)."""

    def __init__(self):
        super().__init__()
        self.student = torch.nn.Linear(8, 1)
        self.teacher = torch.nn.Linear(8, 1).requires_grad_(False)

    def forward(self, x):
        return self.student(x)


def build_teacher():
    torch.manual_seed(0)
    model = WithTeacher()
    return model, torch.optim.SGD(model.student.parameters(), lr=0.1)


def step_teacher(model, optimizer, batch):
    loss = models.step_mlp(model, optimizer, batch)
    with torch.no_grad():  # after the optimizer's step: tensors it never touched
        for t, s in zip(model.teacher.parameters(), model.student.parameters()):
            t.mul_(0.9).add_(s, alpha=0.1)
    return loss


def test_what_the_step_changes_after_the_optimizers_step_waits_for_the_write(tmp_path, small_tensors_live, monkeypatch):
    """The mode is off once the optimizer's step is over, and the rest of the step may change
    live tensors the optimizer did not touch (the teacher, written last): the whole write
    comes first, so the checkpoint holds its step's state and is not torn."""
    real = CapturedState.copied

    def slow_copied(self, ptr):
        time.sleep(0.03)
        real(self, ptr)

    monkeypatch.setattr(CapturedState, "copied", slow_copied)
    runs = {}
    for mode in ("copy", "live"):
        model, opt = build_teacher()
        with ckptlab.Recorder(
            tmp_path / mode, model, opt, step_fn=step_teacher, build_fn=build_teacher, ckpt_every=2, ckpt_snapshot=mode
        ) as rec:
            for b, ids in models.mlp_batches(4):
                rec.step(b, ids)
        runs[mode] = ckptlab.open_run(tmp_path / mode)
    assert runs["copy"].checkpoints == runs["live"].checkpoints == [0, 2]  # no retake: not torn
    for a, b in zip(checkpoint_bytes(runs["copy"], 2), checkpoint_bytes(runs["live"], 2)):
        assert_same_tensors(a, b)


def live_pair():
    a, b = torch.zeros(4), torch.zeros(4)
    return a, b, CapturedState(0, {"a": a, "b": b}, {}, None, {}, live=[(a, a._version), (b, b._version)])


def test_the_optimizer_may_change_a_tensor_once_the_writer_has_its_bytes():
    a, b, snap = live_pair()
    assert snap.unwritten([a.data_ptr()]) and snap.unwritten([b.data_ptr(), 12345])
    snap.copied(a.data_ptr())
    assert not snap.unwritten([a.data_ptr()]) and snap.unwritten([b.data_ptr()])
    snap.wait_copied([a.data_ptr()])  # returns at once
    snap.begin_update()  # the optimizer's step begins, nothing changed so far
    a.add_(1)  # the step changes a: its bytes are already taken
    snap.begin_update()  # a second optimizer step in the same training step: not a change outside one
    assert snap.release() and not snap.unwritten([b.data_ptr()])


@pytest.mark.parametrize("when", ["before its bytes are taken", "after, before the optimizer's step"])
def test_a_tensor_changed_outside_the_optimizer_step_tears_the_checkpoint(when):
    """In place before the optimizer's step: the files would not hold the step's state, or
    may not (PyTorch bumps the version when the op is done, so an op still under way while
    its tensor was copied shows only after the copy: every tensor is checked again when the
    optimizer's step begins, or at the release if it has not)."""
    a, b, snap = live_pair()
    if when.startswith("before"):
        a.add_(1)
        snap.copied(a.data_ptr())
    else:
        snap.copied(a.data_ptr())
        a.add_(1)
    snap.begin_update()
    snap.copied(b.data_ptr())
    assert snap.release() is False
    _, b2, no_step = live_pair()
    no_step.copied(b2.data_ptr())
    b2.add_(1)  # no optimizer step began: checked at the release
    assert no_step.release() is False


class OwnAdamW(torch.optim.AdamW):
    """Not torch's: it could change the tensors by means the mode does not see (C++, threads)."""


def test_an_optimizer_that_updates_all_at_once_or_is_not_torchs_waits_for_the_whole_checkpoint():
    model, _ = models.build_mlp()
    assert snapshots.per_tensor_updates(torch.optim.AdamW(model.parameters()))
    assert snapshots.per_tensor_updates(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert not snapshots.per_tensor_updates(torch.optim.AdamW(model.parameters(), foreach=True))
    assert not snapshots.per_tensor_updates(torch.optim.AdamW(model.parameters(), fused=True))
    assert not snapshots.per_tensor_updates(OwnAdamW(model.parameters()))


def test_only_ops_that_change_or_hand_out_memory_wait_for_the_writer():
    changes = snapshots._changes_memory
    for func in (torch.Tensor.mul_, torch._foreach_mul_, torch.Tensor.__iadd__, torch.Tensor.__setitem__):
        assert changes(func, {}), func
    assert changes(torch.Tensor.numpy, {}) and changes(torch.Tensor.data_ptr, {})
    assert changes(torch.add, {"out": torch.zeros(1)})
    for func in (torch.Tensor.add, torch.Tensor.__add__, torch.is_complex, torch.Tensor.sqrt):
        assert not changes(func, {}), func


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
