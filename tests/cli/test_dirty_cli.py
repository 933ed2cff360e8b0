"""`ckptlab dirty`: ranked table, JSON, skip-list file, settable thresholds."""

import json
import sys

import pytest

from tests import act_models as am
from tests import models


@pytest.fixture(scope="module")
def spike_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("dirtycli") / "run"
    models.record_run(
        path, am.build_healthy, models.step_mlp, am.spiky_regression_batches(80, 50), ckpt_every=20, keep_last=10
    )
    return path


@pytest.fixture(autouse=True)
def no_replay(monkeypatch):
    monkeypatch.setitem(sys.modules, "ckptlab.replayer", None)


def test_table_and_skip_list(cli, spike_run, tmp_path):
    r = cli("dirty", "--run", spike_run, "--out", tmp_path / "skip.json")
    assert r.code == 0, r.err
    assert "flagged (top 3 of 3)" in r.out and "50003" in r.out and "extreme" in r.out
    assert "attribution unavailable" in r.out
    assert "wrote" in r.err
    doc = json.loads((tmp_path / "skip.json").read_text())
    assert doc["format"] == "ckptlab-skip" and doc["sample_ids"] == [50003]


def test_json(cli, spike_run):
    doc = cli("dirty", "--run", spike_run, "--json", "--no-attribute").json()
    assert set(doc) >= {"run", "scanned", "data_info", "flagged", "steps", "attribution", "skip_ids", "verdict"}
    top = doc["flagged"][0]
    assert set(top) == {"step", "row", "sample_id", "reason", "evidence", "score", "rank"}
    assert (top["step"], top["row"], top["sample_id"]) == (50, 3, 50003)
    assert doc["attribution"] == {"status": "off"}
    assert doc["scanned"]["steps"] == 80


def test_thresholds_are_options(cli, spike_run):
    doc = cli(
        "dirty", "--run", spike_run, "--json", "--loss-z", "1e12", "--grad-z", "1e12", "--extreme-z", "1e12"
    ).json()
    assert doc["flagged"] == [] and doc["skip_ids"] == []
    assert doc["rules"]["loss_spike"]["z"] == 1e12


def test_a_damaged_run_is_scanned_then_fails(cli, spike_run, tmp_path):
    """The report covers what reads; the damage is the one error line, and the exit code says so."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(spike_run, run)
    seg = sorted((run / "batches" / "rank0").iterdir())[0]
    data = bytearray(seg.read_bytes())
    data[200] ^= 0xFF  # a flipped byte mid-segment: not a crash's torn tail
    seg.write_bytes(bytes(data))
    r = cli("dirty", "--run", run, "--json", "--no-attribute")
    assert r.code == 1 and r.json()["scanned"]["steps"] > 0
    assert r.err.strip().splitlines()[-1].startswith(f"ckptlab: error: {seg}: ") and "(corrupt file)" in r.err
