"""A newcomer's first hour (issue #31): their own small script, a NaN planted in dataset sample
31337 (one row of one batch), gradient clipping in the loop, recorded with the Recorder; then
replay, dirty and report on it. Each says what happened in that run, and only that: the
culprit search counts only the NaN as "still faults" (not the spike a healthy one-row batch
shows against the run's history), dirty reports the NaN row's ratios as not numbers and counts
it once, and report names the sample instead of calling it an explosion to be clipped."""

import json
import shutil

import pytest

import ckptlab
from ckptlab.analysis.health import HealthRules, diagnose
from ckptlab.analysis.health.inputs import load
from tests import fault_models as fm
from tests import newcomer_models as nm


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    """The newcomer's run, recorded once: it stops at step 25, whose row 5 is sample 31337."""
    run_dir = tmp_path_factory.mktemp("newcomer") / "run"
    losses = nm.record(run_dir)
    assert len(losses) == nm.BAD_STEP + 1 and losses[-1] != losses[-1]  # NaN at the planted step
    return run_dir


# --- replay: the minimal culprit --------------------------------------------------------------------


def test_the_culprit_search_counts_only_the_nonfinite_fault(nan_run, cli):
    """Row 0 of the batch (a healthy sample from the tail) alone spikes against the run's
    batch-mean history; with its values in every position the culprit row no longer goes NaN,
    so the search goes on and finds the one feature that carries the NaN."""
    out = cli("replay", "--run", nan_run, "--step", nm.BAD_STEP, "--json")
    assert out.code == 0, out.err
    doc = out.json()
    c = doc["culprit"]
    assert c["rows"] == [nm.BAD_ROW] and c["sample_ids"] == [nm.BAD] and c["minimal"]
    assert c["positions"] == [3] and c["fields"] == ["[0]"]  # x[:, 3]; the targets are not needed
    assert "taken from a healthy row it still faults" not in c["detail"]
    assert c["transplant_fault"] is True and c["cause"] == "data alone"
    assert "position 3 of batch[0]" in doc["verdict"]


# --- dirty: the NaN row -------------------------------------------------------------------------------


def test_dirty_reports_the_nan_rows_ratios_as_not_numbers_and_counts_the_row_once(nan_run, cli, tmp_path):
    out = cli("dirty", "--run", nan_run, "--json")
    assert out.code == 0, out.err
    doc = out.json()
    blamed = [f for f in doc["flagged"] if f["reason"] == "attributed"]
    assert [(f["step"], f["row"], f["sample_id"]) for f in blamed] == [(nm.BAD_STEP, nm.BAD_ROW, nm.BAD)]
    ev = blamed[0]["evidence"]
    # json_safe's spelling of a non-finite number: not 0, which would read "no larger than the others"
    assert {k: ev[k] for k in ("loss", "loss_ratio", "grad_ratio", "loss_share", "grad_share")} == dict.fromkeys(
        ("loss", "loss_ratio", "grad_ratio", "loss_share", "grad_share"), "nan"
    )
    assert {(f["step"], f["row"]) for f in doc["flagged"] if f["row"] is not None} == {(nm.BAD_STEP, nm.BAD_ROW)}
    assert "1 suspicious row " in doc["verdict"], doc["verdict"]
    assert doc["skip_ids"] == [nm.BAD]
    assert "not written" in doc["verdict"] and "--out" in doc["verdict"]

    text = cli("dirty", "--run", nan_run, "--no-attribute")
    assert text.code == 0 and "not written" in text.out and "Skip list: 1 sample id(s)." not in text.out

    skip = tmp_path / "skip.json"
    written = cli("dirty", "--run", nan_run, "--no-attribute", "--out", skip, "--json")
    assert written.code == 0, written.err
    assert f"written to {skip}" in written.json()["verdict"]
    assert json.loads(skip.read_text())["sample_ids"] == [nm.BAD]


# --- report: the sample, not an explosion ----------------------------------------------------------------


def test_report_names_the_nan_sample_instead_of_an_explosion(nan_run, cli):
    out = cli("report", "--run", nan_run, "--json")
    assert out.code == 0, out.err
    doc = out.json()
    first = doc["findings"][0]
    assert first["kind"] == "nonfinite_data" and first["severity"] == "error"
    assert f"row {nm.BAD_ROW} (sample {nm.BAD})" in first["title"] and "NaN" in first["title"]
    assert [(r["row"], r["sample_id"], r["field"]) for r in first["evidence"]["rows"]] == [(nm.BAD_ROW, nm.BAD, "0")]
    assert nm.BAD_STEP in first["steps"]
    assert "explosion" not in {f["kind"] for f in doc["findings"]} and doc["curve"]["kind"] == "nonfinite_data"
    remedies = [r for f in doc["findings"] for r in f["remedies"]]
    assert not [r for r in remedies if "clip" in r], remedies  # the script clips; clipping is no remedy here
    assert any("skip" in r and str(nm.BAD) in r for r in first["remedies"])
    assert str(nm.BAD) in doc["verdict"]


def test_report_knows_the_script_clips_and_says_so(nan_run, tmp_path):
    from ckptlab.analysis.health.clipping import Clipping, clip_remedy, clipping

    c = clipping(ckptlab.open_run(nan_run))
    assert c == Clipping(True, "step_fn `step` calls clip_grad_norm_")
    assert "already clipped" in clip_remedy(c) and "clip them" not in clip_remedy(c)
    # Nothing recorded says (a step_fn whose source shows no clipping call): conditional.
    other = tmp_path / "run"
    shutil.copytree(nan_run, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["functions"]["step_fn"]["qualname"] = "order"  # a function of the same file that clips nothing
    (other / "manifest.json").write_text(json.dumps(manifest))
    unknown = clipping(ckptlab.open_run(other))
    assert unknown.on is None
    assert "if the gradients are not clipped yet" in clip_remedy(unknown)
    off = Clipping(False, "the Trainer's max_grad_norm is 0.0, so nothing clips (set it, e.g. to 1.0)")
    assert "; clip gradients: the Trainer's max_grad_norm is 0.0" in clip_remedy(off)


class _TrainerRun:
    """What clipping() reads of a run recorded by a Trainer integration: its batches carry
    the Trainer's clipping setting beside the inputs."""

    def __init__(self, how: dict):
        self.steps, self.manifest, self.how = [0], {}, how

    def batch(self, step):
        return {"inputs": {"x": [1.0]}, **self.how}, None


def test_the_trainer_integrations_recorded_clipping_setting_is_read():
    from ckptlab.analysis.health.clipping import clip_remedy, clipping

    on = clipping(_TrainerRun({"transformers": {"max_grad_norm": 1.0}}))
    assert on.on is True and "already clipped: the Trainer's max_grad_norm is 1.0" in clip_remedy(on)
    off = clipping(_TrainerRun({"lightning": {"gradient_clip_val": None}}))
    assert off.on is False and "clip gradients: the Trainer's gradient_clip_val is None" in clip_remedy(off)


def test_an_explosion_without_bad_data_advises_clipping_only_conditionally(run_dir):
    """A huge finite target: the gradients explode and the loss goes NaN later. No batch
    carries a NaN: an explosion; the run records no clipping, so the remedy asks whether it clips."""
    fm.record_huge_target(run_dir)
    r = diagnose(ckptlab.open_run(run_dir), weights=False, plots=False)
    explosion = next(f for f in r.findings if f.kind == "explosion")
    assert any("if the gradients are not clipped yet, clip them" in x for x in explosion.remedies)
    assert "nonfinite_data" not in {f.kind for f in r.findings}


# --- report: "learn slowly" ---------------------------------------------------------------------------


def test_a_slow_first_layer_is_said_in_the_singular_and_explained(nan_run):
    from ckptlab.analysis.health.layers import _low_ratio

    d = load(ckptlab.open_run(nan_run), HealthRules(), weights=False)
    f = _low_ratio(d, {"body.0.weight": 5e-4}, [0, 20], HealthRules())
    assert f.severity == "info"
    assert f.title == "body.0.weight learns slowly: its updates are 0.0005 of its norm per step (below 0.001)"
    assert any("fewest inputs (8)" in x for x in f.remedies)
    both = _low_ratio(d, {"body.0.weight": 5e-4, "body.2.weight": 8e-4}, [0, 20], HealthRules())
    assert both.title.startswith("body.0.weight, body.2.weight learn slowly: their updates")
