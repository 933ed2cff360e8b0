"""Pre-clip gradient norms once per optimizer step, in any loop shape, with no ckptlab call in
the loop: the accumulated gradient before clipping, the same bits from a fresh probe (replay)."""

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_, clip_grad_value_  # bound before any probe exists

from ckptlab.training import probe as probe_mod
from ckptlab.training.probe import StepProbe

MICRO = 4


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def micro_batches(step: int):
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)) for _ in range(MICRO)]


def pre_clip(model) -> torch.Tensor:
    """The norm of each accumulated gradient as the loop leaves it after its last backward."""
    return torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()])


def by_hand(params, max_norm):
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    for p in params:
        p.grad.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))


def step(model, opt, batches, clip: str, scaler=None):
    """A hand-written micro-batch loop (no ckptlab call); returns (loss, the pre-clip norms)."""
    opt.zero_grad(set_to_none=True)
    for x, y in batches:
        loss = nn.functional.mse_loss(model(x), y) / len(batches)
        (scaler.scale(loss) if scaler is not None else loss).backward()
    if scaler is not None:
        scaler.unscale_(opt)
    want = pre_clip(model)
    params = list(model.parameters())
    if clip == "norm":
        clip_grad_norm_(params, 1e-3)
    elif clip == "value":
        clip_grad_value_(params, 1e-4)
    elif clip == "hand":
        by_hand(params, 1e-3)
    elif clip == "skip":  # a loop that drops the update instead of stepping
        opt.zero_grad(set_to_none=True)
        return loss, want
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    return loss, want


def counted(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = probe_mod.batched_norms
    monkeypatch.setattr(probe_mod, "batched_norms", lambda ts: calls.append(len(ts)) or real(ts))
    return calls


@pytest.mark.parametrize("clip", ["norm", "value", "none", "skip", "amp"])
def test_a_micro_batch_loop_is_measured_once_per_step_before_its_clipping(monkeypatch, clip):
    model, opt = mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if clip == "amp" else None
    probe = StepProbe(model, opt, scaler)
    calls = counted(monkeypatch)
    for n in range(4):
        calls.clear()
        probe.begin()
        loss, want = step(model, opt, micro_batches(n), "norm" if clip == "amp" else clip, scaler)
        health = probe.end(loss).result(grads_live=True)
        # the first step of a probe measures each backward (and learns the loop leaves its
        # gradients alone until the clip: same versions, same norms); then one batched call
        # per optimizer step
        assert calls == ([4] * (MICRO + 1) if n == 0 else [4])
        got = torch.from_numpy(health.param_grad_norm).float()
        assert torch.allclose(got, want, rtol=1e-6, atol=0), (n, got, want)  # before the clip
    assert probe.grad_mode == "lazy"
    probe.close()


def test_clipping_by_hand_keeps_the_pre_clip_norm_on_every_step(monkeypatch):
    model, opt = mlp()
    probe = StepProbe(model, opt)
    calls = counted(monkeypatch)
    for n in range(3):
        calls.clear()
        probe.begin()
        loss, want = step(model, opt, micro_batches(n), "hand")
        health = probe.end(loss).result()
        assert torch.allclose(torch.from_numpy(health.param_grad_norm).float(), want, rtol=1e-6, atol=0)
        assert health.grad_norm > 1e-3  # not the clipped one
    assert probe.grad_mode == "eager" and calls == [4] * MICRO  # the loop changes its gradients: every backward


def test_a_fresh_probe_at_any_step_gives_the_recorded_bits():
    """Replay starts at a checkpoint with a fresh probe (which measures at each backward's
    end); the recording's probe measured lazily by then: the same bits."""
    model, opt = mlp()
    probe = StepProbe(model, opt)
    recorded, states = [], []
    for n in range(4):
        states.append((copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())))
        probe.begin()
        loss, _ = step(model, opt, micro_batches(n), "norm")
        recorded.append(probe.end(loss).result())
    assert probe.grad_mode == "lazy"
    probe.close()
    for n in (1, 3):
        model, opt = mlp()
        model.load_state_dict(states[n][0])
        opt.load_state_dict(states[n][1])
        fresh = StepProbe(model, opt)
        fresh.begin()
        loss, _ = step(model, opt, micro_batches(n), "norm")
        replayed = fresh.end(loss).result()
        fresh.close()
        assert replayed.param_grad_norm.tobytes() == recorded[n].param_grad_norm.tobytes()
        assert replayed.grad_norm == recorded[n].grad_norm


def counting(calls: list[int], real):
    return lambda ts, *a, **k: calls.append(len(ts)) or real(ts, *a, **k)


def test_clip_grad_norm_reuses_the_probes_norms_and_trains_the_same_bits(monkeypatch):
    """Recording changes nothing in training: clip_grad_norm_ returns the same bits with a
    probe as without one (it stacks the probe's norms instead of taking them again: one norm
    pass a step, not two), and the weights after a few steps are the same."""
    runs = []
    for probed in (False, True):
        model, opt = mlp()
        probe = StepProbe(model, opt) if probed else None
        calls: list[int] = []
        real = torch._foreach_norm
        monkeypatch.setattr(torch, "_foreach_norm", counting(calls, real))
        totals = []
        for n in range(3):
            calls.clear()
            if probe is not None:
                probe.begin()
            opt.zero_grad(set_to_none=True)
            for x, y in micro_batches(n):
                (nn.functional.mse_loss(model(x), y) * 100).backward()
            totals.append(clip_grad_norm_(model.parameters(), 1e-3))
            opt.step()
            if probe is not None:
                health = probe.end(totals[-1]).result()
                assert health.grad_norm == pytest.approx(float(totals[-1]), rel=1e-6)
                assert calls == ([4] * (MICRO + 1) if n == 0 else [4])  # the clip took no norm of its own
        monkeypatch.undo()
        runs.append((torch.stack(totals), [p.detach().clone() for p in model.parameters()]))
    (bare_totals, bare_weights), (rec_totals, rec_weights) = runs
    assert bare_totals.numpy().tobytes() == rec_totals.numpy().tobytes()
    assert all(torch.equal(a, b) for a, b in zip(bare_weights, rec_weights))


def test_a_change_behind_the_version_counters_on_the_first_step_keeps_every_backward_measured():
    """`p.grad.data.mul_` (old hand-written clipping) and DDP's all-reduce into bucket views
    write gradients without bumping their version counters: a probe's first step compares the
    norms themselves, and such a loop stays measured at each backward's end (pre-change)."""
    model, opt = mlp()
    probe = StepProbe(model, opt)
    for n in range(3):
        probe.begin()
        opt.zero_grad(set_to_none=True)
        for x, y in micro_batches(n):
            (nn.functional.mse_loss(model(x), y) / MICRO).backward()
        want = pre_clip(model)
        for p in model.parameters():
            p.grad.data.mul_(0.5)
        opt.step()
        health = probe.end(torch.tensor(0.0)).result()
        assert torch.allclose(torch.from_numpy(health.param_grad_norm).float(), want, rtol=1e-6, atol=0)
    assert probe.grad_mode == "eager"
    probe.close()


def lazy_probe_after_one_step(model, opt) -> StepProbe:
    probe = StepProbe(model, opt)
    probe.begin()
    loss, _ = step(model, opt, micro_batches(0), "norm")
    probe.end(loss).result()
    assert probe.grad_mode == "lazy"
    return probe


def test_a_later_step_that_clips_by_hand_is_caught_through_the_versions_of_the_first_micro_batchs_tensors():
    """In the lazy mode a micro-batch's backward notes only the versions of the gradients an
    earlier backward of the step left (it accumulated into them in place): a change by hand
    after the last one still shows, and every backward is measured from then on."""
    model, opt = mlp()
    probe = lazy_probe_after_one_step(model, opt)
    for n in (1, 2, 3):
        probe.begin()
        loss, want = step(model, opt, micro_batches(n), "hand" if n >= 2 else "norm")
        health = probe.end(loss).result()
        got = torch.from_numpy(health.param_grad_norm).float()
        if n == 3:  # measured at each backward's end since step 2: before the clip by hand
            assert torch.allclose(got, want, rtol=1e-6, atol=0) and health.grad_norm > 1e-3
        if n == 1:
            assert probe.grad_mode == "lazy" and probe._reuse
    assert probe.grad_mode == "eager"
    probe.close()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_a_backward_that_makes_new_gradient_tensors_is_measured_right_and_read_whole_from_then_on():
    """`create_graph=True` accumulates out of place: each backward leaves new tensors, so the
    note of an earlier micro-batch's tensors is stale. The measuring point sees other tensors,
    the step is measured as it stands (before the clip), and the probe learns again, reading
    each backward's gradients from then on."""
    model, opt = mlp()
    probe = lazy_probe_after_one_step(model, opt)
    for n in range(1, 5):
        probe.begin()
        opt.zero_grad(set_to_none=True)
        for x, y in micro_batches(n):
            (nn.functional.mse_loss(model(x), y) / MICRO).backward(create_graph=True)
        want = pre_clip(model).detach()
        clip_grad_norm_(model.parameters(), 1e-3)
        opt.step()
        health = probe.end(torch.tensor(0.0)).result()
        got = torch.from_numpy(health.param_grad_norm).float()
        assert torch.allclose(got, want, rtol=1e-6, atol=0), n
    assert probe.grad_mode == "lazy" and not probe._reuse
    for p in model.parameters():  # (create_graph: the gradients hold their graph)
        p.grad = None
    probe.close()


def test_a_parameter_first_given_a_gradient_by_a_later_micro_batch_is_measured():
    """A micro-batch that does not reach a parameter (an unused expert) leaves it no gradient:
    that note is not reused, and the parameter's gradient from a later micro-batch counts."""
    torch.manual_seed(0)
    first, second = nn.Linear(8, 4), nn.Linear(8, 4)
    model = nn.ModuleList([first, second])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = StepProbe(model, opt)
    x = torch.randn(4, 8)
    for n in range(3):
        probe.begin()
        opt.zero_grad(set_to_none=True)
        first(x).square().mean().backward()  # no gradient for `second` yet
        (second(x) * (n + 1)).square().mean().backward()
        first(x).square().mean().backward()  # (accumulates; `second` unchanged)
        want = pre_clip(model)
        clip_grad_norm_(model.parameters(), 1e-3)
        opt.step()
        health = probe.end(torch.tensor(0.0)).result()
        assert torch.allclose(torch.from_numpy(health.param_grad_norm).float(), want, rtol=1e-6, atol=0), n
    assert probe.grad_mode == "lazy" and probe._reuse  # (a note with a parameter missing is not reused)
    probe.close()
