"""What one pass over the batches keeps per field (a tensor/array in a batch's nesting) for the
run-wide checks after it: `FloatField` (per-row features or summaries), `TokenField` (what a
row's ends hold, for padding and length), and how a batch splits into rows and fields."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptlab.analysis.batches import leaves, micro_rows, row_groups

TOKEN_FIELD_HINTS = ("ids", "token", "label", "target", "input")
MASK_FIELD_HINTS = ("mask",)


@dataclass
class Row:
    step: int
    row: int
    sample_id: Any
    rank: int | None = None


class FloatField:
    """Keeps per-row features (narrow fields) or per-row summaries (wide ones) for the
    run-wide robust statistics computed after the pass."""

    def __init__(self, name: str, width: int, max_features: int):
        self.name = name
        self.per_feature = width <= max_features
        self.labels = (
            [f"{name}[{i}]" for i in range(width)]
            if self.per_feature
            else [f"{name} max|x|", f"{name} mean", f"{name} std"]
        )
        self.values: list[np.ndarray] = []  # (rows, features) float64 chunks
        self.where: list[int] = []  # global row index of each chunk's first row

    def add(self, first_row: int, a: np.ndarray) -> None:
        flat = a.reshape(a.shape[0], -1).astype(np.float64, copy=False)
        if self.per_feature:
            feats = flat
        else:
            finite = np.where(np.isfinite(flat), flat, np.nan)
            with np.errstate(all="ignore"):
                feats = np.stack([np.nanmax(np.abs(finite), 1), np.nanmean(finite, 1), np.nanstd(finite, 1)], 1)
        self.values.append(feats)
        self.where.append(first_row)


class TokenField:
    """Per-row facts about a 2-D integer field, enough to decide padding and length once the
    pad id is known: the value and run length at each end of a row, and whether the row is
    one value throughout. Kept as numpy chunks, joined by `arrays()`."""

    def __init__(self, name: str):
        self.name = name
        self.chunks: list[tuple[np.ndarray, ...]] = []

    def add(self, first_row: int, flat: np.ndarray) -> None:
        B, T = flat.shape
        if T == 0:
            return
        head_n, tail_n = _run_length(flat), _run_length(flat[:, ::-1])
        self.chunks.append(
            (
                np.arange(first_row, first_row + B),
                np.full(B, T),
                flat[:, 0].astype(np.int64),
                head_n,
                flat[:, -1].astype(np.int64),
                tail_n,
                head_n == T,
            )
        )

    def arrays(self) -> dict[str, np.ndarray]:
        keys = ("row", "width", "head", "head_n", "tail", "tail_n", "constant")
        if not self.chunks:
            return {k: np.zeros(0, dtype=bool if k == "constant" else np.int64) for k in keys}
        if len(self.chunks) > 1:  # join once; later calls reuse it
            self.chunks = [tuple(np.concatenate([c[i] for c in self.chunks]) for i in range(len(keys)))]
        return dict(zip(keys, self.chunks[0]))


def _run_length(flat: np.ndarray) -> np.ndarray:
    """Length of the run of equal values at the start of each row."""
    diff = flat != flat[:, :1]
    return np.where(diff.any(1), diff.argmax(1), flat.shape[1])


def batch_parts(batch, ids) -> list[tuple[int, list[tuple[str, Any]], int]]:
    """(first row, fields, rows) of each part of a batch: each micro-batch of an accumulated
    step (gradient accumulation; rows numbered across them), else the whole batch."""
    rows = len(ids) if ids is not None else None  # (a plain list of micro-batches needs them)
    sizes = micro_rows(batch, rows)
    if sizes is None:
        fields = list(leaves(batch))
        return [(0, fields, _batch_size(fields, ids))]
    return [(first, list(leaves(part)), n) for (first, part, _), n in zip(row_groups(batch, rows), sizes)]


def _batch_size(fields: list[tuple[str, Any]], ids) -> int:
    if ids is not None:
        return len(ids)
    sizes = Counter(
        len(v) if isinstance(v, list) else v.shape[0] for _, v in fields if isinstance(v, list) or v.ndim >= 1
    )
    return sizes.most_common(1)[0][0] if sizes else 0


def is_mask(name: str) -> bool:
    last = name.rsplit(".", 1)[-1].lower()
    return any(h in last for h in MASK_FIELD_HINTS)


def is_tokens(name: str, a: np.ndarray) -> bool:
    last = name.rsplit(".", 1)[-1].lower()
    return a.ndim >= 2 or any(h in last for h in TOKEN_FIELD_HINTS)


def int_or_none(x) -> int | None:
    try:
        return int(x) if x is not None else None
    except (TypeError, ValueError):
        return None
