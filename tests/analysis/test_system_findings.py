"""The time and memory findings (analysis/health/system.py) on step records made up to show
each rule's edge: a checkpoint's and a GC pause's slow step, a throughput that falls and stays
down (and one that only dips), memory near its limit, rising towards it, swapped out; the MFU."""

import numpy as np
import pytest

from ckptlab.analysis.health.inputs import RunData
from ckptlab.analysis.health.rules import HealthRules
from ckptlab.analysis.health.system import input_bound, memory_pressure, mfu, slow_steps, throughput_drop
from ckptlab.run.columns import Columns
from ckptlab.run.reader import _metrics

RULES = HealthRules()
GiB = 2**30


class FakeRun:
    def __init__(self, manifest=None, validated=()):
        self.manifest = manifest or {}
        self.validated = validated

    def validation(self):
        return [{"step": s, "metrics": {"val_loss": 1.0}} for s in self.validated]

    def batch(self, step):
        raise KeyError(step)


def data(records: list[dict], manifest=None, validated=()) -> RunData:
    """RunData of step records (their system fields, as the Recorder writes them), with
    validations recorded at the steps `validated`."""
    rows = [(i, {"loss": 1.0, "grad_norm": 1.0, "step_time": 0.01, **r}, {}) for i, r in enumerate(records)]
    return RunData(
        FakeRun(manifest, validated), _metrics([], Columns.from_records(rows, [])), "val_loss", "min", [], None, []
    )


def steady(n: int, **over) -> list[dict]:
    """n usual steps of 10 ms (1 ms of it waiting for data), 8 rows of 128 tokens, 1 GiB."""
    out = [{"data_wait": 0.001, "wall_time": 0.011, "samples": 8, "tokens": 1024, "mem_peak": GiB} for _ in range(n)]
    del out[0]["data_wait"]
    out[0]["mem_limit"] = 16 * GiB
    for step, fields in over.items():
        out[int(step[1:])].update(fields)
    return out


def test_a_checkpoint_and_a_gc_pause_are_the_causes_of_their_slow_steps():
    d = data(
        steady(
            40, s10={"wall_time": 0.5, "ckpt_time": 0.49}, s20={"wall_time": 0.2, "gc_time": 0.19, "step_time": 0.199}
        )
    )
    (f,) = slow_steps(d, RULES)
    causes = {s["step"]: s["cause"] for s in f.evidence["steps"]}
    assert causes == {10: "checkpoint", 20: "gc"} and f.severity == "warning"
    assert f.evidence["lost_s"] == pytest.approx(0.5 + 0.2 - 2 * 0.011)
    assert any("gc.freeze" in r for r in f.remedies) and any("ckpt_every" in r for r in f.remedies)


def test_an_unexplained_slow_step_or_a_validation_is_information_and_no_data_wait():
    d = data(
        steady(40, s10={"wall_time": 0.5, "step_time": 0.499}, s20={"wall_time": 3.0, "data_wait": 2.99}),
        validated=[20],
    )
    (f,) = slow_steps(d, RULES)
    assert {s["step"]: s["cause"] for s in f.evidence["steps"]} == {10: "compute", 20: "validation"}
    assert any(r.endswith("ckptlab replay --step 10 --profile") for r in f.remedies)  # whose slowness is it?
    assert f.severity == "info"  # (most often the machine's other load; an evaluation is time well spent)
    assert input_bound(d, RULES) == []  # the evaluation's 3 s are no data wait
    d = data(steady(40, s20={"wall_time": 3.0, "data_wait": 2.99}))
    (f,) = input_bound(d, RULES)
    assert f.evidence["share"] == pytest.approx((2.99 + 38 * 0.001) / (3.0 + 38 * 0.011), abs=1e-3)
    assert f.severity == "warning"  # (79 ms a step on average)
    d = data(steady(40, **{f"s{i}": {"data_wait": 0.005, "wall_time": 0.015} for i in range(1, 40)}))
    assert input_bound(d, RULES)[0].severity == "info"  # a third of the time, but 5 ms a step


def test_a_step_only_a_little_slower_or_the_first_step_is_not_slow():
    d = data(steady(40, s0={"wall_time": 5.0}, s10={"wall_time": 0.03}, s11={"wall_time": 0.02}))
    assert slow_steps(d, RULES) == []  # 0: a session's first; 10: 2.7x; 11: < 20 ms more
    assert input_bound(d, RULES) == []  # 1 ms of 11


def test_throughput_that_falls_and_stays_down_names_its_first_step_and_what_grew():
    slower = {f"s{i}": {"wall_time": 2.1, "data_wait": 1.1} for i in range(60, 100)}  # from 1.1 s a step
    d = data(steady(100, **{f"s{i}": {"wall_time": 1.1} for i in range(60)}, **slower))
    (f,) = throughput_drop(d, RULES)
    assert f.steps == [60] and f.evidence["rate"] == "tokens_per_s"
    assert f.evidence["ratio"] == pytest.approx(1.1 / 2.1) and f.evidence["lasted_s"] == pytest.approx(84.0)
    assert "data_wait grew most" in f.title
    # the same fall for 40 steps of 21 ms: a busy moment of the host, under a minute
    d = data(steady(100, **{f"s{i}": {"wall_time": 0.021, "data_wait": 0.011} for i in range(60, 100)}))
    assert throughput_drop(d, RULES) == []


def test_a_dip_that_recovers_is_no_drop():
    d = data(steady(100, **{f"s{i}": {"wall_time": 0.03} for i in range(40, 55)}))
    assert throughput_drop(d, RULES) == []


def test_memory_near_its_limit_rising_towards_it_and_swapped_out():
    near = data(steady(30, s17={"mem_peak": int(15 * GiB)}))
    (f,) = memory_pressure(near, RULES)
    assert f.steps == [17] and f.evidence["share"] == pytest.approx(15 / 16) and "94%" in f.title
    leak = data(steady(100, **{f"s{i}": {"mem_peak": GiB + i * 2**25} for i in range(100)}))
    (f,) = memory_pressure(leak, RULES)
    assert f.evidence["bytes_per_step"] == pytest.approx(2**25) and f.evidence["full_at_step"] == 15 * 32
    swapped = data(steady(30, s3={"swap": 2**29}))
    (f,) = memory_pressure(swapped, RULES)
    assert f.steps == [3] and "512.0 MB" in f.title
    assert memory_pressure(data(steady(100)), RULES) == []


def test_mfu_with_the_flops_per_token_given():
    d = data(steady(20), manifest={"environment": {"gpu": {"name": "NVIDIA H100 80GB HBM3"}}})
    assert mfu(d, RULES) == []  # (not asked for)
    (f,) = mfu(d, HealthRules(flops_per_token=6e9))
    assert f.evidence["mfu"] == pytest.approx(1024 / 0.011 * 6e9 / 989e12)
    (f,) = mfu(data(steady(20)), HealthRules(flops_per_token=6e9))  # the CPU: no known peak
    assert "mfu" not in f.evidence and "--peak-flops" in f.title
    (f,) = mfu(data(steady(20)), HealthRules(flops_per_token=6e9, peak_flops=1e12))
    assert f.evidence["mfu"] == pytest.approx(1024 / 0.011 * 6e9 / 1e12)
    assert np.isfinite(f.evidence["achieved_flops"])
