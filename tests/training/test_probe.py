"""The probe: pre-clip gradient norms measured once per step (batched), health read at
once or later with the same bits, and the sampled update ratio against the exact one."""

import numpy as np
import torch
from torch import nn

from ckptlab.training import probe as probe_mod
from ckptlab.training.norms import batched_norms
from ckptlab.training.probe import StepProbe
from ckptlab.training.update_sample import MEMORY_SHARE, UPDATE_SAMPLE, sample_plans


def wide_mlp(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batches(n: int, micro: int = 1):
    g = torch.Generator().manual_seed(3)
    return [
        [(torch.randn(16, 256, generator=g), torch.randn(16, 8, generator=g)) for _ in range(micro)] for _ in range(n)
    ]


def train_step(model, opt, micro_batches, clip=0.1):
    """Gradient accumulation over the micro-batches, then clipping: returns the pre-clip norm."""
    for x, y in micro_batches:
        (nn.functional.mse_loss(model(x), y) / len(micro_batches)).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def counted_probe(monkeypatch):
    """(model, optimizer, a probe on them, the list each batched norm call appends its size to)."""
    model, opt = wide_mlp()
    probe = StepProbe(model, opt)
    calls = []
    real = probe_mod.batched_norms
    monkeypatch.setattr(probe_mod, "batched_norms", lambda ts: calls.append(len(ts)) or real(ts))
    return model, opt, probe, calls


def test_grad_norms_are_pre_clip_and_computed_once_per_step_not_per_parameter(monkeypatch):
    model, opt, probe, calls = counted_probe(monkeypatch)
    for n, step in enumerate(batches(3, micro=4)):
        calls.clear()
        probe.begin()
        total = train_step(model, opt, step)
        health = probe.end(total).result()
        # one batched call over all 6 gradients: per backward on a probe's first step, then
        # once per optimizer step (tests/training/test_probe_once_per_step.py)
        assert calls == ([6] * 5 if n == 0 else [6])
        assert abs(health.grad_norm - float(total)) <= 1e-5 * float(total)  # before clipping (to 0.1)
        assert health.grad_norm > 0.1 and health.nonfinite_grads == 0
    probe.close()


def test_a_closed_probe_measures_nothing_until_attached_again(monkeypatch):
    model, opt, probe, calls = counted_probe(monkeypatch)
    (step,) = batches(1)
    probe.close()
    probe.begin()
    train_step(model, opt, step)  # (the benchmark's bare step: no hook of ours runs)
    assert calls == []
    probe.abort()
    probe.attach()
    probe.attach()  # once is enough: hooks are not doubled
    probe.begin()
    total = train_step(model, opt, step)
    health = probe.end(total).result()
    assert calls == [6, 6]  # (a probe's first step: its backward, and the check at the clip)
    assert abs(health.grad_norm - float(total)) <= 1e-5 * float(total)
    probe.close()


def test_a_deferred_read_gives_the_same_bits_as_an_immediate_one():
    runs = []
    for deferred in (False, True):
        model, opt = wide_mlp()
        probe = StepProbe(model, opt)
        healths, pending = [], None
        for step in batches(4):
            probe.begin(measure_update=True)
            loss = train_step(model, opt, step)
            now = probe.end(loss)
            if deferred:  # read step n's health after step n+1 ran
                if pending is not None:
                    healths.append(pending.result())
                pending = now
            else:
                healths.append(now.result())
        if pending is not None:
            healths.append(pending.result())
        runs.append(healths)
    for a, b in zip(*runs):
        assert a.loss == b.loss and a.grad_norm == b.grad_norm
        assert np.array_equal(a.param_grad_norm, b.param_grad_norm)
        assert np.array_equal(a.update_ratio, b.update_ratio) and np.array_equal(a.weight_norm, b.weight_norm)


def test_the_sampled_update_ratio_estimates_the_exact_one():
    ratios = {}
    for mode in ("exact", "sampled"):
        model, opt = wide_mlp()
        probe = StepProbe(model, opt, update_ratio=mode)
        got = []
        for step in batches(6):
            probe.begin(measure_update=True)
            h = probe.end(train_step(model, opt, step)).result()
            got.append((h.update_ratio, h.update_ratio_global, h.weight_norm))
        ratios[mode] = got
    worst = 0.0
    for (ex, ex_g, ex_w), (sa, sa_g, sa_w) in zip(ratios["exact"], ratios["sampled"]):
        assert np.array_equal(ex_w, sa_w)  # ||w|| is exact in both modes
        rel = np.abs(sa / ex - 1)
        worst = max(worst, float(rel.max()))
        assert rel.max() < 0.15 and abs(sa_g / ex_g - 1) < 0.05
    assert worst > 0  # it is an estimate (the biases, sampled whole, are exact)


def test_the_update_sample_stays_within_its_memory_share():
    for numels in ([64] * 10, [262_144, 512, 262_144, 512], [38_597_376, 768, 2_359_296] * 12, [5, 7, 1_000_003]):
        sizes = [4] * len(numels)
        plans = sample_plans(numels, sizes)
        held = sum(p.count * 4 for p in plans)
        assert held <= max(MEMORY_SHARE * sum(n * 4 for n in numels), sum(min(n, 64) * 4 for n in numels))
        for n, p in zip(numels, plans):
            assert 1 <= p.count <= min(n, UPDATE_SAMPLE)
            assert p.offset + (p.count - 1) * p.stride < n and p.scale == n / p.count


def test_norms_are_float32_and_the_same_bits_whatever_the_gradients_dtype():
    g = torch.Generator().manual_seed(7)
    f32 = [torch.randn(s, generator=g) * 10.0**k for k, s in enumerate([(4096, 64), (64,), (333, 17), (1,)])]
    mixed = [*f32, torch.randn(100, 10, generator=g).bfloat16()]
    for tensors in (f32, mixed):
        got = batched_norms(tensors)
        want = [torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]
        assert all(a.dtype == torch.float32 for a in got)
        assert torch.equal(torch.stack(got), torch.stack(want))


def test_a_nan_gradient_is_recorded_as_nan_not_as_no_gradient():
    """A parameter whose gradient norm is NaN was measured: its norm is NaN (not NO_GRAD, -1,
    which means "no gradient"), and the global norm is NaN too, as clip_grad_norm_ says."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    unused = nn.Parameter(torch.ones(3))
    model.register_parameter("unused", unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = StepProbe(model, opt)
    names = probe.names
    one = torch.zeros(4, 4, dtype=torch.bool)
    one[0, 0] = True
    model[0].weight.register_hook(lambda g: g.masked_fill(one, float("nan")))  # the backward makes one NaN
    probe.begin()
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    health = probe.end(loss).result(grads_live=True)
    probe.close()
    norms = dict(zip(names, health.param_grad_norm.tolist()))
    assert np.isnan(norms["0.weight"])
    assert norms["unused"] == -1.0  # NO_GRAD: it got no gradient
    assert all(np.isfinite(norms[n]) and norms[n] > 0 for n in ("0.bias", "1.weight", "1.bias"))
    assert np.isnan(health.grad_norm) and np.isnan(float(total))
    assert health.nonfinite_grads == 1
    assert dict(zip(names, health.param_nonfinite.tolist()))["0.weight"] == 1


def test_nonfinite_weights_have_a_nan_update_ratio_and_their_norms_before_the_update():
    """Weights already NaN when the step begins (changed outside it): their update ratio is NaN,
    not 0 ("did not move", which reads as a frozen layer), and the norms before the update are
    kept, naming them, also on a step that does not measure update ratios."""
    ((x, y),) = batches(1)[0]

    def one_step(measure: bool, corrupt: bool):
        model, opt = wide_mlp()
        probe = StepProbe(model, opt)
        if corrupt:
            with torch.no_grad():
                model[2].weight[0, 0] = float("nan")
        probe.begin(measure_update=measure)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        health = probe.end(loss).result(grads_live=True)
        probe.close()
        return dict(zip(probe.names, health.update_ratio.tolist())) if measure else None, health

    for measure in (True, False):
        ratio, health = one_step(measure, corrupt=True)
        before = dict(zip(StepProbe(*wide_mlp()).names, health.weight_norm_before.tolist()))
        assert np.isnan(before["2.weight"]) and np.isfinite(before["0.weight"])
        if measure:
            # (the NaN reaches every gradient, so every update is NaN: none reads as 0, "frozen")
            assert np.isnan(ratio["2.weight"]) and not any(r == 0 for r in ratio.values())
    _, healthy = one_step(True, corrupt=False)
    assert healthy.weight_norm_before is None  # a healthy step keeps no norms from before the update
