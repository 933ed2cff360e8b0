"""The README's main job: the bundled sample run replays to its cause from a fresh install."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from ckptlab.run.environment import PORTABLE, capture

SAMPLE = Path(__file__).resolve().parent.parent / "sample_ckpts" / "tinylm-nan"


def test_bundled_sample_points_at_the_empty_document():
    """The README's main job as a new user types it (a process of its own: `ckptlab replay` pins
    the CPU kernels the sample was recorded with before torch loads), bit-exact on any x86-64
    CPU with AVX2."""
    env = {k: v for k, v in os.environ.items() if k not in PORTABLE}
    done = subprocess.run(
        [sys.executable, "-m", "ckptlab", "replay", "--run", str(SAMPLE), "--step", "5432", "--json"],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(SAMPLE.parent.parent)},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(done.stdout)
    assert doc["requested_step"] == 5432 and doc["root_step"] == 5431 and doc["reproduced"]
    assert doc["origin"]["module"] == "blocks.0.attn" and doc["origin"]["op"] == "aten._softmax.default"
    assert doc["origin"]["source"].startswith("tiny_lm.py:")
    assert [(s["row"], s["sample_id"]) for s in doc["samples"]] == [(5, 25526)]
    assert "empty" in doc["samples"][0]["reason"]
    here = capture()["cpu"]
    recorded = json.loads((SAMPLE / "manifest.json").read_text())["environment"]["cpu"]
    if platform.machine() in ("x86_64", "AMD64") and here.get("model") == recorded.get("model"):
        assert doc["agreement"] == "bit-exact" and doc["bit_exact"], doc["bits_differ"]
    else:  # another CPU (an Intel Xeon, an ARM machine): the README says what to expect
        assert doc["agreement"] in ("bit-exact", "equivalent")
        if doc["agreement"] == "equivalent":
            assert doc["max_rel_deviation"] < 1e-4 and any("another environment" in b for b in doc["bits_differ"])


def test_bundled_sample_is_intact(cli):
    out = cli("info", "--run", SAMPLE, "--json")
    assert out.code == 0, out.err
    doc = out.json()
    assert all(c["verified"] for c in doc["checkpoints"])
    assert doc["steps"]["last"] == 5432
