"""A state that was already bad when the replay began: weights that are NaN/Inf in the
checkpoint the replay starts from (a corrupt pretrained row, a fault from before the retained
window). Their `nonfinite_weight` is then no new anomaly: the fault is the first step whose
computation reads them, and the rows to name are those that first used them.

    bad = nonfinite_params(model)                   # after loading the start checkpoint
    found = new_anomalies(kinds, bad)               # a replayed step's anomalies, less theirs
    report.start_state = describe(run, k, bad, batch, sample_ids)  # of the root step
"""

from __future__ import annotations

import numpy as np
import torch

from ckptlab.analysis.batches import batch_rows, leaves, micro_row, row_dim, row_groups
from ckptlab.analysis.dirty.fields import is_mask
from ckptlab.run.reader import Run
from ckptlab.training.wrappers import unwrap

MAX_ROWS = 8  # rows of a table named per parameter


def nonfinite_params(model: torch.nn.Module) -> list[dict]:
    """[{"parameter", "count", "rows", "embedding"}] for every parameter holding NaN/Inf
    (rows: the first dimension's indices that hold them, for a table of two or more dims)."""
    model = unwrap(model)  # the model's own names
    tables = {f"{n}.weight" if n else "weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    out = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            bad = ~torch.isfinite(p.detach())
            count = int(bad.sum())
            if not count:
                continue
            rows = torch.nonzero(bad.reshape(bad.shape[0], -1).any(1)).flatten().tolist() if p.dim() >= 2 else []
            out.append({"parameter": name, "count": count, "rows": rows[:MAX_ROWS], "embedding": name in tables})
    return out


def new_anomalies(kinds: list[str], bad: list | bool) -> list[str]:
    """A replayed step's anomalies (their kinds) that are news when the replay began from `bad`
    weights: not their non-finite norms, which every step from that state shows, faulty or not
    (the fault is a non-finite loss or gradient: the weights' NaN reached the computation)."""
    return [k for k in kinds if not (bad and k == "nonfinite_weight")]


def describe(run: Run, k: int, bad: list[dict], batch, sample_ids) -> dict:
    """What the report says of a start state with `bad` weights (see the module doc)."""
    return {
        "checkpoint": k,
        "nonfinite": [{key: b[key] for key in ("parameter", "count", "rows")} for b in bad],
        "first_recorded": first_recorded(run, k),
        "used_by": used_by(bad, batch, sample_ids),
    }


def first_recorded(run: Run, k: int) -> int | None:
    """The first step at or before `k` where the Recorder saw a weight go non-finite (its
    `nonfinite_weight` events: weights are measured every `health_every` steps), if any."""
    steps = [int(e["step"]) for e in run.events() if e.get("kind") == "nonfinite_weight" and int(e["step"]) <= k]
    return min(steps, default=None)


def used_by(bad: list[dict], batch, sample_ids) -> list[dict]:
    """The batch rows whose integer ids index a bad row of an embedding table, as replay's
    `samples` name them: [{"row", "sample_id", "micro_batch"}]. In a step recorded as
    micro-batches (analysis/batches.py) each micro-batch's leaves hold its own rows: `row` is
    the row within `micro_batch` (None for a plain batch). A mask field (named so, as dirty
    reads masks) holds no ids: its 0s and 1s would name every padded row for a bad row 0 or 1."""
    rows_bad = sorted({r for b in bad if b["embedding"] for r in b["rows"]})
    n = batch_rows(batch, sample_ids)
    if not rows_bad or not n:
        return []
    hit: set[int] = set()
    for first, part, k in row_groups(batch, n):
        for path, a in leaves(part):
            dim = row_dim(a.shape, k) if isinstance(a, np.ndarray) and a.dtype.kind in "iu" else None
            if dim is None or is_mask(path):
                continue
            per_row = np.isin(a, rows_bad).swapaxes(0, dim).reshape(k, -1).any(1)
            hit |= {first + int(r) for r in np.flatnonzero(per_row)}
    out = []
    for r in sorted(hit):
        m, row = micro_row(batch, r, n) or (None, r)
        out.append({"row": row, "sample_id": sample_ids[r] if sample_ids is not None else None, "micro_batch": m})
    return out
