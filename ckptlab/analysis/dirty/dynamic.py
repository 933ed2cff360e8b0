"""The dynamic stage: steps whose loss or gradient norm went wrong (non-finite, or a spike by
the one rule of analysis/spikes.py), each step downstream of a non-finite update marked as
such, and the rows they add to the report."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from ckptlab.analysis.anomalies import nonfinite_loss
from ckptlab.analysis.dirty.findings import (
    CORROBORATED,
    DEFAULT_RULES,
    DOWNSTREAM_PENALTY,
    SCORES,
    DirtyRow,
    DirtyRules,
)
from ckptlab.analysis.spikes import find_spikes
from ckptlab.errors import RetiredError
from ckptlab.run.reader import Run


def dynamic_flags(run: Run, rules: DirtyRules = DEFAULT_RULES, *, ids_by_step: dict | None = None) -> list[dict]:
    """Steps whose loss or gradient norm went wrong: {step, kind, value, median, z, batch,
    sample_ids} (`ids_by_step`, from a static scan, saves reading those batches again)."""
    m = run.metrics()
    retained = set(run.steps)
    out = []
    bad_loss = nonfinite_loss(m.loss, m.loss_known)  # (a loss not known is none: anomalies.py)
    for i in np.flatnonzero(bad_loss):
        out.append(
            {"step": int(m.step[i]), "kind": "nonfinite_loss", "value": float(m.loss[i]), "median": None, "z": None}
        )
    # A finite loss can hide non-finite gradients (e.g. NaN only at ignored/padded positions):
    # the weights go NaN one step later, so the step that got them is the one to look at.
    # A step a GradScaler skipped overflowed on purpose (float16 finding its scale): not a flag.
    # A step without any gradient (a loop that skipped backward) has a NaN norm that is not one.
    no_grad = (m.param_grad_norm < 0).all(axis=1) if m.param_grad_norm.shape[1] else np.zeros(len(m), dtype=bool)
    nonfinite_norm = ~np.isfinite(m.grad_norm) & ~no_grad
    bad_grads = ~bad_loss & (nonfinite_norm | (m.nonfinite_grads > 0)) & ~m.scaler_skipped
    for i in np.flatnonzero(bad_grads):
        out.append(
            {
                "step": int(m.step[i]),
                "kind": "nonfinite_grad",
                "value": float(m.grad_norm[i]),
                "median": None,
                "z": None,
            }
        )
    for kind, series, rule in (("loss_spike", m.loss, rules.loss_spike), ("grad_spike", m.grad_norm, rules.grad_spike)):
        for at, s in find_spikes(series, rule):
            out.append(
                {
                    "step": int(m.step[at]),
                    "kind": kind,
                    "value": s.value,
                    "median": s.median,
                    "z": s.z,
                    "ratio": s.ratio,
                }
            )
    _mark_downstream(out, m)
    for f in out:
        f["batch"] = "retained" if f["step"] in retained else "pruned by retention"
        if f["step"] not in retained:
            f["sample_ids"] = None
        elif ids_by_step is not None and f["step"] in ids_by_step:
            f["sample_ids"] = ids_by_step[f["step"]]
        else:
            try:
                f["sample_ids"] = run.batch(f["step"])[1]
            except RetiredError:  # a live run's retention retired it as we read
                f["batch"], f["sample_ids"] = "pruned by retention", None
    return sorted(out, key=lambda f: (f["step"], f["kind"]))


NONFINITE_KINDS = ("nonfinite_loss", "nonfinite_grad")


def _mark_downstream(flags: list[dict], m) -> None:
    """Flag `downstream_of` the first step of a streak of non-finite steps: once a step's
    optimizer applied non-finite gradients, the weights are non-finite and every step after it
    fails whatever its batch holds, until the streak ends (a step with a finite loss and
    gradients). A step whose optimizer did not step (a loop that skips the update on a NaN
    loss) leaves the weights as they were: the next step is judged on its own."""
    bad = {f["step"] for f in flags if f["kind"] in NONFINITE_KINDS}
    root: dict[int, int] = {}  # step -> the first step of its streak
    for step in sorted(bad):
        prev = step - 1
        if prev in root:
            root[step] = root[prev]
        elif prev in bad and (i := m.index(prev)) is not None and m.stepped[i]:
            root[step] = prev
    for f in flags:
        if f["kind"] in NONFINITE_KINDS and f["step"] in root:
            f["downstream_of"] = root[f["step"]]


def step_rows(step_flags: list[dict]) -> list[DirtyRow]:
    out = []
    for f in step_flags:
        ev = {k: f[k] for k in ("value", "median", "z", "ratio", "batch", "downstream_of") if f.get(k) is not None}
        ev["rows"] = len(f["sample_ids"]) if f.get("sample_ids") is not None else None
        score = SCORES[f["kind"]] + (min(10.0, math.log10(max(f["z"], 1.0))) if f.get("z") else 0.0)
        if "downstream_of" in f:  # a consequence: its root step ranks first
            score -= DOWNSTREAM_PENALTY
        out.append(DirtyRow(f["step"], None, None, f["kind"], ev, score))
    return out


def corroborate(rows: list[DirtyRow]) -> None:
    step_kinds: dict[int, list[str]] = defaultdict(list)
    for r in rows:
        if r.row is None:
            step_kinds[r.step].append(r.reason)
    for r in rows:
        if r.row is not None and step_kinds.get(r.step):
            r.score += CORROBORATED
            r.evidence["step_flags"] = sorted(set(step_kinds[r.step]))
