"""The static stage: every retained batch, row by row, field by field, in one pass
(`StaticScan.add`): non-finite values, empty rows, token ids out of range, and each row's
content hash; then (`finish`) the run-wide checks of `checks` over what the pass kept."""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from typing import Any

import numpy as np

from ckptlab.analysis.batches import embedding_tables
from ckptlab.analysis.dirty.checks import (
    Flag,
    duplicate_flags,
    extreme_flags,
    length_flags,
    merge_same_row,
    pad_id,
    padding_flags,
)
from ckptlab.analysis.dirty.fields import FloatField, Row, TokenField, batch_parts, int_or_none, is_mask, is_tokens
from ckptlab.analysis.dirty.findings import SCORES, DirtyRow, DirtyRules
from ckptlab.errors import CkptlabError
from ckptlab.run.reader import Run


class StaticScan:
    """One pass over the batches (`add`, a step at a time), then the run-wide checks (`finish`)."""

    def __init__(self, run: Run, rules: DirtyRules, info: dict):
        self.run, self.rules, self.info = run, rules, info
        self.rows: list[Row] = []
        self.n_rows = 0
        self.field_names: set[str] = set()
        self.floats: dict[str, FloatField] = {}
        self.tokens: dict[str, TokenField] = {}
        self.strings: dict[str, list[tuple[int, int]]] = defaultdict(list)  # field -> (row, length)
        self.flags: list[Flag] = []  # found during the pass
        self.hashes: dict[bytes, int] = {}
        self.dupes: list[tuple[int, int]] = []  # (row, first row with that content)
        self.notes: list[str] = []
        self.vocab = int_or_none(info.get("vocab_size"))
        self.vocab_source = "data_info" if self.vocab is not None else None
        if self.vocab is None:
            self.vocab = next(iter(embedding_tables(run.manifest)), None)
            self.vocab_source = "inferred from the embedding table" if self.vocab is not None else None
        self.ignore_index = int(info.get("ignore_index", rules.ignore_index))
        self.info_used: dict = {}
        self.by_reference = False

    def add(self, step: int, rank: int | None = None) -> None:
        try:
            batch, ids = self.run.batch(step, rank or 0)
        except CkptlabError as e:
            self.notes.append(
                f"step {step}{'' if rank is None else f' (rank {rank})'}: batch unreadable ({e}); skipped"
            )
            return
        if batch is None and not self.by_reference:  # stored by reference: the ids, no content
            self.by_reference = True
            self.notes.append(
                "some batches were stored by reference (the Recorder's batch_fn): their content is not "
                "in the run, so only their sample ids are checked"
            )
        parts = batch_parts(batch, ids)
        B = len(ids) if ids is not None else sum(n for _, _, n in parts)
        if B == 0:
            return
        first = self.n_rows
        for r in range(B):
            self.rows.append(Row(step, r, ids[r] if ids is not None and r < len(ids) else None, rank))
        self.n_rows += B
        for offset, fields, n in parts:
            self._content(fields, first + offset, n)

    def _content(self, fields: list[tuple[str, Any]], first: int, B: int) -> None:
        """The checks of each field with one entry per row, and each row's content hash; the
        rows are `first`, `first + 1`, ... among all scanned rows."""
        content: list[np.ndarray] = []  # per field: (B, bytes) -- a row's content is its bytes in every field
        for name, value in fields:
            if isinstance(value, list):
                if len(value) != B:
                    continue
                self.field_names.add(name)
                self._strings(name, first, value)
                digests = b"".join(hashlib.blake2b(str(v).encode(), digest_size=16).digest() for v in value)
                content.append(np.frombuffer(digests, dtype=np.uint8).reshape(B, 16))
                continue
            if value.ndim == 0 or value.shape[0] != B:
                continue
            self.field_names.add(name)
            self._array(name, first, value)
            content.append(np.ascontiguousarray(value).reshape(B, -1).view(np.uint8))
        if content:
            rows = np.concatenate(content, 1) if len(content) > 1 else content[0]
            for r in range(B):
                key = hashlib.blake2b(rows[r].tobytes(), digest_size=16).digest()
                seen = self.hashes.setdefault(key, first + r)
                if seen != first + r:
                    self.dupes.append((first + r, seen))

    def _strings(self, name, first, value):
        for r, s in enumerate(value):
            text = s.encode() if isinstance(s, str) else s
            self.strings[name].append((first + r, len(text)))
            if not text.strip():
                self.flags.append((first + r, "empty", {"field": name}))

    def _array(self, name: str, first: int, a: np.ndarray) -> None:
        B = a.shape[0]
        rows = a.reshape(B, -1)
        kind = a.dtype.kind
        if kind == "f":
            bad = ~np.isfinite(rows)
            counts = bad.sum(1)
            for r in np.flatnonzero(counts):
                vals = rows[r][bad[r]]
                self.flags.append(
                    (
                        first + int(r),
                        "nonfinite",
                        {
                            "field": name,
                            "count": int(counts[r]),
                            "nan": int(np.isnan(vals).sum()),
                            "inf": int(np.isinf(vals).sum()),
                            "first_index": int(np.argmax(bad[r])),
                        },
                    )
                )
            field_ = self.floats.get(name)
            if field_ is None:
                field_ = self.floats[name] = FloatField(name, rows.shape[1], self.rules.max_features)
            field_.add(first, rows)
        elif kind in "iu":
            self._ints(name, first, a, rows)
        elif kind == "b" and is_mask(name) and rows.shape[1] > 1:
            for r in np.flatnonzero(~rows.any(1)):
                self.flags.append((first + int(r), "empty", {"field": name, "mask_sum": 0}))

    def _ints(self, name: str, first: int, a: np.ndarray, rows: np.ndarray) -> None:
        if is_mask(name):
            if rows.shape[1] > 1:
                for r in np.flatnonzero(rows.sum(1) == 0):
                    self.flags.append((first + int(r), "empty", {"field": name, "mask_sum": 0}))
            return
        neg = (rows < 0) & (rows != self.ignore_index)
        high = rows >= self.vocab if self.vocab is not None and is_tokens(name, a) else np.zeros_like(neg)
        for r in np.flatnonzero(neg.any(1) | high.any(1)):
            bad = rows[r][neg[r] | high[r]]
            self.flags.append(
                (
                    first + int(r),
                    "out_of_range",
                    {
                        "field": name,
                        "count": int(len(bad)),
                        "min": int(bad.min()),
                        "max": int(bad.max()),
                        "vocab_size": self.vocab,
                        "vocab_source": self.vocab_source,
                    },
                )
            )
        if a.ndim >= 2 and rows.shape[1] >= 2:
            tf = self.tokens.get(name)
            if tf is None:
                tf = self.tokens[name] = TokenField(name)
            tf.add(first, rows)  # (B, T)

    def ids_by_step(self) -> dict[int, list]:
        out: dict[int, list] = defaultdict(list)
        for r in self.rows:
            if not r.rank:  # rank 0's (or the only) batch: what step flags point at
                out[r.step].append(r.sample_id)
        return dict(out)

    def finish(self) -> list[DirtyRow]:
        """The flags of the pass and of the run-wide checks, as scored rows (one per row and reason)."""
        tokens = list(self.tokens.values())
        pad, pad_source = pad_id(self.info, tokens)
        self.info_used = {
            "pad_id": pad,
            "pad_source": pad_source,
            "vocab_size": self.vocab,
            "vocab_source": self.vocab_source,
            "ignore_index": self.ignore_index,
        }
        padding = padding_flags(tokens, pad)
        padded = {g for g, _, _ in padding}
        duplicates, notes = duplicate_flags(self.rows, self.dupes, padded)
        self.notes += notes
        flags = [
            *self.flags,
            *padding,
            *length_flags(tokens, self.strings, pad, padded, self.rules),
            *extreme_flags(self.floats.values(), self.rules),
            *duplicates,
        ]
        return self._scored(flags)

    def pass_flags(self) -> list[DirtyRow]:
        """The flags of the pass alone (what each batch shows by itself: non-finite values,
        empty rows, token ids out of range), as scored rows, without the run-wide checks."""
        return self._scored(self.flags)

    def _scored(self, flags: list[Flag]) -> list[DirtyRow]:
        out = []
        for g, reason, ev in flags:
            row = self.rows[g]
            score = SCORES[reason] + (min(20.0, math.log10(max(ev.get("z", 1.0), 1.0))) if reason == "extreme" else 0.0)
            out.append(DirtyRow(row.step, row.row, row.sample_id, reason, ev, score, row.rank))
        return merge_same_row(out)
