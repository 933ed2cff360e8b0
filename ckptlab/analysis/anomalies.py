"""What makes a step faulty: one rule for the Recorder (events while training) and replay
(finding the root step), so both call the same steps anomalous.

A step is anomalous when its loss, a gradient or (when measured) a weight is non-finite; when
its loss or gradient norm spikes (analysis/spikes.py); or when its update moves the weights by
more than UPDATE_EXPLOSION of their norm (measured every `health_every` steps while recording,
every step near the fault while replaying).

A step a GradScaler skipped (`scaler_skipped`: its gradients overflowed, the update was not
applied and the scale backed off) is not anomalous for its gradients: that is how float16
training finds its scale. Its loss still counts: a non-finite loss is a fault whatever the
scaler does (backing off the scale cannot fix a forward pass that overflows).
"""

from __future__ import annotations

import math

import numpy as np

from ckptlab.analysis.spikes import GRAD_RULE, LOSS_RULE, SpikeDetector

# A weight tensor set that moves by more than half its own norm in one step is exploding
# (healthy training moves ~1e-3..1e-2 of it per step; see report's update-ratio band).
UPDATE_EXPLOSION = 0.5
# Anomalous steps at most this far apart belong to one fault episode: after a real root the
# damage shows step after step (huge or non-finite weights), while isolated spikes that
# recovered are not the cause of a later NaN.
EPISODE_GAP = 3


def detectors() -> dict[str, SpikeDetector]:
    return {"loss": SpikeDetector(LOSS_RULE), "grad": SpikeDetector(GRAD_RULE)}


def step_anomalies(h, dets: dict[str, SpikeDetector]) -> list[dict]:
    """The anomalies of one step's health (a training.health.StepHealth), as events {kind, value, ...};
    feeds the step to the spike detectors."""
    events = []
    if not math.isfinite(h.loss):
        events.append({"kind": "nonfinite_loss", "value": h.loss})
    if not h.scaler_skipped and (h.nonfinite_grads or not np.isfinite(h.param_grad_norm).all()):
        events.append({"kind": "nonfinite_grad", "value": h.nonfinite_grads})
    if h.weight_norm is not None and not np.isfinite(h.weight_norm).all():
        events.append({"kind": "nonfinite_weight", "value": int((~np.isfinite(h.weight_norm)).sum())})
    for kind, det, value in (("loss_spike", dets["loss"], h.loss), ("grad_spike", dets["grad"], h.grad_norm)):
        spike = det.check(value)
        if spike is not None:
            events.append({"kind": kind, "value": value, "median": spike.median, "z": spike.z})
    if h.update_ratio_global is not None and h.update_ratio_global > UPDATE_EXPLOSION:
        events.append({"kind": "update_explosion", "value": h.update_ratio_global})
    return events


def episode_start(anomalies: dict[int, list[str]], step: int) -> int:
    """The first step of the run of anomalous steps (gaps <= EPISODE_GAP) ending at `step`."""
    start = step
    for s in sorted((s for s in anomalies if s < step), reverse=True):
        if start - s > EPISODE_GAP:
            break
        start = s
    return start
