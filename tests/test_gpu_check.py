"""scripts/gpu_check.py, the prepared check for a CUDA machine: without CUDA it says so and
exits 0; with --cpu it runs every check at a tiny size, which is what is tested here."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent.parent / "scripts" / "gpu_check.py"


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.setenv("CKPTLAB_GPU_CHECK_CFG", "")  # restored after the test
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # the Recorder finds build/step by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message is for machines without CUDA")
def test_without_cuda_it_says_so_and_exits_0(gpu_check, capsys):
    assert gpu_check.main([]) == 0
    assert "no CUDA device is present" in capsys.readouterr().out


def test_the_cpu_run_passes_every_check_and_prints_one_json_line(gpu_check, tmp_path, capsys):
    assert gpu_check.main(["--cpu", "--steps", "15", "--block", "5", "--run-dir", str(tmp_path / "run")]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures["ok"] and all(figures["checks"].values())
    assert figures["planted"]["step"] == 12 and figures["root_step"] == 12
    assert figures["named_samples"][0] == figures["planted"]["sample_id"]
    assert figures["nonfinite_raised"] == {"step": 12, "during_step": 13}  # one step late
    assert figures["replay_deterministic"] and figures["replay_bit_exact"] == 2  # steps 10, 11
    assert figures["recorded_equals_bare"] and figures["overhead_ratio_median"] > 0
