"""Row blame: what is wrong with each row of the root step's batch, and what each row does
alone through the step.

    found = data_rows(root)   # {"nonfinite" | "absurd" | "empty" | "out_of_range": {row: why}}
    alone = per_row(root)     # {row: StepHealth of the step on that row alone}

and the judgements over the rows alone (`dominant_rows`, `nonfinite_alone`) and over the sample
ids (`repeated_sample`) that origin.py blames rows with.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ckptlab.analysis.batches import batch_rows, flat_layouts, python_leaves, row_dim, row_groups, select_rows
from ckptlab.errors import CkptlabError
from ckptlab.numbers import LOSS_NOT_KNOWN, value
from ckptlab.replayer.rootstep import RootStep
from ckptlab.run.reader import Run
from ckptlab.training.health import StepHealth

# A row is "absurd" when its largest |value| is this many times the run's typical row maximum
# for the same field (median over the retained batches).
ABSURD_RATIO = 1e3
# A row dominates a step when its own gradient norm is this many times the median row's.
DOMINANT_ROW_RATIO = 10.0
# The ignore_index of PyTorch's cross-entropy (and Hugging Face's label padding): a row whose
# targets are all this value has nothing to train on, and a mean over it is 0/0.
IGNORE_INDEX = -100


def data_rows(root: RootStep) -> dict[str, dict[int, str]]:
    """What is wrong with each row's content, by category: "nonfinite" values, "absurd"
    values (against the run's own typical row maximum per field), "empty" rows (all
    padding, when the run's data_info names pad_id), token ids "out_of_range"."""
    found: dict[str, dict[int, str]] = {"nonfinite": {}, "absurd": {}, "empty": {}, "out_of_range": {}}
    if not root.rows:
        return found
    info = root.inv.run.manifest.get("data_info") or {}
    pad, vocab = info.get("pad_id"), info.get("vocab_size")
    ignore = info.get("ignore_index", IGNORE_INDEX)
    typical = _typical_row_absmax(root.inv.run, root.root)
    for first, path, flat in _row_leaves(root.rec.batch, root.rows):
        if not flat.is_floating_point():
            for row in range(first, first + flat.shape[0]):
                if pad is not None and flat.shape[1] and bool((flat[row - first] == pad).all()):
                    found["empty"].setdefault(row, f"batch{path} is empty (all padding, id {pad})")
                elif pad != ignore and flat.shape[1] > 1 and bool((flat[row - first] == ignore).all()):
                    found["empty"].setdefault(row, f"batch{path} is empty (every target is {ignore}, the ignore_index)")
                ids = flat[row - first][flat[row - first] != ignore]  # an ignored label is not a token id
                if vocab is not None and ids.numel() and (int(ids.max()) >= vocab or int(ids.min()) < 0):
                    found["out_of_range"].setdefault(row, f"batch{path} has token ids outside [0, {vocab})")
            continue
        flat = flat.float()
        bad = (~torch.isfinite(flat)).sum(dim=1)
        finite = torch.where(torch.isfinite(flat), flat.abs(), torch.zeros_like(flat))
        absmax = finite.max(dim=1).values if flat.shape[1] else torch.zeros(flat.shape[0])
        for i in range(flat.shape[0]):
            row = first + i
            if int(bad[i]):
                found["nonfinite"].setdefault(row, f"{int(bad[i])} non-finite value(s) in batch{path}")
            elif path in typical and typical[path] > 0 and float(absmax[i]) > ABSURD_RATIO * typical[path]:
                found["absurd"].setdefault(
                    row,
                    f"batch{path} reaches |x|={float(absmax[i]):.3g}, {float(absmax[i]) / typical[path]:.3g}x the run's typical {typical[path]:.3g}",
                )
    return found


def per_row(root: RootStep) -> dict[int, StepHealth]:
    """Each row alone through the step: its own loss and gradient norm. The user's code may
    refuse one row (BatchNorm in training mode needs two): callers run it through
    `root.attempt`, which reports that."""
    return {row: root.step(select_rows(root.rec.batch, [row], root.rows)) for row in range(root.rows)}


def _typical_row_absmax(run: Run, step: int, max_batches: int = 32) -> dict[str, float]:
    """Median per-row max |value| per float field, over retained batches near `step`."""
    steps = [s for s in run.steps if s != step]
    steps = sorted(steps, key=lambda s: abs(s - step))[:max_batches]
    per_field: dict[str, list[float]] = {}
    for s in steps:
        try:
            batch, ids = run.batch(s)
        except CkptlabError:
            continue
        for _, path, flat in _row_leaves(batch, batch_rows(batch, ids), of_any_rows=True):
            if flat.is_floating_point() and flat.numel():
                flat = flat.float()
                finite = torch.where(torch.isfinite(flat), flat.abs(), torch.zeros_like(flat))
                per_field.setdefault(path, []).extend(finite.max(dim=1).values.tolist())
    return {k: float(np.median(v)) for k, v in per_field.items() if v}


def _row_leaves(batch, rows: int | None, *, of_any_rows: bool = False):
    """(first row, path, tensor as (rows, -1)) for each non-boolean tensor leaf with one entry
    per row (`of_any_rows`: of any first dimension): along dimension 0, or 1 for a
    sequence-first `(T, n, ...)` leaf, or flattened from one (analysis/batches.py's
    `flat_layouts`); micro-batch by micro-batch when the batch records an accumulated step;
    paths are within the micro-batch."""
    for first, part, n in row_groups(batch, rows):
        flat = flat_layouts(part, n) if n and not of_any_rows else {}
        for path, leaf in python_leaves(part):
            if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or leaf.dtype == torch.bool:
                continue
            leaf = leaf.detach()
            dim = row_dim(tuple(leaf.shape), n) if n else None
            if of_any_rows or dim == 0:
                yield first, path, leaf.reshape(leaf.shape[0], -1)
            elif dim == 1 and n:
                yield first, path, leaf.movedim(1, 0).reshape(n, -1)
            elif n and leaf.shape[0] in flat:
                how, t = flat[leaf.shape[0]]
                rows_first = leaf.reshape(t, n, -1).movedim(1, 0) if how == "seq" else leaf.reshape(n, t, -1)
                yield first, path, rows_first.reshape(n, -1)


def dominant_rows(rows: dict[int, StepHealth]) -> dict[int, float]:
    if len(rows) < 2:
        return {}
    norms = {r: h.grad_norm for r, h in rows.items()}
    finite = [v for v in norms.values() if math.isfinite(v)]
    med = float(np.median(finite)) if finite else 0.0
    out = {}
    for r, v in norms.items():
        if not math.isfinite(v) or (med > 0 and v > DOMINANT_ROW_RATIO * med):
            out[r] = v / med if med > 0 and math.isfinite(v) else math.inf
    return out if len(out) < len(rows) / 2 else {}


def repeated_sample(ids, rows: int | None) -> dict[int, str]:
    """The rows of one sample id that fills more than half of the batch (a sampler or collation
    bug): no row stands out from the others, yet that one sample drives the whole update."""
    if ids is None or not rows or rows < 3 or len(ids) != rows:
        return {}
    counts: dict = {}
    for sid in ids:
        counts[sid] = counts.get(sid, 0) + 1
    sid, n = max(counts.items(), key=lambda kv: kv[1])
    if n <= rows // 2:
        return {}
    return {r: f"sample {sid} fills {n} of the batch's {rows} rows" for r in range(rows) if ids[r] == sid}


def nonfinite_alone(rows: dict[int, StepHealth]) -> dict[int, str]:
    """The rows whose step alone has a non-finite loss or gradient norm while most rows' is
    finite: the culprits, however `step_fn` splits or reduces the batch."""
    bad = {r: h for r, h in rows.items() if h.loss_nonfinite or not math.isfinite(h.grad_norm)}
    if not bad or len(bad) > len(rows) // 2:
        return {}
    return {
        r: f"alone through the step, its loss is {value(h.loss, LOSS_NOT_KNOWN)} and gradient norm "
        f"{value(h.grad_norm)} (the other rows' are finite)"
        for r, h in bad.items()
    }
