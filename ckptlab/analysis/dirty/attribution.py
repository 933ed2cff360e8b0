"""The attribution stage (optional): per-row loss and gradient norm of the flagged steps, from
the replay the caller passes in as `attribute`, naming the rows that made a step go wrong even
when their content looks normal. Only reads stored data: replay is the caller's."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ckptlab.analysis.dirty.findings import SCORES, Attribute, DirtyRow, DirtyRules
from ckptlab.errors import CkptlabError
from ckptlab.run.reader import Run


def attribution_rows(
    run: Run, fn: Attribute, step_flags: list[dict], rules: DirtyRules, ranks=(None,)
) -> tuple[dict, list[DirtyRow]]:
    # A step downstream of a non-finite update fails on any batch: its rows are not replayed.
    downstream = {f["step"] for f in step_flags if "downstream_of" in f}
    retained = [f for f in step_flags if f["batch"] == "retained" and f["step"] not in downstream]
    if not retained:
        return {"status": "nothing to attribute", "steps": []}, []
    worst = sorted(
        {f["step"] for f in retained}, key=lambda s: -max((f.get("z") or math.inf) for f in retained if f["step"] == s)
    )
    out, done, failed = [], [], []
    for step in sorted(worst[: rules.max_attribute]):
        for rank in ranks:  # a distributed run: each rank's micro-batch, replayed alone (approximate)
            try:
                per_row = [_row_tuple(x) for x in (fn(run, step) if rank is None else fn(run, step, rank=rank))]
            except Exception as e:  # noqa: BLE001 - attribution is optional: the scan's findings stand
                failed.append(
                    {"step": step, "error": f"{type(e).__name__}: {e}" if not isinstance(e, CkptlabError) else str(e)}
                )
                continue
            blamed = _blame(step, per_row, rules)
            for b in blamed:
                b.rank = rank
            out += blamed
        done.append(step)
    status = {"status": "done" if done else "failed", "steps": done}
    if failed:
        status["failed"] = failed
    if len(worst) > rules.max_attribute:
        status["note"] = f"attributed the {rules.max_attribute} worst of {len(worst)} flagged steps"
    return status, out


def _row_tuple(x) -> tuple[int, Any, float, float]:
    """(row, sample_id, loss, grad_norm) from a tuple, a dict or an object with those names
    (replay's SampleBlame); a value replay could not measure (None) becomes NaN."""
    if isinstance(x, dict):
        row, sid, loss, grad = x["row"], x.get("sample_id"), x.get("loss"), x.get("grad_norm")
    elif hasattr(x, "row") and hasattr(x, "loss"):
        row, sid, loss, grad = x.row, getattr(x, "sample_id", None), x.loss, getattr(x, "grad_norm", None)
    else:
        row, sid, loss, grad = x
    return int(row), sid, _float(loss), _float(grad)


def _float(v) -> float:
    return math.nan if v is None else float(v)


def _blame(step: int, rows: list[tuple[int, Any, float, float]], rules: DirtyRules) -> list[DirtyRow]:
    """The rows that made the step go wrong. Per-sample losses are noisy (one sample's squared
    error is often 5x the median), so a row is blamed only when it stands out (>= 3x the
    median of the other rows) *and* carries >= 20% of the batch's excess over its median --
    for the loss, or for the squared gradient norm (squares add up like the batch's). An
    infinite loss or gradient is always blamed. A step where every row rose together (an LR
    spike) blames nobody."""
    loss = np.array([x for _, _, x, _ in rows], dtype=np.float64)
    grad2 = np.array([g for _, _, _, g in rows], dtype=np.float64) ** 2
    share_l, ratio_l = _stand_out(loss)
    share_g, ratio_g = _stand_out(grad2)
    out = []
    # A row whose own loss or gradient is not finite is the culprit; then the others' spread
    # among themselves is noise, not evidence.
    any_bad = any(not (math.isfinite(loss_) and math.isfinite(g)) for _, _, loss_, g in rows)
    for i, (row, sid, row_loss, g) in enumerate(rows):
        bad = not (math.isfinite(row_loss) and math.isfinite(g)) if any_bad else math.isinf(row_loss) or math.isinf(g)
        hit = not any_bad and any(
            r >= rules.attribution_ratio and sh >= rules.attribution_share
            for r, sh in ((ratio_l[i], share_l[i]), (ratio_g[i], share_g[i]))
        )
        if bad or hit:
            worst = max(ratio_l[i], math.sqrt(ratio_g[i]))
            score = SCORES["nonfinite"] if bad else SCORES["attributed"] + min(15.0, 5 * math.log10(max(worst, 1.0)))
            out.append(
                DirtyRow(
                    step,
                    row,
                    sid,
                    "attributed",
                    {
                        "loss": row_loss,
                        "grad_norm": g,
                        "loss_ratio": float(ratio_l[i]),
                        "grad_ratio": float(math.sqrt(ratio_g[i])),
                        "loss_share": float(share_l[i]),
                        "grad_share": float(share_g[i]),
                    },
                    score,
                )
            )
    return out


def _stand_out(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: its share of the batch's excess over the median, and its ratio to the median
    of the other rows. A row whose own value is not finite has a non-finite ratio and share (an
    infinite ratio to a positive median, else NaN: not a number to rank by, and not zero); so
    does every row when fewer than two are finite (nothing to compare with)."""
    finite = np.isfinite(x)
    share, ratio = np.full(len(x), math.nan), np.full(len(x), math.nan)
    if finite.sum() < 2:
        return share, ratio
    med = float(np.median(x[finite]))
    excess = np.where(finite, np.maximum(x - med, 0.0), 0.0)
    share[finite] = excess[finite] / excess.sum() if excess.sum() > 0 else 0.0
    for i in range(len(x)):
        others = np.delete(x, i)
        others = others[np.isfinite(others)]
        m = float(np.median(others)) if len(others) else math.nan
        if finite[i]:
            ratio[i] = x[i] / m if m > 0 else (math.inf if x[i] > 0 else 0.0)
        elif x[i] == math.inf and m > 0:
            ratio[i] = math.inf
    return share, ratio
