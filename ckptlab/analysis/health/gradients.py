"""Detectors on the steps' gradients: explosions, non-finite gradients and GradScaler skips.
Explosions and non-finite gradients are the anomaly rules of analysis/anomalies.py, so report
names the steps the Recorder alarmed on (grad_spike, nonfinite_grad events)."""

from __future__ import annotations

import numpy as np

from ckptlab.analysis.anomalies import grad_explosions, nonfinite_grad
from ckptlab.analysis.health.clipping import clip_remedy
from ckptlab.analysis.health.inputs import RunData
from ckptlab.analysis.health.rules import SCALER_SKIP_SHARE, Finding, HealthRules


def gradient_explosion(d: RunData, rules: HealthRules) -> list[Finding]:
    """Steps whose gradient norm exploded (anomalies.grad_explosions): an error over the
    absolute bar; else spikes, which healthy runs show now and then at 2-4x, so only a 10x one
    or a run of them is a warning."""
    m, g = d.m, d.m.grad_norm
    exploded = grad_explosions(g, rules.grad_spike, rules.grad_explosion)
    if not exploded:
        return []
    big = [i for i, _ in exploded if g[i] > rules.grad_explosion]
    spikes = [(i, s) for i, s in exploded if s is not None]
    steps = [int(m.step[i]) for i, _ in exploded]
    worst = int(np.nanargmax(np.where(np.isfinite(g), g, -np.inf)))
    severe = max(s.ratio for _, s in spikes) >= 10 if spikes else False
    return [
        Finding(
            kind="gradient_explosion",
            severity="error" if big else ("warning" if severe or len(spikes) >= 3 else "info"),
            title=(
                f"gradient norm exceeded {rules.grad_explosion:g} at {len(big)} step(s), first {int(m.step[big[0]])}"
                if big
                else f"gradient norm spiked at {len(steps)} step(s), first {steps[0]} ({spikes[0][1].ratio:.3g}x the recent level)"
            ),
            steps=steps[:50],
            evidence={
                "max": float(g[worst]),
                "max_step": int(m.step[worst]),
                "median": float(np.nanmedian(g)),
                "spike_steps": [int(m.step[i]) for i, _ in spikes][:50],
                "over_threshold": len(big),
            },
            remedies=[
                clip_remedy(d.clipping),
                "look for bad samples at those steps: ckptlab dirty",
            ],
        )
    ]


def nonfinite_gradient(d: RunData, rules: HealthRules) -> list[Finding]:
    """Steps with non-finite gradients (anomalies.nonfinite_grad: a step the GradScaler
    skipped overflowed its scaled float16 gradients, which is routine and reported apart), and
    the parameters that had them."""
    m = d.m
    bad = np.flatnonzero(nonfinite_grad(m.nonfinite_grads, m.param_grad_norm, m.scaler_skipped))
    if not len(bad):
        return []
    counted = m.param_nonfinite[bad] != 0  # -1: non-finite but not counted
    norms = m.param_grad_norm[bad]
    cols = np.flatnonzero((counted | (~np.isfinite(norms) & ~np.isnan(norms).all(axis=1, keepdims=True))).any(axis=0))
    return [
        Finding(
            kind="nonfinite_gradient",
            severity="error",
            title=f"non-finite gradients at {len(bad)} step(s), first {int(m.step[bad[0]])}",
            steps=[int(s) for s in m.step[bad[:50]]],
            evidence={"first_step": int(m.step[bad[0]]), "elements": int(m.nonfinite_grads[bad[0]])},
            params=[m.param_names[c] for c in cols[:20]],
            remedies=[
                f"find the op that produced it: ckptlab replay --step {int(m.step[bad[0]])}",
                "with AMP: a GradScaler skips such steps; frequent ones mean a scale or a float16 overflow",
            ],
        )
    ]


def scaler_skips(d: RunData, rules: HealthRules) -> list[Finding]:
    """Steps a GradScaler skipped. A few while the scale settles are how it works; past
    SCALER_SKIP_SHARE of all steps the update is lost too often (a float16 overflow the scale
    cannot cure)."""
    m = d.m
    skipped = np.flatnonzero(m.scaler_skipped)
    if not len(skipped):
        return []
    share = len(skipped) / max(len(m), 1)
    return [
        Finding(
            kind="scaler_skips",
            severity="warning" if share > SCALER_SKIP_SHARE else "info",
            title=f"the GradScaler skipped {len(skipped)} step(s) ({share:.1%}) on overflowed gradients, first {int(m.step[skipped[0]])}",
            steps=[int(s) for s in m.step[skipped[:50]]],
            evidence={"skipped": len(skipped), "share": share, "first_step": int(m.step[skipped[0]])},
            remedies=[
                "a few skips while the scale settles are normal",
                "frequent ones: lower the GradScaler's init_scale, or train in bfloat16",
            ],
        )
    ]
