"""analysis/spikes.py: the one spike rule (the Recorder's anomaly events, info, dirty, report)."""

from __future__ import annotations

import numpy as np

from ckptlab.analysis.spikes import GRAD_RULE, LOSS_RULE, find_spikes


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
