"""report's analyses on recorded runs that each plant one pathology; a healthy run gets no alarm."""

import math

import numpy as np
import pytest

import ckptlab
from ckptlab.analysis.health import HealthRules, curve_shape, diagnose, early_stopping, system
from ckptlab.analysis.health.system import KINDS as SYSTEM_KINDS
from ckptlab.analysis.spikes import SpikeRule
from ckptlab.trackers.points import alert_text
from tests import act_models as am
from tests import models


def _record(root, name, build, step, batches, **kw):
    kw = {"ckpt_every": 50, "health_every": 5, "keep_last": 10, **kw}
    models.record_run(root / name, build, step, batches, **kw)
    return diagnose(ckptlab.open_run(root / name))


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    root = tmp_path_factory.mktemp("health")
    return {
        "healthy": _record(root, "healthy", am.build_healthy, models.step_mlp, am.regression_batches(300)),
        "overfit": _record(
            root, "overfit", am.build_overfit, models.step_mlp, am.overfit_batches(150), validate=am.overfit_validate(5)
        ),
        "high_lr": _record(root, "high_lr", am.build_high_lr, models.step_mlp, am.regression_batches(300)),
        "plateau": _record(root, "plateau", am.build_plateau, models.step_mlp, am.regression_batches(300)),
        "frozen": _record(root, "frozen", am.build_frozen, models.step_mlp, am.regression_batches(150)),
        "imbalanced": _record(root, "imbalanced", am.build_imbalanced, models.step_mlp, am.regression_batches(150)),
        "spike": _record(root, "spike", am.build_healthy, models.step_mlp, am.spiky_regression_batches(200, 150)),
        "lm": _record(root, "lm", models.build_lm, models.step_lm, models.lm_batches(120)),
    }


def alarms(report):
    """The report's alarms about the training: not those that judge the machine (system.KINDS:
    the loop's wall clock, memory), as a loaded test machine can make a tiny run's checkpoint
    writes a third of its time. tests/test_system_time.py tests those on planted delays."""
    return [f for f in report.alarms() if f.kind not in SYSTEM_KINDS]


def kinds(report, severities=("warning", "error")):
    return {f.kind for f in report.findings if f.severity in severities}


def test_healthy_run_gets_no_alarm(reports):
    r = reports["healthy"]
    assert alarms(r) == [], [f.title for f in alarms(r)]
    assert r.curve.kind == r.curve.shape == "fast_drop"
    assert r.verdict.startswith("Healthy")
    assert r.perplexity is None  # a regression, not a language model


def test_overfitting_found_with_its_best_step(reports):
    r = reports["overfit"]
    # validation logged after step i is at step i + 1; the planted run's minimum is after 30 steps
    f = next(f for f in r.findings if f.kind == "overfitting")
    assert f.evidence["best_step"] == 30
    assert f.evidence["last"] > f.evidence["best"] * 1.3
    assert f.evidence["train_loss_at_end"] < f.evidence["train_loss_at_best"]
    assert r.curve.kind == "overfitting"
    assert any("ckptlab rollback --metric val_loss" in x for x in f.remedies)


def test_noisy_validation_of_a_healthy_run_is_not_overfitting(tmp_path):
    # Validation on a fresh 32-sample batch every 10 steps: flat after step ~50, +-40% noise.
    # Its best is the lowest outlier, and the last evaluation alone sat 75% above it: that was
    # an overfitting warning on a healthy run.
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(9)

    def validate(i, model):
        if (i + 1) % 10:
            return None
        x = torch.randn(32, 8, generator=g)
        y = x[:, :1] * 0.5 + 0.1 * torch.randn(32, 1, generator=g)
        with torch.no_grad():
            return {"val_loss": F.mse_loss(model(x), y).item()}

    r = _record(tmp_path, "noisy_val", am.build_healthy, models.step_mlp, am.regression_batches(200), validate=validate)
    assert alarms(r) == [], [f.title for f in alarms(r)]
    assert [f.kind for f in r.findings if f.kind not in system.KINDS] == ["validation_plateau"]


def test_overfitting_on_a_metric_to_maximize_says_it_fell(tmp_path):
    accuracy = [0.5, 0.6, 0.7, 0.65, 0.64, 0.63]  # best at step 30, then down

    def validate(i, model):
        return {"val_acc": accuracy[i // 10]} if i % 10 == 9 else None

    batches = am.regression_batches(60)
    r = _record(
        tmp_path,
        "acc",
        am.build_healthy,
        models.step_mlp,
        batches,
        validate=validate,
        val_metric="val_acc",
        val_mode="max",
    )
    f = next(f for f in r.findings if f.kind == "overfitting")
    assert f.evidence["best_step"] == 30 and " fell " in f.title and " rose " not in f.title, f.title
    assert "--metric val_acc --mode max" in f.remedies[0]


def test_oscillation_from_a_too_high_learning_rate(reports):
    r = reports["high_lr"]
    f = next(f for f in r.findings if f.kind == "oscillation")
    assert f.severity == "warning"
    assert f.evidence["lag1_autocorrelation"] < -0.25 or f.evidence["median_update_ratio"] > 0.1
    assert r.curve.kind == "oscillation"
    assert "overfitting" not in kinds(r) and "plateau" not in kinds(r)


def test_plateau_with_its_window(reports):
    r = reports["plateau"]
    f = next(f for f in r.findings if f.kind == "plateau")
    first, last = f.steps
    assert first < 20 and 90 <= last <= 140  # the LR sits near zero for steps 0..119
    assert r.curve.kind == "plateau"


def test_frozen_layer(reports):
    r = reports["frozen"]
    f = next(f for f in r.findings if f.kind == "frozen")
    assert set(f.params) == {"fc1.weight", "fc1.bias"}
    assert "get gradients" in f.title  # it is not requires_grad=False: it is missing from the optimizer
    assert (
        f.evidence["fc1.weight"]["bit_identical_across_checkpoints"]
        and f.evidence["fc1.weight"]["update_ratio_always_0"]
    )
    assert f.evidence["fc1.weight"]["median_grad_norm"] > 0


def test_imbalanced_layer(reports):
    r = reports["imbalanced"]
    f = next(f for f in r.findings if f.kind == "gradient_imbalance")
    assert f.params == ["fc2.weight"]
    assert f.evidence["ratio"] < 1e-2
    low = next(f for f in r.findings if f.kind == "update_ratio_low")
    assert "fc2.weight" in low.params
    assert "frozen" not in kinds(r)


def test_loss_spike_and_its_recovery(reports):
    r = reports["spike"]
    f = next(f for f in r.findings if f.kind == "loss_spike")
    assert f.steps[0] == 150
    assert f.evidence["recovery"] in ("fast", "slow")
    assert f.severity == "warning"  # a 10^6 x spike is never "just noise"
    grad = next(f for f in r.findings if f.kind == "gradient_explosion")
    assert 150 in grad.steps


def test_negative_loss_is_not_rising_and_its_spike_recovers(tmp_path):
    # A loss below 0 (a log-likelihood's): the MLP's MSE - 10 falls from -9.5 to -9.99, and the
    # planted spike at 150 is back within a step. Read as if positive, -9.99 "rose" 10% above
    # -9.8 and never got back to 1.1x the median (-11): a diverging warning and an error.
    batches = am.spiky_regression_batches(200, 150)
    r = _record(tmp_path, "neg", am.build_healthy, am.step_negative, batches)
    assert r.curve.shape != "rising" and "diverging" not in kinds(r)
    f = next(f for f in r.findings if f.kind == "loss_spike")
    assert f.steps[0] == 150 and f.evidence["recovery"] == "fast", f.title
    assert f.severity == "warning" and 1e3 < f.evidence["peak"] - f.evidence["level_before"]
    assert "inf" not in f.title and "never" not in f.title
    assert curve_shape(-1.0 - np.arange(200) / 4000) == "flat"  # -1 -> -1.05: fell 5%
    assert curve_shape(-2.0 + np.arange(200) / 100) == "rising"  # -2 -> 0


def test_flat_noisy_loss_is_not_diverging(tmp_path):
    # Nothing to learn: the loss is flat at ~1 with minibatch noise (+-35%). The first 5 steps'
    # median alone sat 10% below the end on these seeds (0.61 -> 0.90): "diverging".
    for seed in (2, 8):
        r = _record(tmp_path, f"flat{seed}", am.build_healthy, models.step_mlp, am.noise_batches(100, seed=seed))
        assert r.curve.shape != "rising" and "diverging" not in kinds(r), r.verdict
    rng = np.random.default_rng(0)
    noisy_rise = (1 + np.arange(1000) / 1000) * np.exp(0.3 * rng.standard_normal(1000))
    assert curve_shape(noisy_rise) == "rising"  # a real rise, as noisy, is still one


def test_language_model_gets_perplexity(reports):
    r = reports["lm"]
    p = r.perplexity
    assert p is not None
    assert math.isclose(p.best, math.exp(r.curve.best), rel_tol=1e-9)
    assert p.last < p.first
    assert alarms(r) == []


def test_too_short_and_empty_runs(tmp_path):
    models.record_run(tmp_path / "tiny", am.build_healthy, models.step_mlp, am.regression_batches(3), ckpt_every=50)
    r = diagnose(ckptlab.open_run(tmp_path / "tiny"))
    assert r.curve.shape == "too_short" and alarms(r) == [] and r.verdict.startswith("Too few steps")
    model, opt = am.build_healthy()
    ckptlab.Recorder(tmp_path / "empty", model, opt, step_fn=models.step_mlp, build_fn=am.build_healthy).close()
    r = diagnose(ckptlab.open_run(tmp_path / "empty"))
    assert (r.curve.kind, r.findings, r.steps["recorded"]) == ("empty", [], 0)


def test_nan_explosion(tmp_path):
    def batches():
        for step, ((x, y), ids) in enumerate(am.regression_batches(40)):
            if step == 30:
                x = x.clone()
                x[0, 0] = float("nan")
            yield (x, y), ids

    models.record_run(tmp_path / "r", am.build_healthy, models.step_mlp, batches(), ckpt_every=10, health_every=5)
    r = diagnose(ckptlab.open_run(tmp_path / "r"))
    f = r.findings[0]  # the NaN came in with row 0 of the batch: data, not an explosion
    assert (f.kind, f.severity, f.evidence["first_step"]) == ("nonfinite_data", "error", 30)
    assert r.curve.kind == "nonfinite_data"
    assert [(x["row"], x["sample_id"]) for x in f.evidence["rows"]] == [(0, 30000)]
    assert any("ckptlab replay --step 30" in x for x in f.remedies)


def test_all_nan_run_is_broken_not_frozen(tmp_path):
    # The probe records the update ratio of a NaN weight as 0 (NaN > 0 is false), and NaN
    # tensors are bit-identical across checkpoints: both read as "frozen" next to the errors.
    models.record_run(
        tmp_path / "r", am.build_healthy, models.step_mlp, am.nan_batches(30), stop_on_nonfinite=False, ckpt_every=10
    )
    r = diagnose(ckptlab.open_run(tmp_path / "r"))
    assert {"nonfinite_data", "nonfinite_gradient", "nonfinite_weights"} <= kinds(r)
    assert "frozen" not in kinds(r), r.verdict


def test_zero_initialised_layer_is_not_exploding(tmp_path):
    # fc2 starts at zero (as LoRA B, adaLN-Zero): after its first AdamW update its norm is
    # ~lr * sqrt(16) = 0.04, and learning brings it to ~0.5: "grew 11.9x" was a warning.
    r = _record(tmp_path, "zero", am.build_zero_out, models.step_mlp, am.regression_batches(300))
    assert alarms(r) == [], [f.title for f in alarms(r)]


def test_exploding_weights(tmp_path):
    r = _record(tmp_path, "grow", am.build_grow, am.step_grow, am.regression_batches(100))
    f = next(f for f in r.findings if f.kind == "exploding_weights")
    assert {"fc1.weight", "fc2.weight"} <= set(f.params) and min(f.evidence["growth"].values()) >= 10
    # A matrix that starts at zero and explodes is still found (measured from its neighbours' scale).
    r = _record(tmp_path, "grow0", am.build_grow_zero_in, am.step_grow, am.regression_batches(100))
    f = next(f for f in r.findings if f.kind == "exploding_weights")
    assert "fc1.weight" in f.params


def test_validation_that_improves_after_stalling_is_not_advised_to_stop(tmp_path):
    values = [1.0, 0.8, 0.7, 0.72, 0.71, 0.73, 0.5, 0.45, 0.44]  # stalls 3 evaluations after step 30

    def validate(i, model):
        return {"val_loss": values[i // 10]} if i % 10 == 9 else None

    r = _record(tmp_path, "late", am.build_healthy, models.step_mlp, am.regression_batches(90), validate=validate)
    f = next(f for f in r.findings if f.kind == "validation_plateau")
    assert "then improved to 0.44 at step 90" in f.title, f.title
    assert not any("unlikely to help" in x for x in f.remedies) and "--patience" in f.remedies[0]
    assert f.evidence["global_best_step"] == 90


def test_verdict_grammar_for_every_shape():
    from ckptlab.analysis.health import CurveSummary
    from ckptlab.analysis.health.report import verdict

    said = {s: verdict(CurveSummary(s, s, 1.0, 0.5, 0.5, 1), []) for s in ("fast_drop", "slow_drop", "flat", "rising")}
    assert said == {
        "fast_drop": "Healthy: the loss drops fast; no problems found.",
        "slow_drop": "Healthy: the loss drops slowly; no problems found.",
        "flat": "Healthy: the loss is flat; no problems found.",
        "rising": "Healthy: the loss rises; no problems found.",
    }


def test_plots_data_is_kept_out_of_json(reports):
    from ckptlab.render.jsonout import dumps

    doc = dumps(reports["overfit"])
    assert "plots" not in doc and "loss_ema" not in doc
    assert reports["overfit"].plots.best_val_step == 30


def test_early_stopping_with_patience():
    pts = [(0, 1.0), (10, 0.8), (20, 0.7), (30, 0.75), (40, 0.72), (50, 0.71), (60, 0.65)]
    es = early_stopping(pts, patience=3)
    assert (es.best_step, es.stop_step, es.global_best_step) == (20, 50, 60)
    assert early_stopping(pts, patience=4).best_step == 60
    assert early_stopping([(0, 0.1), (5, 0.3)], mode="max", patience=1).best_step == 5
    assert early_stopping([]) is None


def test_curve_shapes():
    steps = np.arange(200)
    assert curve_shape(np.exp(-steps / 10) + 0.01) == "fast_drop"
    assert curve_shape(2.0 - steps / 200) == "slow_drop"
    assert curve_shape(np.full(200, 1.0)) == "flat"
    assert curve_shape(1.0 + steps / 100) == "rising"
    assert curve_shape(np.ones(5)) == "too_short"


def test_rules_are_settable(reports):
    run = ckptlab.open_run(reports["spike"].run)
    quiet = diagnose(run, HealthRules(loss_spike=SpikeRule(z=1e12)), weights=False)
    assert "loss_spike" not in {f.kind for f in quiet.findings}


# The Recorder's anomaly events and the report findings that name the same steps.
ANOMALY_FINDINGS = {
    "nonfinite_loss": "explosion",
    "nonfinite_grad": "nonfinite_gradient",
    "nonfinite_weight": "nonfinite_weights",
    "loss_spike": "loss_spike",
    "grad_spike": "gradient_explosion",
    "update_explosion": "update_explosion",
}


@pytest.mark.parametrize("name", ["healthy", "spike", "high_lr"])
def test_report_names_the_steps_the_recorder_called_anomalous(reports, name):
    r = reports[name]
    alarmed = {
        (e["step"], ANOMALY_FINDINGS[e["kind"]])
        for e in ckptlab.open_run(r.run).events()
        if e["kind"] in ANOMALY_FINDINGS
    }
    found = {(s, f.kind) for f in r.findings if f.kind in ANOMALY_FINDINGS.values() for s in f.steps}
    assert alarmed == found
    assert name == "healthy" or alarmed  # the planted faults were seen


@pytest.mark.parametrize("health_every", [1, 5])
def test_a_precursor_some_steps_before_the_loss_spike_is_named(tmp_path, health_every):
    # A branch switched on at step 37: AdamW's first update of it (its second moment empty) moves
    # its tiny weights ~100x; the loss is normal at 37 and spikes at 38 on an ordinary batch.
    # Whether or not step 37 measured its update ratio, the report points back to step 37.
    r = _record(
        tmp_path, "gated", am.build_gated, am.step_gated, am.gated_batches(45), health_every=health_every, ckpt_every=20
    )
    f = next(f for f in r.findings if f.kind == "precursor")
    assert (f.severity, f.evidence["loss_step"], f.params[0]) == ("warning", 38, "side.weight")
    assert f.title.startswith("side.weight got its first non-zero gradient at step 37")
    assert "1 step before the loss spiked at step 38" in f.title
    spikes = {(s["param"], s["what"], s["step"]) for s in f.evidence["spikes"]}
    if health_every == 1:  # the update itself was measured: it is listed too
        assert ("side.weight", "update", 37) in spikes
    assert all(s["step"] < 38 for s in f.evidence["spikes"])
    assert any("ckptlab replay --step 38 --from-step 20" in x for x in f.remedies)  # checkpoints 0, 20, 40
    # The Recorder said so live, in the loss spike's event (and its alert).
    spike = next(e for e in ckptlab.open_run(tmp_path / "gated").events() if e["kind"] == "loss_spike")
    assert spike["step"] == 38 and spike["precursor"]["param"] == "side.weight" and spike["precursor"]["step"] == 37
    assert alert_text("r", 38, [spike]).startswith(
        "step 38: loss spike (after side.weight got its first non-zero gradient at step 37 (exactly 0 before))"
    )


def test_a_spike_caused_by_its_own_batch_has_no_precursor(reports):
    # The spiky batch raises the loss and the gradients at the same step: nothing came before.
    assert "precursor" not in kinds(reports["spike"], ("info", "warning", "error"))
    assert "precursor" not in kinds(reports["high_lr"], ("info", "warning", "error"))
