"""Diagnose a run's training curves: pure functions from a recorded run to findings.

    report = diagnose(ckptlab.open_run("runs/exp1"))
    report.curve.kind                 # "fast_drop", "overfitting", "oscillation", ...
    for f in report.findings:         # most severe first
        f.severity, f.kind, f.title   # "warning", "frozen", "fc1.weight never changes ..."
        f.steps, f.evidence           # where, and the numbers that show it
        f.remedies                    # what people usually do about it

A detector is a function of the run's data (inputs.RunData) and the thresholds (rules.HealthRules)
to findings; report.DETECTORS lists them in the order the report runs them:
- loss.py: the training loss's shape (fast drop / slow drop / flat / rising), NaN/Inf, spikes
  and how fast they recover, oscillation or divergence, plateaus;
- validation.py: overfitting, found early-stopping style (earlystop.py, also used by rollback);
- crashes.py: steps whose code raised;
- gradients.py: explosion, non-finite gradients, GradScaler skips;
- layers.py: per parameter: dead or vanishing gradients, imbalance between neighbouring
  layers, frozen parameters, update ratios ||dw||/||w|| outside [1e-3, 1e-1];
- weights.py: update explosions, non-finite or exploding weights, and how far each tensor's
  value distribution drifted between the first and last retained checkpoints (snapshots.py);
- report.py: perplexity = exp(loss) alongside the loss for language models, the verdict, plots.

Non-finite values, spikes and explosions are the anomaly rules of analysis/anomalies.py, which
the Recorder and replay use too: a step one of them calls anomalous, report calls so as well.

Severities: "error" (training is broken), "warning" (likely wrong, worth acting on), "info"
(worth knowing; a healthy run may have some). A healthy run gets no warning and no error.
"""

from ckptlab.analysis.health.earlystop import EarlyStop, early_stopping, validation_series
from ckptlab.analysis.health.loss import curve_shape
from ckptlab.analysis.health.report import (
    DETECTORS,
    CurveSummary,
    HealthReport,
    PlotData,
    diagnose,
)
from ckptlab.analysis.health.rules import Finding, HealthRules

__all__ = [
    "DETECTORS",
    "CurveSummary",
    "EarlyStop",
    "Finding",
    "HealthReport",
    "HealthRules",
    "PlotData",
    "curve_shape",
    "diagnose",
    "early_stopping",
    "validation_series",
]
