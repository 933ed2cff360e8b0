"""analysis/spikes.py: the one spike rule (the Recorder's anomaly events, info, dirty, report)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptlab.analysis.spikes import GRAD_RULE, LOSS_RULE, SpikeDetector, SpikeRule, find_spikes


def spike_steps(values, rule=LOSS_RULE) -> list[int]:
    return [i for i, _ in find_spikes(values, rule)]


def test_a_noisy_positive_loss_flags_only_its_planted_spikes():
    rng = np.random.default_rng(0)
    loss = 2.0 * np.exp(-np.arange(600) / 300) * np.exp(0.05 * rng.standard_normal(600))
    loss[[200, 450]] *= 5
    assert spike_steps(loss) == [200, 450]
    grads = np.exp(0.5 * rng.standard_normal(600))  # heavy-tailed, as small batches' are
    grads[300] = 1e4
    assert spike_steps(grads, GRAD_RULE) == [300]


def test_a_noisy_small_batch_loss_flags_no_healthy_step_but_a_real_spike():
    """Cross-entropy at batch 8, as an MNIST run's: most examples easy (loss ~0.003), one in
    five unsure (0.05-1), one in fifty wrong (1-5); a batch's loss is the mean of its 8. Its
    quantiles are those of the measured batch-8 curves (scripts/bench_spikes.py: 10% 0.006,
    median 0.12, 90% 0.41, 99% 0.79, max 1.2): right-skewed, so the window's MAD alone calls a
    batch with a wrong example a spike. Rising twice as far above the median as the window's
    highest value does is what marks a real one."""
    rng = np.random.default_rng(0)
    u = rng.random((400, 8))
    easy = rng.lognormal(np.log(0.003), 1.0, u.shape)
    loss = np.where(u < 0.02, rng.uniform(1, 5, u.shape), np.where(u < 0.22, rng.uniform(0.05, 1, u.shape), easy))
    loss = loss.mean(axis=1)
    assert spike_steps(loss) == []
    assert len(spike_steps(loss, replace(LOSS_RULE, tail=0))) >= 2  # the MAD alone flags healthy steps
    loss[300] = 5 * loss[:300].max()  # five times the highest loss so far
    loss[350] = 30 * np.median(loss[222:350])  # thirty times the median
    assert spike_steps(loss) == [300, 350]


def test_a_spike_on_a_decaying_loss_is_caught():
    """A loss falling from 10 to 2 (2 + 8 exp(-t/25), 5% noise): at steps 140-160 the window
    still holds the fall's first values (~7, at its oldest end) over a median of ~2.1. A 3x
    spike there (~6) is caught, as the z rule alone catches it: the tail bar is the window's
    largest rise of a value over the 8 before it (the noise's), where the window's highest
    value as the bar put it at ~2.1 + 2 x 4.9 = 12, over the spike."""
    rng = np.random.default_rng(0)
    level = 2 + 8 * np.exp(-np.arange(300) / 25)
    loss = level * np.exp(0.05 * rng.standard_normal(300))
    assert spike_steps(loss) == []
    for k in (140, 150, 160):
        planted = loss[: k + 1].copy()
        planted[k] = 3 * level[k]
        assert spike_steps(planted) == spike_steps(planted, replace(LOSS_RULE, tail=0)) == [k]


def test_a_loss_that_is_zero_on_most_batches():
    """A hinge or margin loss: 0 on most batches (MAD 0), ordinary positive values now and
    then, which are not each an infinitely large spike; a real jump still is."""
    rng = np.random.default_rng(1)
    loss = np.where(rng.random(400) < 0.15, rng.uniform(0.2, 0.8, 400), 0.0)
    assert spike_steps(loss) == []
    loss[300] = 50.0
    (spike,) = find_spikes(loss, LOSS_RULE)
    assert spike[0] == 300 and spike[1].median == 0.0 and spike[1].z > 6


def test_a_negative_loss_rises_by_its_magnitude():
    """A log-likelihood's loss near -10: 1.0 up (10%) is not a spike, 3.0 up (30%) is; a value
    far below is never one."""
    rng = np.random.default_rng(2)
    loss = -10 + 0.01 * rng.standard_normal(300)
    loss[100], loss[200], loss[250] = -9.0, -7.0, -30.0
    (spike,) = find_spikes(loss, LOSS_RULE)
    assert spike[0] == 200 and abs(spike[1].ratio - 1.3) < 0.01


# --- analysis/anomalies.py: each anomaly defined once, for a step and for a series ---------------


def _health(loss=1.0, grad=1.0, *, norms=(1.0, 1.0), nonfinite=0, skipped=False, weights=None, ratio=None):
    from ckptlab.training.health import StepHealth

    return StepHealth(
        loss=loss,
        grad_norm=grad,
        param_grad_norm=np.array(norms, dtype=np.float32),
        nonfinite_grads=nonfinite,
        param_nonfinite=None,
        lr=[0.1],
        stepped=not skipped,
        update_ratio_global=ratio,
        weight_norm=None if weights is None else np.array(weights, dtype=np.float32),
        scaler_skipped=skipped,
    )


def test_a_gradient_norm_over_the_bar_is_an_explosion_without_history():
    from ckptlab.analysis.anomalies import GRAD_EXPLOSION, detectors, grad_explosions, step_anomalies

    # Over the bar, 5000 needs no baseline; under it, 500 is an explosion once there is one
    # (16 values) to be a spike against.
    early = [1.0, 2.0, 5e3, 1.5, GRAD_EXPLOSION / 2]
    late = [1.0 + 0.01 * (i % 3) for i in range(20)] + [GRAD_EXPLOSION / 2]
    for norms, expected in ((early, [(2, False)]), (late, [(20, True)])):
        assert [(i, s is not None) for i, s in grad_explosions(norms)] == expected  # (step, a spike?)
        dets = detectors()
        events = [step_anomalies(_health(grad=g), dets) for g in norms]
        assert [i for i, e in enumerate(events) if e] == [i for i, _ in expected]
    assert step_anomalies(_health(grad=5e3), detectors()) == [{"kind": "grad_spike", "value": 5e3}]  # no median, z


def test_one_step_and_a_series_of_steps_get_the_same_verdict():
    from ckptlab.analysis.anomalies import detectors, nonfinite_grad, nonfinite_weight, step_anomalies

    inf, nan = float("inf"), float("nan")
    steps = [
        _health(),
        _health(loss=nan),
        _health(nonfinite=3, norms=(nan, 1.0)),
        _health(nonfinite=3, norms=(nan, 1.0), skipped=True),  # the GradScaler's overflow: routine
        _health(norms=(inf, 1.0)),  # an overflowed norm of finite elements
        _health(norms=(-1.0, 1.0)),  # no gradient (NO_GRAD) is not a bad one
        _health(weights=[1.0, nan]),
        _health(ratio=0.9),
    ]
    dets = detectors()
    kinds = [{e["kind"] for e in step_anomalies(h, dets)} for h in steps]
    assert kinds == [
        set(),
        {"nonfinite_loss"},
        {"nonfinite_grad"},
        set(),
        {"nonfinite_grad"},
        set(),
        {"nonfinite_weight"},
        {"update_explosion"},
    ]
    series = nonfinite_grad(
        np.array([h.nonfinite_grads for h in steps]),
        np.stack([h.param_grad_norm for h in steps]),
        np.array([h.scaler_skipped for h in steps]),
    )
    assert list(series) == ["nonfinite_grad" in k for k in kinds]
    # A recorded row without per-parameter norms (all NaN: not measured) is not a fault.
    assert not nonfinite_grad(np.array([0]), np.full((1, 2), nan), np.array([False]))[0]
    assert list(nonfinite_weight(np.array([[1.0, nan], [1.0, 2.0]]))) == [1, 0]


def _one_by_one(values, rule) -> list[tuple[int, float, float, float]]:
    """Each value fed to a SpikeDetector in turn, as the Recorder does."""
    det = SpikeDetector(rule)
    return [(i, s.value, s.median, s.z) for i, v in enumerate(values) if (s := det.check(float(v))) is not None]


def _found(values, rule) -> list[tuple[int, float, float, float]]:
    return [(i, s.value, s.median, s.z) for i, s in find_spikes(values, rule)]


def test_a_long_series_gets_the_recorders_spikes_without_scanning_each_value():
    """find_spikes judges most values of a long series by numpy bounds and the rest with the
    detector: the same spikes, medians and z as the Recorder's value-by-value scan, through
    spike episodes (where the window is not the plain last values), NaNs and a negative
    stretch."""
    rng = np.random.default_rng(7)
    n = 20_000
    loss = 3 * np.exp(-np.arange(n) / 8000) * np.exp(0.1 * rng.standard_normal(n))
    loss[rng.integers(0, n, 60)] *= rng.choice([2.0, 5.0, 50.0], 60)
    loss[9000:9150] *= 20  # an episode longer than the window
    loss[rng.integers(0, n, 40)] = np.nan
    loss[15000:15500] -= 4  # crosses zero
    grads = np.exp(rng.standard_normal(n))
    grads[rng.integers(0, n, 30)] = 1e6
    for values, rule in ((loss, LOSS_RULE), (grads, GRAD_RULE), (loss, replace(LOSS_RULE, tail=0))):
        expected = _one_by_one(values, rule)
        assert len(expected) >= 20
        assert _found(values, rule) == expected


def test_a_bar_met_to_the_last_bit_is_met_on_the_fast_path_too():
    """The detector tests x - median >= (min_ratio - 1) * |median|; numpy's bounds test it as x
    >= median + ..., which rounds otherwise: -1e-16 over a median of -10 at min_ratio 2 is
    10.0 >= 10.0 to the detector, a spike, and must not be ruled out."""
    rule = SpikeRule(window=16, min_points=8, min_ratio=2.0)
    loss = -10 + 0.01 * np.random.default_rng(1).standard_normal(1000)
    loss[300] = -1e-16
    assert _found(loss, rule) == _one_by_one(loss, rule) and [s[0] for s in _found(loss, rule)] == [300]


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(
        st.one_of(st.floats(-5, 5), st.floats(-1e6, 1e6), st.sampled_from([0.0, 1.0, math.nan, math.inf])),
        min_size=0,
        max_size=400,
    ),
    window=st.integers(2, 24),
    level=st.integers(1, 30),
    min_points=st.integers(1, 30),
    tail=st.sampled_from([0.0, 0.5, 2.0]),
    min_ratio=st.sampled_from([0.5, 1.0, 1.2, 5.0]),
)
def test_any_series_and_rule_get_the_recorders_spikes(values, window, level, min_points, tail, min_ratio):
    rule = SpikeRule(window=window, level=level, min_points=min_points, tail=tail, min_ratio=min_ratio, z=2.0)
    assert _found(values, rule) == _one_by_one(values, rule)
