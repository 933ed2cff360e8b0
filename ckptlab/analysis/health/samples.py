"""The rows behind a non-finite loss: when the batch of the first non-finite step is recorded
and holds NaN/Inf values (dirty's static stage on that one batch, `batch_flags`), the loss
did not explode: a sample carried the NaN in. report then names the batch row and the
dataset sample id (the finding kind "nonfinite_data"), and the remedy is to skip that
sample, not to lower the learning rate or clip."""

from __future__ import annotations

from ckptlab.analysis.anomalies import EPISODE_GAP, nonfinite_grad
from ckptlab.analysis.dirty import batch_flags
from ckptlab.analysis.dirty.findings import DirtyRow
from ckptlab.analysis.health.inputs import RunData
from ckptlab.analysis.health.rules import Finding

MAX_NAMED = 5  # rows named in a title


def nonfinite_rows(d: RunData, i: int) -> tuple[int, list[DirtyRow]] | None:
    """(step, rows with non-finite values) of the batch that carried them in, for the first
    non-finite loss at metrics index `i`: that step's batch, or first the batch of a step just
    before it whose gradients went non-finite under a finite loss (a NaN at a masked position);
    None when neither batch is recorded or holds one."""
    m = d.m
    grads = nonfinite_grad(m.nonfinite_grads, m.param_grad_norm, m.scaler_skipped)
    first = next((j for j in range(max(0, i - EPISODE_GAP), i) if grads[j]), None)
    for j in ([first] if first is not None else []) + [i]:
        step = int(m.step[j])
        rows = [r for r in batch_flags(d.run, step) if r.reason == "nonfinite"]
        if rows:
            return step, rows
    return None


def nonfinite_data(d: RunData, i: int, bad: list[int], evidence: dict, step: int, rows: list[DirtyRow]) -> Finding:
    """The finding for a non-finite loss (first at metrics index `i`; `bad`: the steps with
    one) whose batch at `step` carries non-finite values in `rows`."""
    m = d.m
    ids = [r.sample_id for r in rows if r.sample_id is not None]
    named = ", ".join(_row(r) for r in rows[:MAX_NAMED]) + (
        f" (+{len(rows) - MAX_NAMED} more)" if len(rows) > MAX_NAMED else ""
    )
    values = "NaN" if any(r.evidence.get("nan") for r in rows) else "Inf"
    where = f"step {step}'s batch" if step != int(m.step[i]) else "its batch"
    first = int(m.step[i])
    return Finding(
        kind="nonfinite_data",
        severity="error",
        title=f"loss became {m.loss[i]} at step {first}: {where} carries {values} in {named}",
        steps=sorted({step, *bad[:20]}),
        evidence={
            **evidence,
            "batch_step": step,
            "rows": [
                {
                    "row": r.row,
                    "sample_id": r.sample_id,
                    "field": r.evidence.get("field"),
                    "nan": r.evidence.get("nan"),
                    "inf": r.evidence.get("inf"),
                }
                for r in rows[:20]
            ],
        },
        remedies=[
            "skip "
            + (f"sample(s) {', '.join(map(repr, ids[:MAX_NAMED]))}" if ids else "those rows")
            + ": ckptlab dirty --out skip.json, then resume with ckptlab.skip_samples(sampler, 'skip.json')",
            "fix or filter the data at its source (a NaN/Inf check in the dataset or the collate function)",
            f"resume from a checkpoint before step {step}: ckptlab rollback --before-anomaly",
            f"confirm it by replay: ckptlab replay --step {first}",
        ],
    )


def _row(r: DirtyRow) -> str:
    field = r.evidence.get("field")
    return (
        f"row {r.row}"
        + ("" if r.sample_id is None else f" (sample {r.sample_id!r})")
        + (f", field `{field}`" if field is not None else "")
    )
