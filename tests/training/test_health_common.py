"""The usual step's health read in plain Python (training/health.py `read_common`, record/health.py
`_record_common`, run/records.py `encode_step_floats`): right after a step every numpy call and
JSON encode costs tens of microseconds, so the usual step skips them. The record must be the
same bytes, the health the same bits, the alerts the same events as the general path's."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import ckptlab
from ckptlab.run import records
from ckptlab.training import health as health_mod
from ckptlab.training.health import read_common, read_health
from ckptlab.training.pending import PendingHealth
from ckptlab.training.world import World
from tests.models import build_mlp, mlp_batches, step_mlp


@pytest.mark.parametrize("n", [*range(0, 20), 64, 127, 128, 129, 200, 256, 257, 1000])
def test_the_plain_sum_is_numpys_sum(n):
    rng = np.random.default_rng(n)
    for _ in range(20):
        x = rng.random(n) * 10.0 ** rng.integers(-30, 30, n)
        assert health_mod._sum_as_numpy(x.tolist()) == x.sum()
    assert health_mod._sum_agrees()


def _probe_output(norms: list[float], loss: float, extra: dict | None = None):
    values = torch.tensor([loss, *norms], dtype=torch.float32)
    parts = {"loss": slice(0, 1), "grad": slice(1, 1 + len(norms)), **(extra or {})}
    meta = {"idx": list(range(len(norms))), "nonfinite": {}, "lr": [0.01, 0.1], "stepped": True, "step_time": 0.0125}
    return values, parts, meta


@pytest.mark.parametrize("seed", range(30))
def test_read_common_is_read_health_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    P = int(rng.integers(1, 40))
    norms = np.float32(rng.random(P) * 10.0 ** rng.integers(-20, 20, P)).tolist()
    values, parts, meta = _probe_output(norms, float(rng.normal()) * 10.0 ** float(rng.integers(-5, 5)))
    params = [torch.zeros(1) for _ in range(P)]
    want = read_health(values.numpy(), parts, meta, params=params, world=World(), optimizer=None, grads_live=False)
    common = read_common(values.tolist(), parts, meta, P)
    assert common is not None
    got = common.health()
    assert got.loss == want.loss and got.grad_norm == want.grad_norm
    assert got.param_grad_norm.dtype == want.param_grad_norm.dtype == np.float32
    assert got.param_grad_norm.tobytes() == want.param_grad_norm.tobytes()
    for field in ("nonfinite_grads", "param_nonfinite", "lr", "stepped", "step_time", "grad_scale", "scaler_skipped"):
        assert getattr(got, field) == getattr(want, field), field
    assert common.scalars() == want.scalars()


def _measured(rng, P: int, *, flags: bool, scale: str):
    """A step that measured its update, as the probe lays it out: weight norms after and
    before, update norms (of a sample, scaled up by `d_scale`), the second-moment flags."""
    norms = np.float32(rng.random(P) * 10.0 ** rng.integers(-6, 6, P)).tolist()
    w = np.float32(rng.random(P) * 10.0 ** rng.integers(-3, 3, P))
    b = w.copy()
    b[rng.random(P) < 0.2] = 0.0  # a zero-initialised bias: its ratio is inf once it moves
    d = np.float32(rng.random(P) * 10.0 ** rng.integers(-9, 0, P))
    d[rng.random(P) < 0.1] = 0.0
    extra, pieces, at = {}, [], 1 + P
    for name, vec in (("w", w), ("b", b), ("d", d), *((("e", np.zeros(P, np.float32)),) if flags else ())):
        extra[name] = slice(at, at + P)
        pieces += vec.tolist()
        at += P
    values, parts, meta = _probe_output([*norms, *pieces], float(rng.normal()), extra)
    parts["grad"] = slice(1, 1 + P)
    meta["idx"] = list(range(P))
    meta["d_scale"] = np.ones(P) if scale == "exact" else rng.random(P) * 1e3 + 1
    return values, parts, meta


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("scale", ["exact", "sampled"])
def test_a_measured_update_is_read_as_read_health_reads_it(seed, scale):
    rng = np.random.default_rng(seed)
    P = int(rng.integers(1, 30))
    values, parts, meta = _measured(rng, P, flags=seed % 2 == 0, scale=scale)
    params = [torch.zeros(1) for _ in range(P)]
    want = read_health(values.numpy(), parts, meta, params=params, world=World(), optimizer=None, grads_live=False)
    common = read_common(values.tolist(), parts, meta, P)
    assert common is not None
    got = common.health()
    for key in ("param_grad_norm", "weight_norm", "update_ratio", "second_moment_empty"):
        a, b = getattr(got, key), getattr(want, key)
        assert (a is None and b is None) or (a.dtype == b.dtype and a.tobytes() == b.tobytes()), key
    assert got.update_ratio_global == want.update_ratio_global and got.weight_norm_before is None
    assert common.scalars() == want.scalars()
    assert {k: np.array(v, np.float32).tobytes() for k, v in common.arrays().items()} == {
        k: v.tobytes() for k, v in want.arrays().items()
    }


def test_a_first_update_or_bad_weights_are_left_to_the_general_read():
    rng = np.random.default_rng(3)
    values, parts, meta = _measured(rng, 5, flags=True, scale="sampled")
    flagged = values.clone()
    flagged[parts["e"].start + 2] = 1.0  # an empty second moment: the first-update rule looks
    assert read_common(flagged.tolist(), parts, meta, 5) is None
    for bad in (math.nan, math.inf):
        broken = values.clone()
        broken[parts["w"].start] = bad
        assert read_common(broken.tolist(), parts, meta, 5) is None
    huge = values.clone()
    huge[parts["b"]] = 1e-30  # ratios beyond float32's range: numpy's cast makes them inf
    huge[parts["d"]] = 1e30
    assert read_common(huge.tolist(), parts, meta, 5) is None
    assert read_common(values.tolist(), {k: v for k, v in parts.items() if k != "d"}, meta, 5) is None


def test_any_other_step_is_left_to_the_general_read():
    norms = [1.0, 2.0, 3.0]
    for loss, bad in ((math.nan, norms), (math.inf, norms), (1.0, [1.0, math.inf, 2.0]), (1.0, [1.0, math.nan])):
        values, parts, meta = _probe_output(bad, loss)
        assert read_common(values.tolist(), parts, meta, len(bad)) is None, (loss, bad)
    values, parts, meta = _probe_output(norms, 1.0)
    assert read_common(values.tolist(), parts, meta, 4) is None  # a parameter without a gradient
    assert read_common(values.tolist(), {**parts, "scale": slice(4, 5)}, meta, 3) is None  # a GradScaler's step
    assert read_common(values.tolist(), parts, {**meta, "nonfinite": {1: 3}}, 3) is None
    assert read_common(values.tolist(), parts, {**meta, "stepped": None}, 3) is None  # a measured hand update


def _scalars(rng) -> dict:
    def number():
        return float(
            rng.choice([rng.random(), 1e-300, 1e300, 0.0, 123456789.0, 1e16, 5e-324, float(rng.integers(0, 9))])
        )

    out = {"step": int(rng.integers(0, 10**7)), "time": 1.7e9 + rng.random(), "loss": number(), "grad_norm": number()}
    out |= {
        "nonfinite_grads": 0,
        "lr": [number() for _ in range(int(rng.integers(0, 3)))],
        "stepped": bool(rng.random() < 0.5),
    }
    out["step_time"] = number()
    if rng.random() < 0.3:
        out["ckpt_wait"] = number()
    return out


@pytest.mark.parametrize("seed", range(40))
def test_the_usual_step_record_is_the_same_bytes(seed):
    rng = np.random.default_rng(seed)
    P = int(rng.integers(0, 30))
    norms = np.float32(rng.random(P) * 10.0 ** rng.integers(-8, 8, P)).tolist()
    scalars = _scalars(rng)
    if seed % 10 == 1:
        scalars["loss"] = math.nan  # (the general JSON path)
    if seed % 10 == 2:
        scalars["lr"] = [1, 0.5]  # an int learning rate: the JSON encoder's own text
    want = records.encode_step(scalars, {"param_grad_norm": np.array(norms, dtype=np.float32)})
    assert records.encode_step_floats(scalars, {"param_grad_norm": norms}) == want
    plain = records._plain_json(scalars)
    assert plain is None or plain == records._JSON_FINITE(scalars)


def _record(tmp_path, name: str, general: bool, monkeypatch, spike_at: int = 25):
    monkeypatch.undo()
    read = []
    if general:
        monkeypatch.setattr(PendingHealth, "common", lambda self: None)
    else:
        common = PendingHealth.common
        monkeypatch.setattr(PendingHealth, "common", lambda self: read.append(common(self)) or read[-1])
    seen = []
    model, opt = build_mlp()
    rec = ckptlab.Recorder(
        tmp_path / name, model, opt, step_fn=step_mlp, build_fn=build_mlp, on_anomaly=lambda n, ev: seen.append((n, ev))
    )
    with rec:
        for i, ((x, y), ids) in enumerate(mlp_batches(30)):
            if i == spike_at:
                y = y + 1e4  # a loss spike (and a gradient spike): the alert's path
            rec.step((x, y), sample_ids=ids)
    # (the spike's steps are the usual ones too; so are steps 0, 10 and 20, which measure
    # their update: before the first update of all, AdamW's state has no flags to look at)
    assert general or sum(r is not None for r in read) == 30
    assert general or sum(r is not None and r.update is not None for r in read) == 3
    return ckptlab.open_run(tmp_path / name), seen


# (how long things took, and the memory used: not the same twice; a collection's pause only on
# the steps a collection happened to fall on)
TIMES = ("time", "step_time", "ckpt_wait", "data_wait", "wall_time", "ckpt_time", "gc_time", "mem_peak")


def test_a_recording_is_the_same_either_way(tmp_path, monkeypatch):
    fast, fast_alerts = _record(tmp_path, "fast", False, monkeypatch)
    general, general_alerts = _record(tmp_path, "general", True, monkeypatch)
    a, b = fast.metrics(), general.metrics()
    assert np.array_equal(a.loss, b.loss) and np.array_equal(a.grad_norm, b.grad_norm)
    for key in ("param_grad_norm", "update_ratio", "weight_norm"):
        assert getattr(a, key).tobytes() == getattr(b, key).tobytes(), key
    assert [s.keys() - {"gc_time"} for s in a.scalars] == [s.keys() - {"gc_time"} for s in b.scalars]
    same = [{k: v for k, v in s.items() if k not in TIMES} for s in a.scalars]
    assert same == [{k: v for k, v in s.items() if k not in TIMES} for s in b.scalars]
    assert sum("update_ratio_global" in s for s in a.scalars) == 3
    assert fast.events() == general.events() and fast_alerts == general_alerts
    assert {e["kind"] for e in fast.events()} >= {"loss_spike"} and fast.events()[0]["step"] == 25


def test_the_first_steps_watch_the_optimizer_on_the_usual_path_too(tmp_path, monkeypatch):
    """A session's first steps check that its optimizer is the one that trains
    (record/health.py WATCHED_STEPS): the usual step counts them down and says it stepped, so
    the weights' norms stop being taken at every step's start after them."""
    model, opt = build_mlp()
    seen, left = [], []
    with ckptlab.Recorder(tmp_path / "run", model, opt, step_fn=step_mlp, build_fn=build_mlp, on_anomaly=None) as rec:
        probe = rec.runner.probe
        common = PendingHealth.common

        def spy(self):
            seen.append(self.watched)
            return common(self)

        monkeypatch.setattr(PendingHealth, "common", spy)
        for batch, ids in mlp_batches(6):
            rec.step(batch, sample_ids=ids)
            left.append(probe.watch)
    assert left == [2, 1, 0, 0, 0, 0]
    assert seen == ["stepped"] * 3 + [None] * 3
