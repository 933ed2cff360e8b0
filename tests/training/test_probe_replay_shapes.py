"""Loops whose gradients are replaced or changed by hand, recorded by a long-lived probe and
replayed from any step by a fresh one that takes up what the first had learned by then (as a
replay from a checkpoint does: probe.py `learned`), give the same bits."""

import torch
from torch import nn

from ckptlab.training.probe import StepProbe, learned, resume_learned

MICRO = 4


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batches(n):
    g = torch.Generator().manual_seed(n)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(MICRO)]


def loop(model, opt, n, *, assign_at: set, clip_at: set):
    """Micro-batches; on `assign_at` steps the gradients are replaced (`p.grad = p.grad * 0.5`)
    between micro-batches; on `clip_at` steps they are clipped by hand after the last one."""
    opt.zero_grad(set_to_none=True)
    for i, (x, y) in enumerate(batches(n)):
        if i == 2 and n in assign_at:
            for p in model.parameters():
                p.grad = p.grad * 0.5
        (nn.functional.mse_loss(model(x), y) / MICRO).backward()
    if n in clip_at:
        for p in model.parameters():
            p.grad.mul_(1e-3)
    opt.step()
    return torch.tensor(0.0)


def recorded_and_replayed(steps: int, **shape):
    model, opt = build()
    probe = StepProbe(model, opt)
    out = []
    for n in range(steps):
        state = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict(), learned(probe))
        probe.begin()
        rec = probe.end(loop(model, opt, n, **shape)).result()
        m2, o2 = build()
        m2.load_state_dict(state[0])
        o2.load_state_dict(state[1])
        fresh = StepProbe(m2, o2)
        resume_learned(fresh, state[2])
        fresh.begin()
        rep = fresh.end(loop(m2, o2, n, **shape)).result()
        fresh.close()
        out.append((rec.param_grad_norm.tobytes(), rep.param_grad_norm.tobytes()))
    probe.close()
    return out


def test_after_gradients_replaced_between_micro_batches_a_later_hand_clip_keeps_the_pre_clip_bits():
    """Step 2 replaces the gradients between micro-batches (the reused note goes stale: the
    probe learns again); step 3 clips by hand. The probe measures step 3 before the clip, as
    the replay's does. (When every backward read its gradients whole, the probe stayed lazy and
    recorded step 3's norms after the clip.)"""
    runs = recorded_and_replayed(5, assign_at={2}, clip_at={3})
    assert all(rec == rep for rec, rep in runs)


def test_the_first_step_that_clips_by_hand_replays_to_the_recorded_bits():
    """A lazy probe measures the first step that changes its gradients after its backward
    after the change (a learning one would measure before it): the replay's probe, lazy too,
    gives the recorded bits."""
    runs = recorded_and_replayed(4, assign_at=set(), clip_at={2})
    assert [i for i, (rec, rep) in enumerate(runs) if rec != rep] == []
