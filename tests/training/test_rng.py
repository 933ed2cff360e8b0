"""RNG fingerprints: the Recorder tells whether the loop drew random numbers between two steps
from two cheap fingerprints; they must tell exactly what comparing full captures tells."""

import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab
from ckptlab.training import rng_state
from ckptlab.training.rng_state import rng_fingerprint
from ckptlab.training.state import capture_rng, rng_equal

# Draws and settings that move (or keep) each RNG, the awkward ones included: a draw that only
# consumes a cached Gaussian changes no key word (numpy's has_gauss, Python's gauss_next).
MOVES = [
    ("nothing", lambda: None),
    ("python random()", random.random),
    ("python gauss: caches one", random.gauss),
    ("python gauss: uses the cached one", random.gauss),
    ("python setstate to the same state", lambda: random.setstate(random.getstate())),
    ("numpy randn: caches one", np.random.randn),
    ("numpy randn: uses the cached one", np.random.randn),
    ("numpy set_state to the same state", lambda: np.random.set_state(np.random.get_state())),
    ("numpy seed", lambda: np.random.seed(7)),
    ("numpy seed again, nothing drawn", lambda: np.random.seed(7)),
    ("torch rand", lambda: torch.rand(3)),
    ("torch manual_seed", lambda: torch.manual_seed(3)),
    ("torch randn(1): caches a float normal", lambda: torch.randn(1)),
    ("torch randn(1): uses the cached one", lambda: torch.randn(1)),
    ("torch float64 normal: caches one", lambda: torch.randn(1, dtype=torch.float64)),
    ("torch float64 normal: uses the cached one", lambda: torch.randn(1, dtype=torch.float64)),
    ("torch set_rng_state to the same state", lambda: torch.set_rng_state(torch.get_rng_state())),
    ("torch manual_seed again, nothing drawn", lambda: torch.manual_seed(3)),
]


def _cached_gaussian_set_back():
    """numpy's state with the same key words as now but the cached Gaussian of earlier: only
    the cache differs (set_state of a state saved before the cache was used)."""
    np.random.seed(11)
    np.random.randn()
    saved = np.random.get_state()  # has_gauss = 1
    np.random.randn()  # uses it: has_gauss = 0, same key and position
    return lambda: np.random.set_state(saved)


def _torch_cached_normal_set_back():
    """torch's CPU state with the same key words as now but the cached float normal of
    earlier: only the cache differs."""
    torch.manual_seed(11)
    torch.randn(1)
    saved = torch.get_rng_state()  # a float normal cached
    torch.randn(1)  # uses it: same key and position
    return lambda: torch.set_rng_state(saved)


def _agree_through_moves() -> None:
    for name, move in [
        *MOVES,
        ("numpy: only the cached Gaussian put back", _cached_gaussian_set_back()),
        ("torch: only the cached normal put back", _torch_cached_normal_set_back()),
    ]:
        before_fp, before = rng_fingerprint(), capture_rng()
        move()
        after_fp, after = rng_fingerprint(), capture_rng()
        assert (before_fp == after_fp) == rng_equal(before, after), name


def test_fingerprints_tell_exactly_what_full_captures_tell():
    _agree_through_moves()


def test_the_raw_readers_are_used_here_and_the_fallbacks_agree(monkeypatch):
    # numpy / CPython / torch as installed: the raw reads were found and checked (else each step costs
    # ~50 us more: still exact, through get_state/getstate)
    rng_fingerprint()
    assert rng_state._NUMPY._offset not in (None, False) and rng_state._PYTHON._ok
    assert rng_state._TORCH._offset not in (None, False)
    monkeypatch.setattr(rng_state._NUMPY, "_offset", None)
    monkeypatch.setattr(rng_state._PYTHON, "_ok", False)
    monkeypatch.setattr(rng_state._TORCH, "_offset", None)
    _agree_through_moves()


def build():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def step(model, optimizer, batch):
    x = batch + float(np.random.randn())  # one Gaussian a step: numpy's cache flips every step
    loss = F.mse_loss(model(x), torch.zeros(len(x), 2))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def test_a_loop_that_uses_numpys_cached_gaussian_gets_its_states_recorded(tmp_path):
    np.random.seed(0)
    g = torch.Generator().manual_seed(0)
    drew, states = {3, 6}, {}
    with ckptlab.Recorder(tmp_path / "run", *build(), step_fn=step, build_fn=build, on_anomaly=None) as rec:
        for i in range(8):
            if i in drew:  # the step before left a Gaussian cached: this takes it, no key word moves
                np.random.randn()
            states[i] = np.random.get_state()
            rec.step(torch.randn(3, 4, generator=g))
    run = ckptlab.open_run(tmp_path / "run")
    recorded = {s: run.batch_record(s).rng for s in run.steps}
    assert [s for s, rng in recorded.items() if rng is not None] == [0, 3, 6]  # step 0 starts a segment
    for s in (3, 6):
        got, want = recorded[s]["numpy"], states[s]
        assert want[3] == 0 and got[3] == 0  # the cache was used up: only has_gauss tells
        assert got[0] == want[0] and np.array_equal(got[1], want[1]) and tuple(got[2:]) == tuple(want[2:])


def test_the_fingerprints_follow_the_generator_the_module_functions_draw_from(monkeypatch):
    """`random.random()` and `np.random.random()` draw from the instances their module
    functions were bound to at import (what `capture_rng` reads): rebinding `random._inst` or
    numpy's `mtrand._rand` alone must not hide their draws."""
    monkeypatch.setattr(random, "_inst", random.Random(1))
    monkeypatch.setattr(np.random.mtrand, "_rand", np.random.RandomState(1))
    before = rng_fingerprint()
    random.random()
    after_python = rng_fingerprint()
    assert after_python[0] != before[0]
    np.random.random()
    assert rng_fingerprint()[1] != after_python[1]
    assert rng_equal(capture_rng(), capture_rng())  # (and the capture reads those same instances)
