"""A state that was already bad when the replay began: weights that are NaN/Inf in the
checkpoint the replay starts from (a corrupt pretrained row, a fault from before the retained
window). Their `nonfinite_weight` is then no new anomaly: the fault is the first step whose
computation reads them, and the rows to name are those that first used them.

    bad = nonfinite_params(model)                   # after loading the start checkpoint
    report.start_state = describe(run, k, bad, rec) # rec: the root step's BatchRecord
"""

from __future__ import annotations

import torch

from ckptlab.analysis.batches import python_leaves, row_dim
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
    """The batch rows whose integer ids index a bad row of an embedding table."""
    rows_bad = {r for b in bad if b["embedding"] for r in b["rows"]}
    n = len(sample_ids) if sample_ids is not None else None
    if not rows_bad or not n:
        return []
    hit: set[int] = set()
    for _, leaf in python_leaves(batch):
        if not isinstance(leaf, torch.Tensor) or leaf.is_floating_point() or leaf.dtype == torch.bool:
            continue
        dim = row_dim(tuple(leaf.shape), n)
        if dim is None:
            continue
        uses = torch.isin(leaf, torch.tensor(sorted(rows_bad), dtype=leaf.dtype))
        per_row = uses.movedim(dim, 0).reshape(n, -1).any(1)
        hit |= set(torch.nonzero(per_row).flatten().tolist())
    return [{"row": r, "sample_id": sample_ids[r]} for r in sorted(hit)]
