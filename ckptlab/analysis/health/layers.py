"""Per-parameter detectors: gradients that are dead, vanishing or out of scale with the
neighbouring layers; parameters that never change (or are frozen on purpose); update ratios
||dw||/||w|| outside the healthy band."""

from __future__ import annotations

import math

import numpy as np

from ckptlab.analysis.batches import is_embedding
from ckptlab.analysis.health.inputs import RunData
from ckptlab.analysis.health.rules import Finding, HealthRules, few
from ckptlab.analysis.health.series import nanmedian
from ckptlab.analysis.health.snapshots import WeightSnapshot

# --- gradients --------------------------------------------------------------------------------------


def _dead(d: RunData, rules: HealthRules) -> tuple[list[int], np.ndarray]:
    """Columns whose gradient is exactly 0 in >= `dead_fraction` of the steps that had one."""
    g = d.grad_columns
    zero_frac = np.where(g.present > 0, g.zeros / np.maximum(g.present, 1), 0.0)
    return [j for j in range(len(d.m.param_names)) if zero_frac[j] >= rules.dead_fraction], zero_frac


def dead_gradient(d: RunData, rules: HealthRules) -> list[Finding]:
    names = d.m.param_names
    dead, zero_frac = _dead(d, rules)
    if not dead:
        return []
    return [
        Finding(
            kind="dead_gradient",
            severity="warning",
            title=f"{len(dead)} parameter(s) get exactly zero gradient in most steps: {few([names[j] for j in dead])}",
            steps=[],
            evidence={names[j]: {"zero_fraction": float(zero_frac[j])} for j in dead[:20]},
            params=[names[j] for j in dead],
            remedies=[
                "dead ReLUs: lower the LR, use LeakyReLU/GELU, check the init and the bias",
                "a branch cut off by a mask or a detach(): check the forward pass",
            ],
        )
    ]


def vanishing_gradient(d: RunData, rules: HealthRules) -> list[Finding]:
    """A (not dead) parameter's median gradient norm, or the global norm's median over the
    second half, below `grad_vanishing`."""
    names, g = d.m.param_names, d.m.grad_norm
    med = d.grad_norm_medians
    dead = set(_dead(d, rules)[0])
    vanishing = [
        j for j in range(len(names)) if j not in dead and math.isfinite(med[j]) and 0 < med[j] < rules.grad_vanishing
    ]
    global_med = nanmedian(g[len(g) // 2 :])  # NaN when every step's norm was NaN
    if not vanishing and not (math.isfinite(global_med) and global_med < rules.grad_vanishing):
        return []
    return [
        Finding(
            kind="vanishing_gradient",
            severity="warning",
            title=(
                f"gradients vanish (median norm < {rules.grad_vanishing:g}) for {few([names[j] for j in vanishing])}"
                if vanishing
                else f"the global gradient norm vanished (median {global_med:.3g} over the second half)"
            ),
            steps=[],
            evidence={"global_median": global_med, **{names[j]: float(med[j]) for j in vanishing[:20]}},
            params=[names[j] for j in vanishing],
            remedies=[
                "check normalization (LayerNorm/BatchNorm) and residual connections",
                "use a better initialization (Kaiming/Xavier) and non-saturating activations",
                "check for a loss scaled to ~0 or a detached graph",
            ],
        )
    ]


def gradient_imbalance(d: RunData, rules: HealthRules) -> list[Finding]:
    """A middle weight matrix whose per-element gradient (norm / sqrt(numel), so sizes compare)
    is orders of magnitude off the geometric mean of its two neighbours in parameter order.
    Only weight matrices are compared: biases and norm gains naturally differ."""
    names, shapes = d.m.param_names, d.shapes
    med = d.grad_norm_medians
    mats = [j for j, n in enumerate(names) if len(shapes.get(n, ())) >= 2 and math.isfinite(med[j]) and med[j] > 0]
    rms = {j: med[j] / math.sqrt(max(1, math.prod(shapes[names[j]]))) for j in mats}
    out = []
    for a, j, b in zip(mats, mats[1:], mats[2:]):
        ratio = rms[j] / math.sqrt(rms[a] * rms[b])
        if rules.imbalance <= ratio <= 1 / rules.imbalance:
            continue
        direction = "below" if ratio < 1 else "above"
        out.append(
            Finding(
                kind="gradient_imbalance",
                severity="warning",
                title=f"{names[j]}'s gradient is {abs(math.log10(ratio)):.1f} orders of magnitude {direction} its neighbours ({names[a]}, {names[b]})",
                steps=[],
                evidence={"ratio": ratio, "rms_grad": rms[j], "neighbours_rms_grad": [rms[a], rms[b]]},
                params=[names[j]],
                remedies=[
                    "check that layer's scale: a multiplier in the forward, a mis-scaled init or a per-layer LR",
                    "add normalization between layers; check for a residual branch that is cut",
                ],
            )
        )
    return out


# --- parameters that do not move ------------------------------------------------------------------


def _frozen(d: RunData) -> dict[int, dict]:
    """Trainable columns whose update ratio is exactly 0 at every (>= 2) measured step, or that
    are bit-identical in the first and last read checkpoints, with the evidence."""
    m = d.m
    rows, ur = d.update_ratios
    unchanged = _unchanged_between(d.snapshots) if len(d.snapshots) >= 2 else set()
    frozen: dict[int, dict] = {}
    for j, name in enumerate(m.param_names):
        if not d.trainable.get(name, True):
            continue
        col = ur[:, j][np.isfinite(ur[:, j])] if len(rows) else np.array([])
        zero_ratio = len(col) >= 2 and bool(np.all(col == 0))
        if zero_ratio or name in unchanged:
            grads = m.param_grad_norm[:, j]
            grads = grads[np.isfinite(grads) & (grads >= 0)]  # -1: no gradient that step
            frozen[j] = {
                "update_ratio_always_0": zero_ratio,
                "measured_steps": int(len(col)),
                "bit_identical_across_checkpoints": name in unchanged,
                "median_grad_norm": float(np.median(grads)) if len(grads) else None,
            }
    return frozen


def _unchanged_between(snapshots: list[WeightSnapshot]) -> set[str]:
    a, b = snapshots[0], snapshots[-1]
    if a.step == b.step:
        return set()
    return {  # NaN stays NaN: a tensor non-finite in both is broken, not frozen
        n for n, d in a.digests.items() if d and b.digests.get(n) == d and not a.stats[n].nonfinite
    }


def frozen(d: RunData, rules: HealthRules) -> list[Finding]:
    names = d.m.param_names
    found = _frozen(d)
    if not found:
        return []
    gets_grad = any((ev["median_grad_norm"] or 0) > 0 for ev in found.values())
    return [
        Finding(
            kind="frozen",
            severity="warning",
            title=f"{few([names[j] for j in found])} never change"
            + (" although they get gradients" if gets_grad else ""),
            steps=[],
            evidence={names[j]: ev for j, ev in list(found.items())[:20]},
            params=[names[j] for j in found],
            remedies=[
                "are they in the optimizer? (build the optimizer after the model is complete; check param groups)",
                "a param group with lr=0 or a scheduler that reached 0",
                "if frozen on purpose, set requires_grad=False (then no gradient is computed either)",
            ],
        )
    ]


def requires_grad_false(d: RunData, rules: HealthRules) -> list[Finding]:
    off = [n for n, t in d.trainable.items() if not t]
    if not off:
        return []
    return [
        Finding(
            kind="requires_grad_false",
            severity="info",
            title=f"{len(off)} parameter(s) have requires_grad=False (frozen on purpose?): {few(off)}",
            params=off,
            remedies=["if they should train, set requires_grad=True and add them to the optimizer"],
        )
    ]


# --- the update-ratio band --------------------------------------------------------------------------


def _main_phase(m, measured: np.ndarray, group: int | None) -> np.ndarray:
    """The measured rows of the main LR phase of parameter group `group` (its learning rate
    >= half its peak), or with `group` None (not known) of the largest rate of every group."""
    if group is not None and group < m.lr.shape[1]:
        lr = m.lr[:, group]
    else:
        lr = np.fmax.reduce(m.lr, axis=1) if m.lr.size else np.ones(len(m))  # (NaN where none is known)
    peak = np.nanmax(lr) if np.isfinite(lr).any() else 1.0
    main = measured[np.nan_to_num(lr[measured], nan=peak) >= 0.5 * peak]
    return main if len(main) >= 2 else measured


def _main_phase_ratios(d: RunData, rules: HealthRules) -> tuple[np.ndarray, dict, dict]:
    """(rows of the main LR phase, {name: median ratio} above the band, ... below it), over the
    weight matrices that are not frozen. The main phase: steps with the LR >= half its peak
    (warm-up and final decay legitimately move the ratio out of the band), each parameter's
    by its own group's learning rate (groups, and several optimizers, warm up and decay on
    their own schedules), where the run says which group holds it."""
    m, (measured, ur) = d.m, d.update_ratios
    main = _main_phase(m, measured, None)
    lo, hi = rules.update_ratio_band
    frozen_cols, low, high = _frozen(d), {}, {}
    phases: dict[int | None, np.ndarray] = {}  # group -> its main phase's rows among `measured`
    for j, name in enumerate(m.param_names):
        if j in frozen_cols or len(d.shapes.get(name, ())) < 2:
            continue
        group = d.optimizers.of_parameter.get(name)
        if group not in phases:
            phases[group] = np.isin(measured, _main_phase(m, measured, group))
        col = ur[phases[group], j]
        col = col[np.isfinite(col)]
        med = float(np.median(col)) if len(col) else math.nan
        if med > hi:
            high[name] = med
        elif 0 < med < lo:
            low[name] = med
    return main, high, low


def update_ratio_band(d: RunData, rules: HealthRules) -> list[Finding]:
    """Median ||dw||/||w|| per weight matrix over the main learning-rate phase, outside
    `update_ratio_band`."""
    if not len(d.update_ratios[0]):
        return []
    main, high, low = _main_phase_ratios(d, rules)
    lo, hi = rules.update_ratio_band
    steps = [int(d.m.step[main[0]]), int(d.m.step[main[-1]])] if len(main) else []
    out = []
    if high:
        worst = max(high.values())
        out.append(
            Finding(
                kind="update_ratio_high",
                severity="error" if worst > 1.0 else "warning",
                title=f"updates change {few(sorted(high, key=high.__getitem__, reverse=True))} by {worst:.2g} of their norm per step (above {hi:g})",
                steps=steps,
                evidence={"median_update_ratio": high, "band": [lo, hi]},
                params=sorted(high),
                remedies=[
                    "lower the learning rate (for these layers: a separate param group)",
                    "add warm-up; check weight decay is not huge",
                ],
            )
        )
    if low:
        out.append(_low_ratio(d, low, steps, rules))
    return out


def _low_ratio(d: RunData, low: dict[str, float], steps: list[int], rules: HealthRules) -> Finding:
    lo, hi = rules.update_ratio_band
    worst = min(low.values())
    severe = any(v < lo / 10 and not is_embedding(n) for n, v in low.items())
    names = sorted(low, key=low.__getitem__)
    one = len(names) == 1
    # The layer with the fewest inputs starts with the largest weights (init ~ 1/sqrt(fan_in)):
    # an optimizer step of the same size is a smaller share of it (Adam's is ~lr per element).
    fan_in = {n: math.prod(sh[1:]) for n, sh in d.shapes.items() if len(sh) >= 2}
    widest = [n for n in names if fan_in.get(n) is not None and fan_in[n] == min(fan_in.values())]
    return Finding(
        kind="update_ratio_low",
        severity="warning" if severe else "info",
        title=f"{few(names)} {'learns' if one else 'learn'} slowly: {'its' if one else 'their'} updates are "
        f"{worst:.2g} of {'its' if one else 'their'} norm per step (below {lo:g})",
        steps=steps,
        evidence={"median_update_ratio": low, "band": [lo, hi]},
        params=sorted(low),
        remedies=[
            "raise the learning rate (for these layers: a separate param group)",
            "check the layer's gradient (vanishing? imbalanced?) and its weight scale",
            "embeddings update only the rows in the batch, so their ratio is naturally lower",
        ]
        + (
            [
                f"{few(widest)}: the layer with the fewest inputs ({fan_in[widest[0]]}) starts with the largest "
                "weights, so the same step moves it least; below the band by less than 10x, as here, that is "
                "information on a run whose loss falls, not a fault"
            ]
            if widest and not severe
            else []
        ),
    )
