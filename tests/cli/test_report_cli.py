"""`ckptlab report`: terminal, JSON and a self-contained HTML page that headless Chromium
renders without errors."""

import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests import act_models as am
from tests import models


@pytest.fixture(scope="module")
def overfit_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "run"
    models.record_run(
        path,
        am.build_overfit,
        models.step_mlp,
        am.overfit_batches(120),
        ckpt_every=40,
        health_every=5,
        keep_last=5,
        validate=am.overfit_validate(5),
    )
    return path


def test_terminal_output(cli, overfit_run):
    r = cli("report", "--run", overfit_run)
    assert r.code == 0, r.err
    assert "overfitting" in r.out and "val_loss was best at step 30" in r.out
    assert "-> go back to the best checkpoint: ckptlab rollback --metric val_loss" in r.out
    assert re.search(r"loss\s+[▁▂▃▄▅▆▇█]{10,}", r.out)  # a sparkline
    assert r.out.rstrip().splitlines()[-1].startswith("verdict:")


def test_json_is_the_only_stdout(cli, overfit_run):
    r = cli("report", "--run", overfit_run, "--json")
    doc = r.json()
    assert set(doc) >= {"run", "steps", "curve", "perplexity", "findings", "verdict", "rules"}
    assert doc["curve"]["kind"] == "overfitting"
    f = next(f for f in doc["findings"] if f["kind"] == "overfitting")  # (a slow step on a busy machine may come too)
    assert set(f) == {"kind", "severity", "title", "steps", "evidence", "remedies", "params"}
    assert f["evidence"]["best_step"] == 30


def test_fail_on(cli, overfit_run):
    assert cli("report", "--run", overfit_run, "--fail-on", "warning").code == 1
    assert cli("report", "--run", overfit_run, "--fail-on", "error").code == 0


def test_all_nan_run_prints_no_numpy_warning(tmp_path):
    # numpy's "RuntimeWarning: All-NaN slice encountered" (a median of every-NaN gradient norms)
    # reached the user's terminal. Run as a user does: warnings print there, not into pytest.
    models.record_run(
        tmp_path / "r", am.build_healthy, models.step_mlp, am.nan_batches(20), stop_on_nonfinite=False, ckpt_every=10
    )
    done = subprocess.run(
        [sys.executable, "-m", "ckptlab", "report", "--run", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "RuntimeWarning" not in done.stderr, done.stderr
    assert "nonfinite_weights" in done.stdout


def test_not_a_run_is_one_line(cli, tmp_path):
    r = cli("report", "--run", tmp_path)
    assert r.code == 1 and r.err.strip().count("\n") == 0 and "not a ckptlab run" in r.err


class _Check(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.urls = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.urls += [v for k, v in attrs if k in ("src", "href", "xlink:href") and v]


def test_html_is_self_contained(cli, overfit_run, tmp_path):
    page = tmp_path / "report.html"
    r = cli("report", "--run", overfit_run, "--html", page)
    assert r.code == 0, r.err
    html = page.read_text()
    p = _Check()
    p.feed(html)
    assert "script" not in p.tags and "link" not in p.tags and "img" not in p.tags
    assert p.urls == [] and "http://" not in html and "https://" not in html
    assert p.tags.count("svg") >= 4  # loss, grad norm, update-ratio heat map, histograms
    assert "best val_loss" in html and "update ratio" in html and "Weight histograms" in html


@pytest.mark.skipif(
    shutil.which("chromium") is None, reason="needs Debian's chromium package (apt-get install chromium)"
)
def test_html_renders_in_headless_chromium(cli, overfit_run, tmp_path):
    page = tmp_path / "report.html"
    assert cli("report", "--run", overfit_run, "--html", page).code == 0
    cmd = [
        "chromium",
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
        "--dump-dom",
        page.as_uri(),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert dom.count("<svg") >= 4 and "Training report" in dom
    problems = [
        line
        for line in done.stderr.splitlines()
        if re.search(r"CONSOLE|Uncaught|net::ERR|Refused to|Failed to load", line)
    ]
    assert problems == [], problems


def test_a_damaged_run_is_reported_then_fails(cli, overfit_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(overfit_run, run)
    seg = sorted((run / "journal").glob("*.log"))[0]
    seg.with_suffix(".cols").unlink()  # (read from its summary, the records are intact: nothing to report)
    data = bytearray(seg.read_bytes())
    data[200] ^= 0xFF
    seg.write_bytes(bytes(data))
    r = cli("report", "--run", run, "--json", "--no-weights")
    assert r.code == 1 and "findings" in r.json()
    assert r.err.strip().splitlines()[-1].startswith(f"ckptlab: error: {seg}: ") and "(corrupt file)" in r.err
