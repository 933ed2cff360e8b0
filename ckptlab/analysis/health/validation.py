"""The validation detector: overfitting, or a validation metric that only stopped improving,
found early-stopping style (earlystop.py, shared with rollback)."""

from __future__ import annotations

import math

import numpy as np

from ckptlab.analysis.health.earlystop import EarlyStop
from ckptlab.analysis.health.inputs import RunData
from ckptlab.analysis.health.rules import Finding, HealthRules
from ckptlab.analysis.health.series import nanmedian


def overfitting(d: RunData, rules: HealthRules) -> list[Finding]:
    """Validation turned up (early stopping) and really rose: where it ended (the median of
    the last `patience` evaluations, so one noisy point does not decide) sits >= 2% above its
    best and 4x its noise above it. The best of many noisy evaluations is their low outlier:
    a flat validation loss that bounces +-5% ends 2% above it most of the time. The noise is the
    robust std of one evaluation, from the differences of successive ones after the best
    (their median taken out, so a steady rise is not counted as noise). Overfitting also needs
    the training loss to have kept falling; validation that did not rise is a plateau (info)."""
    stop = d.stop
    if stop is None or stop.stop_step is None:
        return []
    sign = 1.0 if stop.mode == "min" else -1.0
    after = np.array([v for s, v in d.val if s >= stop.best_step], dtype=np.float64)
    end = float(np.median(after[-stop.patience :])) if len(after) else stop.last_value
    diffs = np.diff(after)
    noise = 1.4826 * float(np.median(np.abs(diffs - np.median(diffs)))) / math.sqrt(2) if len(diffs) >= 2 else 0.0
    rise = sign * (end - stop.best_value) / max(abs(stop.best_value), 1e-12)
    if rise < rules.overfit_rise or sign * (end - stop.best_value) < rules.overfit_noise * noise:
        return [_validation_plateau(stop, end, noise)]
    train_best = nanmedian(d.m.loss[d.m.window(stop.best_step - 10, stop.best_step)])
    train_end = nanmedian(d.m.loss[d.m.window(stop.last_step - 20, stop.last_step)])
    if not (math.isfinite(train_best) and math.isfinite(train_end) and train_end < train_best):
        return []
    return [
        Finding(
            kind="overfitting",
            severity="warning",
            title=(
                f"{stop.metric} was best at step {stop.best_step} ({stop.best_value:.4g}) and "
                f"{'rose' if stop.mode == 'min' else 'fell'} {rise:.0%} to {end:.4g} while the training loss kept falling"
            ),
            steps=[stop.best_step, stop.last_step],
            evidence={
                "best_step": stop.best_step,
                "best": stop.best_value,
                "last_step": stop.last_step,
                "last": stop.last_value,
                "end": end,
                "noise": noise,
                "rise": rise,
                "train_loss_at_best": train_best,
                "train_loss_at_end": train_end,
                "patience": stop.patience,
                "stopped_at": stop.stop_step,
            },
            remedies=[
                f"go back to the best checkpoint: ckptlab rollback --metric {stop.metric} --mode {stop.mode}",
                "stop earlier (early stopping), or add regularization: weight decay, dropout, data augmentation",
                "more (or more varied) training data, or a smaller model",
            ],
        )
    ]


def _validation_plateau(stop: EarlyStop, end: float, noise: float) -> Finding:
    """Validation stopped improving without rising. It may have stalled for `patience`
    evaluations and then beaten that best: then training on did help, and early stopping with
    this patience would have stopped too soon."""
    assert stop.stop_step is not None, "overfitting() returns early when patience never ran out"
    sign = 1.0 if stop.mode == "min" else -1.0
    later = sign * (stop.global_best_value - stop.best_value) < 0 and stop.global_best_step > stop.stop_step
    title = f"{stop.metric} stopped improving after step {stop.best_step} ({stop.best_value:.4g})"
    if later:
        title = (
            f"{stop.metric} stalled for {stop.patience} evaluations after step {stop.best_step} "
            f"({stop.best_value:.4g}), then improved to {stop.global_best_value:.4g} at step {stop.global_best_step}"
        )
    return Finding(
        kind="validation_plateau",
        severity="info",
        title=title,
        steps=[stop.best_step],
        evidence={
            "best_step": stop.best_step,
            "best": stop.best_value,
            "last": stop.last_value,
            "end": end,
            "noise": noise,
            "patience": stop.patience,
            "global_best_step": stop.global_best_step,
            "global_best": stop.global_best_value,
        },
        remedies=(
            [
                f"early stopping with patience {stop.patience} would have stopped too soon: use a larger "
                "patience (ckptlab report/rollback --patience N)"
            ]
            if later
            else ["training longer is unlikely to help; stop, or lower the learning rate"]
        ),
    )
