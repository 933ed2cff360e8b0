"""RNG fingerprints (rng_state.py): two fingerprints are equal exactly when
`capture_rng()` at those moments gives states `rng_equal` calls equal, through seeding,
restoring, and module functions rebound to other generators."""

import random

import numpy as np
import pytest

from ckptlab.training.rng_state import rng_fingerprint
from ckptlab.training.state import capture_rng, rng_equal


def ops(monkeypatch):
    other_py, other_np = random.Random(7), np.random.RandomState(7)
    saved = {}

    def save():
        saved["s"] = (random.getstate(), np.random.get_state())

    def restore():
        random.setstate(saved["s"][0])
        np.random.set_state(saved["s"][1])

    return [
        save,
        lambda: random.random(),
        lambda: random.gauss(0.0, 1.0),
        lambda: random.seed(3),
        lambda: random.seed(),
        lambda: np.random.random(),
        lambda: np.random.standard_normal(),
        lambda: np.random.seed(3),
        lambda: np.random.seed(),
        restore,
        lambda: other_py.random(),  # a generator no module function draws from
        lambda: other_np.random_sample(),
        lambda: monkeypatch.setattr(random, "_inst", other_py),  # rebinding the private name alone
        lambda: monkeypatch.setattr(np.random.mtrand, "_rand", other_np),
        lambda: [
            monkeypatch.setattr(random, f, getattr(other_py, f)) for f in ("random", "getstate", "setstate", "seed")
        ],
        lambda: [
            monkeypatch.setattr(np.random, f, getattr(other_np, f))
            for f in ("random", "get_state", "set_state", "seed")
        ],
    ]


@pytest.mark.parametrize("seed", range(6))
def test_fingerprints_are_equal_exactly_when_the_captured_states_are(monkeypatch, seed):
    choose = random.Random(seed)
    actions = ops(monkeypatch)
    actions[0]()
    seen = [(rng_fingerprint(), capture_rng())]
    for _ in range(40):
        choose.choice(actions)()
        seen.append((rng_fingerprint(), capture_rng()))
    for i, (fa, ca) in enumerate(seen):
        for fb, cb in seen[i + 1 :]:
            assert (fa[:2] == fb[:2]) == (rng_equal(ca, cb)), i


def test_wrapping_random_getstate_alone_does_not_change_the_fingerprint(monkeypatch):
    """A library that wraps `random.getstate` (a plain function, no `__self__`) changes no
    state: the fingerprint must not differ (else the Recorder sees a draw that was not made)."""
    before, captured = rng_fingerprint(), capture_rng()
    real = random.getstate
    monkeypatch.setattr(random, "getstate", lambda: real())
    assert rng_equal(captured, capture_rng())
    assert rng_fingerprint()[0] == before[0]
