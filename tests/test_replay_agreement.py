"""Replays whose bits differ from the record (issue #27): recorded under one ATen CPU capability
and replayed under another, or with ulp-level noise in step_fn. Each says how closely it agrees
with the record (bit-exact, equivalent, diverged) and why the bits differ, reproduces a real
fault as reproduced, and never calls a fault that exists only through the noise reproduced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptlab
from ckptlab.replayer import agreement
from ckptlab.run.environment import NOT_RECORDED, compare, pinned
from tests import fault_models as fm
from tests import noise_models as nm

ROOT = Path(__file__).resolve().parent.parent
OTHER_CAPABILITY = "default"  # any x86 CPU runs it; this one records with its own (AVX2/AVX512)


def record_transient(run_dir) -> fm.Expected:
    """A weight set to NaN between steps 23 and 24, outside step_fn (SGD: its window's bits move
    with the CPU capability)."""
    model, opt = fm.build_sgd_mlp()
    with ckptlab.Recorder(run_dir, model, opt, step_fn=fm.step_plain, build_fn=fm.build_sgd_mlp, ckpt_every=10) as rec:
        for s in range(30):
            try:
                rec.step(fm._xy(s), sample_ids=fm.ids(s))
            except ckptlab.NonFiniteLoss:
                break
            if s == 23:
                with torch.no_grad():
                    model.fc1.weight[3, 3] = float("nan")
    return fm.Expected(24, 24, None, [])


@pytest.fixture(scope="module")
def other_cpu(tmp_path_factory):
    """Three runs recorded here, each replayed (`ckptlab replay --json`, in parallel) by a process
    whose ATen CPU capability is another: {name: (Expected, its JSON)}."""
    if torch.backends.cpu.get_cpu_capability() == OTHER_CAPABILITY.upper():
        pytest.skip("this CPU has no vector capability beyond the default")
    root = tmp_path_factory.mktemp("capability")
    runs = {
        "data": fm.record_huge_target(root / "data"),
        "optimizer": fm.record_lr_spike(root / "optimizer"),
        "transient": record_transient(root / "transient"),
    }
    env = {**os.environ, "ATEN_CPU_CAPABILITY": OTHER_CAPABILITY, "PYTHONPATH": str(ROOT)}
    procs = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ckptlab",
                "replay",
                "--run",
                str(root / name),
                "--step",
                str(exp.symptom),
                "--json",
                "--no-counterfactuals",  # the root step, its rows and the origin's kind come before them
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for name, exp in runs.items()
    }
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-2000:]
        out[name] = (runs[name], json.loads(stdout))
    return out


def _equivalent_because_of_the_cpu(doc, *, may_be_bit_exact: bool = False) -> bool:
    """The replay under another ATen capability names it, and agrees within round-off: whether
    its bits move depends on which of the model's kernels ATen vectorizes on this CPU (the data
    and transient runs' did on an AMD EPYC, not on an Intel Xeon with AMX, where MKL computes
    what matters), so `may_be_bit_exact` accepts bit-exact there. True when equivalent."""
    assert {"what": "ATen CPU capability", "recorded": torch.backends.cpu.get_cpu_capability(), "here": "DEFAULT"} in (
        doc["environment_diff"]
    )
    if may_be_bit_exact and doc["agreement"] == "bit-exact":
        assert doc["deterministic"] and doc["max_rel_deviation"] in (0, None)
        return False
    assert doc["agreement"] == "equivalent" and doc["deterministic"] is False
    assert 0 < doc["max_rel_deviation"] < 1e-4
    assert any("ATen CPU capability" in why for why in doc["bits_differ"])
    return True


@pytest.mark.parametrize("kind", ["data", "optimizer"])
def test_a_fault_replayed_on_another_cpu_capability_is_reproduced_and_equivalent(other_cpu, kind):
    exp, doc = other_cpu[kind]
    assert doc["reproduced"] and doc["root_step"] == exp.step and doc["origin"]["kind"] == exp.kind
    assert [s["sample_id"] for s in doc["samples"]] == exp.sample_ids
    if _equivalent_because_of_the_cpu(doc, may_be_bit_exact=kind == "data"):
        assert doc["noise_check"]["robust"] and doc["diverged_at"] is None
        assert "numerically equivalent to the record, not bit-exact" in doc["verdict"]
        assert "ATen CPU capability" in doc["verdict"]
    assert "diverged" not in doc["verdict"]


def test_a_transient_replayed_on_another_cpu_capability_is_still_transient(other_cpu):
    exp, doc = other_cpu["transient"]
    assert not doc["reproduced"] and doc["root_step"] == exp.step
    if _equivalent_because_of_the_cpu(doc, may_be_bit_exact=True):
        assert "numerically equivalent to the record before it" in doc["verdict"]
    assert doc["divergence"]["replays_agree"] and doc["noise_check"] is None
    assert "outside the recorded computation" in doc["verdict"]


def test_ulp_noise_in_step_fn_is_measured_and_the_fault_reproduced(run_dir, cli, monkeypatch):
    exp = nm.record_noisy_nan_row(run_dir)
    # As on `--device cuda`: the step is replayed twice more without deterministic algorithms.
    monkeypatch.setattr(agreement, "_replays_on_gpu", lambda inv: True)
    doc = cli("replay", "--run", run_dir, "--step", exp.symptom, "--json").json()
    assert doc["run_to_run_without_deterministic"]["replays_agree"] is False
    assert torch.are_deterministic_algorithms_enabled() is False  # replay's own settings came back
    assert doc["reproduced"] and doc["root_step"] == exp.step and doc["origin"]["kind"] == "data"
    assert [s["sample_id"] for s in doc["samples"]] == exp.sample_ids
    assert doc["agreement"] == "equivalent" and doc["environment_diff"] == []  # the same machine
    rr = doc["run_to_run"]
    assert not rr["replays_agree"] and rr["first_nondeterministic_op"]["op"] == "aten.lift_fresh.default"
    assert "nondeterministic kernels" in doc["bits_differ"][0]
    assert "equivalent" in doc["verdict"] and "nondeterministic" in doc["verdict"] and "diverged" not in doc["verdict"]
    out = cli("replay", "--run", run_dir, "--step", exp.symptom).out
    assert "equivalent, not bit-exact" in out and "largest relative deviation" in out
    assert "bits differ" in out and "diverged" not in out


def test_a_fault_at_the_edge_of_overflow_is_not_reported_as_reproduced(run_dir, cli):
    exp = nm.record_edge_of_overflow(run_dir)
    doc = cli("replay", "--run", run_dir, "--step", exp.symptom, "--json").json()
    assert doc["reproduced"] is False and doc["root_step"] == exp.step
    noise = doc["noise_check"]
    assert not noise["robust"] and 0 < noise["faulted"] < noise["replays"]
    assert "down: healthy" in noise["perturbations"]
    assert "only through round-off noise, so it is not reproduced" in doc["verdict"]


def test_a_run_recorded_without_its_environment_says_so():
    assert compare(None, {}, gpu=False) == NOT_RECORDED
    here = {"cpu": {"capability": "AVX2"}, "torch": {"version": "2.13.0"}}
    assert compare({"cpu": {"capability": "AVX512"}, "torch": {"version": "2.13.0"}}, here, gpu=False) == [
        {"what": "ATen CPU capability", "recorded": "AVX512", "here": "AVX2"}
    ]


def test_info_shows_where_the_run_was_recorded(other_cpu, cli):
    exp, doc = other_cpu["data"]
    out = cli("info", "--run", doc["run"], "--no-verify")
    assert out.code == 0, out.err
    assert "recorded on" in out.out and f"ATen CPU capability {torch.backends.cpu.get_cpu_capability()}" in out.out
    env = cli("info", "--run", doc["run"], "--json", "--no-verify").json()["environment"]
    assert env["cpu"]["capability"] == torch.backends.cpu.get_cpu_capability() and "torch" in env


def test_portable_cpu_must_come_before_torch_and_replay_pins_what_it_recorded():
    with pytest.raises(ckptlab.RecordError, match="before torch is imported") as e:
        ckptlab.portable_cpu()  # torch is loaded here: too late, and it says how to launch instead
    assert "ATEN_CPU_CAPABILITY=avx2" in (e.value.hint or "")
    env = {
        "cpu": {"capability_forced": "avx2"},
        "deterministic": {"mkl_cbwr": "AVX2,STRICT", "onednn_max_cpu_isa": None},
    }
    assert pinned(env) == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT"}
    assert pinned({"cpu": {"capability_forced": "avx2; rm -rf /"}}) == {}  # a crafted manifest pins nothing
