"""Find dirty data in a recorded run, for a skip list on resume.

    report = scan(ckptlab.open_run("runs/exp1"), attribute=attribute_rows)  # static + dynamic + attribution
    for r in report.flagged:                           # most suspicious first
        r.step, r.row, r.sample_id, r.reason, r.evidence
    write_skip_list(report, "skip.json")
    sampler = ckptlab.skip_samples(sampler, "skip.json")   # on resume: those ids never come back

Three stages, each usable alone:
1. static: every retained batch, row by row, field by field (a "field" is one tensor/array in
   the batch's nesting, e.g. `ids` or `0`): non-finite values; all-padding or empty rows;
   token ids out of range; values extreme against the run's own robust statistics (per
   feature for narrow fields, per row summary for wide ones); length outliers; the same
   content seen under another sample id (a duplicate).
2. dynamic: the step health (loss and gradient-norm spikes by the one spike rule in
   analysis/spikes.py, non-finite losses), mapped to their steps and batches.
3. attribution (optional): for flagged steps, per-row loss and gradient norm from the
   function passed as `attribute` (`ckptlab.replayer.attribute_rows(run, step[, rank=])`, which
   replays the step row by row), naming the rows that caused a spike even when their content
   looks normal. This module only reads stored data; replay is the caller's to pass in.

Ranking: each reason has a base score (non-finite 100 ... length outlier 20); a row flagged by
content in a step that also spiked gains 15, since two independent signals agree.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptlab.analysis.batches import batch_rows, embedding_tables, leaves, micro_rows, row_groups
from ckptlab.analysis.spikes import GRAD_RULE, LOSS_RULE, SpikeRule, find_spikes
from ckptlab.errors import CkptlabError
from ckptlab.run import skiplist
from ckptlab.run.reader import Run

# attribute(run, step[, rank=r]) -> [(row, sample_id, loss, grad_norm) | {"row": ...} | SampleBlame]
Attribute = Callable[..., Iterable[Any]]

# Base scores: how sure a reason alone makes us that a row is bad.
SCORES = {
    "nonfinite": 100.0,
    "out_of_range": 90.0,
    "nonfinite_loss": 85.0,
    "nonfinite_grad": 85.0,
    "attributed": 80.0,
    "extreme": 70.0,
    "loss_spike": 60.0,
    "grad_spike": 55.0,
    "all_padding": 50.0,
    "empty": 50.0,
    "duplicate": 30.0,
    "length": 20.0,
}
CORROBORATED = 15.0  # a content flag in a step whose loss/gradient also went wrong
DOWNSTREAM_PENALTY = 50.0  # a step that failed because an earlier update made the weights non-finite
# Reasons whose rows go into the skip list. Length outliers are reported but kept: long or
# short documents are usually legitimate.
SKIP_REASONS = frozenset(SCORES) - {"length"}
TOKEN_FIELD_HINTS = ("ids", "token", "label", "target", "input")
MASK_FIELD_HINTS = ("mask",)


@dataclass(frozen=True)
class DirtyRules:
    extreme_z: float = 10.0  # robust z (median/MAD) a value must exceed to be "extreme"
    length_z: float = 6.0  # robust z of a row's length ...
    length_ratio: float = 4.0  # ... and >= 4x shorter/longer than the median length
    max_features: int = 64  # per-feature statistics for fields up to this many values per row
    ignore_index: int = -100  # a negative label that is not out of range (cross_entropy's default)
    loss_spike: SpikeRule = LOSS_RULE
    grad_spike: SpikeRule = GRAD_RULE
    attribution_ratio: float = 3.0  # a row is to blame at >= 3x the other rows' median loss (or squared grad norm) ...
    attribution_share: float = 0.2  # ... carrying >= 20% of the batch's excess over its median
    max_attribute: int = 20  # flagged steps replayed for attribution, worst first


@dataclass
class DirtyRow:
    step: int
    row: int | None  # None: the whole batch (a step flag without a row to blame)
    sample_id: Any
    reason: str
    evidence: dict
    score: float
    rank: int | None = None  # distributed runs: whose micro-batch (None: one process, or a step flag)


@dataclass
class DirtyReport:
    run: str
    scanned: dict  # steps, rows, fields, seconds, batches_per_s
    data_info: dict  # pad_id / vocab_size used, and where they came from
    rules: DirtyRules
    flagged: list[DirtyRow]  # ranked, most suspicious first
    steps: list[dict]  # dynamic flags: {step, kind, value, median, z, batch}
    attribution: dict  # {"status": "done" | "unavailable" | "off" | "nothing to attribute", ...}
    skip_ids: list  # sample ids a resumed run should skip
    notes: list[str] = field(default_factory=list)
    verdict: str = ""


# --- per-field accumulators (one pass over the batches) -------------------------------------------


@dataclass
class _Row:
    step: int
    row: int
    sample_id: Any
    rank: int | None = None


class _FloatField:
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


class _TokenField:
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


# --- the scan --------------------------------------------------------------------------------------


def scan(
    run: Run,
    rules: DirtyRules = DirtyRules(),
    *,
    attribute: Attribute | None = None,
    data_info: dict | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> DirtyReport:
    """Static and dynamic scans, and attribution of the flagged steps when `attribute` (a
    per-row replay such as `ckptlab.replayer.attribute_rows`) is given."""
    if isinstance(attribute, bool):  # the flag of older versions: say what to pass instead
        raise CkptlabError("scan(attribute=...) takes a function such as ckptlab.replayer.attribute_rows, or None")
    t0 = time.perf_counter()
    info = {**(run.manifest.get("data_info") or {}), **(data_info or {})}
    static = _StaticScan(run, rules, info)
    steps = run.steps
    ranks = run.ranks if run.world_size > 1 else [None]  # a distributed run: every rank's batches
    work = [(step, rank) for rank in ranks for step in (steps if rank is None else run.steps_of(rank))]
    for i, (step, rank) in enumerate(work):
        static.add(step, rank)
        if progress is not None:
            progress(i + 1, len(work))
    flagged = static.finish()
    seconds = time.perf_counter() - t0
    step_flags = dynamic_flags(run, rules, ids_by_step=static.ids_by_step())
    flagged += _step_rows(step_flags)
    attribution = {"status": "off"}
    if attribute is not None:
        attribution, rows = _attribution(run, attribute, step_flags, rules, ranks)
        flagged += rows
    _corroborate(flagged)
    flagged.sort(key=lambda r: (-r.score, r.step, -1 if r.row is None else r.row, r.reason))
    report = DirtyReport(
        run=str(run.path),
        scanned={
            "steps": len(steps),
            "first": steps[0] if steps else None,
            "last": steps[-1] if steps else None,
            "rows": static.n_rows,
            "fields": sorted(static.field_names),
            "seconds": seconds,
            "batches_per_s": len(steps) / seconds if seconds > 0 else None,
        },
        data_info=static.info_used,
        rules=rules,
        flagged=flagged,
        steps=step_flags,
        attribution=attribution,
        skip_ids=[],
        notes=static.notes,
    )
    report.skip_ids = skip_ids(report)
    report.verdict = _verdict(report)
    return report


class _StaticScan:
    def __init__(self, run: Run, rules: DirtyRules, info: dict):
        self.run, self.rules, self.info = run, rules, info
        self.rows: list[_Row] = []
        self.n_rows = 0
        self.field_names: set[str] = set()
        self.floats: dict[str, _FloatField] = {}
        self.tokens: dict[str, _TokenField] = {}
        self.strings: dict[str, list[tuple[int, int]]] = defaultdict(list)  # field -> (row, length)
        self.flags: list[tuple[int, str, dict]] = []  # (global row, reason, evidence)
        self.hashes: dict[bytes, int] = {}
        self.dupes: list[tuple[int, int]] = []  # (row, first row with that content)
        self.notes: list[str] = []
        self.vocab = _int_or_none(info.get("vocab_size"))
        self.vocab_source = "data_info" if self.vocab is not None else None
        if self.vocab is None:
            self.vocab = next(iter(embedding_tables(run.manifest)), None)
            self.vocab_source = "inferred from the embedding table" if self.vocab is not None else None
        self.ignore_index = int(info.get("ignore_index", rules.ignore_index))
        self.info_used: dict = {}
        self.by_reference = False

    # one batch
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
        # Gradient accumulation: the step's micro-batches, their rows numbered across them.
        accumulated = micro_rows(batch) is not None
        fields = None if accumulated else list(leaves(batch))
        B = batch_rows(batch, ids) if accumulated else _batch_size(fields, ids)
        if B == 0:
            return
        first = self.n_rows
        for r in range(B):
            self.rows.append(_Row(step, r, ids[r] if ids is not None and r < len(ids) else None, rank))
        self.n_rows += B
        if not accumulated:
            self._content(fields, first, B)
            return
        for offset, part, n in row_groups(batch, B):
            self._content(list(leaves(part)), first + offset, n)

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
                field_ = self.floats[name] = _FloatField(name, rows.shape[1], self.rules.max_features)
            field_.add(first, rows)
        elif kind in "iu":
            self._ints(name, first, a, rows)
        elif kind == "b" and _is_mask(name) and rows.shape[1] > 1:
            for r in np.flatnonzero(~rows.any(1)):
                self.flags.append((first + int(r), "empty", {"field": name, "mask_sum": 0}))

    def _ints(self, name: str, first: int, a: np.ndarray, rows: np.ndarray) -> None:
        if _is_mask(name):
            if rows.shape[1] > 1:
                for r in np.flatnonzero(rows.sum(1) == 0):
                    self.flags.append((first + int(r), "empty", {"field": name, "mask_sum": 0}))
            return
        neg = (rows < 0) & (rows != self.ignore_index)
        high = rows >= self.vocab if self.vocab is not None and _is_tokens(name, a) else np.zeros_like(neg)
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
                tf = self.tokens[name] = _TokenField(name)
            tf.add(first, rows)  # (B, T)

    def ids_by_step(self) -> dict[int, list]:
        out: dict[int, list] = defaultdict(list)
        for r in self.rows:
            if not r.rank:  # rank 0's (or the only) batch: what step flags point at
                out[r.step].append(r.sample_id)
        return dict(out)

    # after the pass
    def finish(self) -> list[DirtyRow]:
        pad, pad_source = self._pad_id()
        self.info_used = {
            "pad_id": pad,
            "pad_source": pad_source,
            "vocab_size": self.vocab,
            "vocab_source": self.vocab_source,
            "ignore_index": self.ignore_index,
        }
        padded = self._padding(pad)
        self._lengths(pad, padded)
        self._extremes()
        self._duplicates(padded)
        out = []
        for g, reason, ev in self.flags:
            row = self.rows[g]
            score = SCORES[reason] + (min(20.0, math.log10(max(ev.get("z", 1.0), 1.0))) if reason == "extreme" else 0.0)
            out.append(DirtyRow(row.step, row.row, row.sample_id, reason, ev, score, row.rank))
        return _merge_same_row(out)

    def _pad_id(self) -> tuple[int | None, str | None]:
        given = _int_or_none(self.info.get("pad_id", self.info.get("pad_token_id")))
        if given is not None:
            return given, "data_info"
        # Inferred: the value that ends (or starts) rows in runs of >= 2 in at least 1% of rows
        # (padding); random token data does that with probability ~1/vocab, spread over values.
        values, total = [], 0
        for tf in self.tokens.values():
            a = tf.arrays()
            total += len(a["row"])
            values.append(
                np.where(a["tail_n"] >= 2, a["tail"], np.where(a["head_n"] >= 2, a["head"], np.iinfo(np.int64).min))
            )
        if not values:
            return None, None
        v = np.concatenate(values)
        v = v[v != np.iinfo(np.int64).min]
        if not len(v):
            return None, None
        uniq, counts = np.unique(v, return_counts=True)
        i = int(np.argmax(counts))
        if counts[i] >= max(2, 0.01 * total):
            return int(uniq[i]), f"inferred: fills the end of {int(counts[i])} rows"
        return None, None

    def _padding(self, pad: int | None) -> set[int]:
        """All-padding rows: every token is the pad id (or, with no pad id known, one value
        repeated across a row of >= 4 tokens: padding in all but name)."""
        found = set()
        for tf in self.tokens.values():
            a = tf.arrays()
            hit = a["constant"] & ((a["head"] == pad) if pad is not None else (a["width"] >= 4))
            for i in np.flatnonzero(hit):
                g = int(a["row"][i])
                found.add(g)
                self.flags.append(
                    (
                        g,
                        "all_padding",
                        {"field": tf.name, "value": int(a["head"][i]), "length": int(a["width"][i]), "pad_id": pad},
                    )
                )
        return found

    def _lengths(self, pad: int | None, skip: set[int]) -> None:
        series: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        if pad is not None:
            for tf in self.tokens.values():
                a = tf.arrays()
                right = np.where(a["tail"] == pad, a["tail_n"], 0)  # right padding, else left
                left = np.where((a["head"] == pad) & (a["tail"] != pad), a["head_n"], 0)
                series[tf.name] = (a["row"], (a["width"] - right - left).astype(np.float64))
        for name, items in self.strings.items():
            series[name] = (np.array([g for g, _ in items]), np.array([n for _, n in items], dtype=np.float64))
        for name, (rows, lengths) in series.items():
            keep = ~np.isin(rows, list(skip)) if skip else np.ones(len(rows), dtype=bool)
            if keep.sum() < 8:
                continue
            med = float(np.median(lengths[keep]))
            scale = max(1.4826 * float(np.median(np.abs(lengths[keep] - med))), 0.05 * med, 1.0)
            z = (lengths - med) / scale
            ratio = (lengths + 1) / (med + 1)
            out = (
                keep
                & (np.abs(z) >= self.rules.length_z)
                & ((ratio <= 1 / self.rules.length_ratio) | (ratio >= self.rules.length_ratio))
            )
            for i in np.flatnonzero(out):
                self.flags.append(
                    (
                        int(rows[i]),
                        "length",
                        {"field": name, "length": int(lengths[i]), "median": med, "z": float(z[i])},
                    )
                )

    def _extremes(self) -> None:
        for f in self.floats.values():
            if not f.values:
                continue
            X = np.concatenate(f.values, 0)
            starts = np.concatenate([np.full(len(v), s, dtype=np.int64) for v, s in zip(f.values, f.where)])
            offsets = np.concatenate([np.arange(len(v)) for v in f.values])
            rows = starts + offsets
            with np.errstate(all="ignore"):
                med, scale = _robust(X)
                Z = np.abs(X - med) / scale
            Z = np.where(np.isfinite(X), Z, 0.0)
            hit = Z >= self.rules.extreme_z
            for i in np.flatnonzero(hit.any(1)):
                j = int(np.argmax(Z[i]))
                self.flags.append(
                    (
                        int(rows[i]),
                        "extreme",
                        {
                            "field": f.labels[j],
                            "value": float(X[i, j]),
                            "median": float(med[j]),
                            "scale": float(scale[j]),
                            "z": float(Z[i, j]),
                            "features": int(hit[i].sum()),
                        },
                    )
                )

    def _duplicates(self, padded: set[int]) -> None:
        pairs = [(g, first) for g, first in self.dupes if g not in padded and first not in padded]
        # The same sample id again is another epoch, not a duplicate.
        pairs = [
            (g, f)
            for g, f in pairs
            if self.rows[g].sample_id is None or self.rows[g].sample_id != self.rows[f].sample_id
        ]
        no_ids = [(g, f) for g, f in pairs if self.rows[g].sample_id is None]
        if no_ids and len(no_ids) > 0.5 * self.n_rows:
            self.notes.append(
                f"{len(no_ids)} rows repeat earlier content without sample ids (multi-epoch training?); not flagged"
            )
            pairs = [p for p in pairs if self.rows[p[0]].sample_id is not None]
        for g, f in pairs:
            first = self.rows[f]
            same = {"step": first.step, "row": first.row, "sample_id": first.sample_id}
            if first.rank is not None:
                same["rank"] = first.rank
            self.flags.append((g, "duplicate", {"same_as": same}))


def _robust(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-column median and scale: 1.4826 * MAD (a normal's sigma). Where the MAD is 0 (a
    mostly-constant or sparse binary feature) the spread of the central 99.8% stands in, so
    the occasional 1 in a column of 0s is not "infinitely" extreme; then the magnitude."""
    Xf = np.where(np.isfinite(X), X, np.nan)
    med = np.nanmedian(Xf, 0)
    mad = np.nan_to_num(1.4826 * np.nanmedian(np.abs(Xf - med), 0))
    lo, hi = np.nanpercentile(Xf, [0.1, 99.9], axis=0)
    spread = np.nan_to_num((hi - lo) / 6.18)
    magnitude = np.maximum(np.abs(np.nan_to_num(med)), 1e-12) * 1e-3
    scale = np.where(mad > 0, mad, np.where(spread > 0, spread, magnitude))
    return np.nan_to_num(med), scale


def _merge_same_row(rows: list[DirtyRow]) -> list[DirtyRow]:
    """One entry per (step, row, reason): keep the strongest evidence, count the rest."""
    best: dict[tuple, DirtyRow] = {}
    for r in rows:
        key = (r.step, r.rank, r.row, r.reason)
        cur = best.get(key)
        if cur is None or r.score > cur.score:
            if cur is not None:
                r.evidence.setdefault("also", []).append(cur.evidence.get("field"))
            best[key] = r
        else:
            cur.evidence.setdefault("also", []).append(r.evidence.get("field"))
    return list(best.values())


# --- dynamic: the step health ----------------------------------------------------------------------


def dynamic_flags(run: Run, rules: DirtyRules = DirtyRules(), *, ids_by_step: dict | None = None) -> list[dict]:
    """Steps whose loss or gradient norm went wrong: {step, kind, value, median, z, batch,
    sample_ids} (`ids_by_step`, from a static scan, saves reading those batches again)."""
    m = run.metrics()
    retained = set(run.steps)
    out = []
    for i in np.flatnonzero(~np.isfinite(m.loss)):
        out.append(
            {"step": int(m.step[i]), "kind": "nonfinite_loss", "value": float(m.loss[i]), "median": None, "z": None}
        )
    # A finite loss can hide non-finite gradients (e.g. NaN only at ignored/padded positions):
    # the weights go NaN one step later, so the step that got them is the one to look at.
    # A step a GradScaler skipped overflowed on purpose (float16 finding its scale): not a flag.
    # A step without any gradient (a loop that skipped backward) has a NaN norm that is not one.
    no_grad = (m.param_grad_norm < 0).all(axis=1) if m.param_grad_norm.shape[1] else np.zeros(len(m), dtype=bool)
    nonfinite_norm = ~np.isfinite(m.grad_norm) & ~no_grad
    bad_grads = np.isfinite(m.loss) & (nonfinite_norm | (m.nonfinite_grads > 0)) & ~m.scaler_skipped
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
        for i, s in find_spikes(series, rule):
            out.append(
                {"step": int(m.step[i]), "kind": kind, "value": s.value, "median": s.median, "z": s.z, "ratio": s.ratio}
            )
    _mark_downstream(out, m)
    for f in out:
        f["batch"] = "retained" if f["step"] in retained else "pruned by retention"
        if f["step"] not in retained:
            f["sample_ids"] = None
        elif ids_by_step is not None and f["step"] in ids_by_step:
            f["sample_ids"] = ids_by_step[f["step"]]
        else:
            f["sample_ids"] = run.batch(f["step"])[1]
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


def _step_rows(step_flags: list[dict]) -> list[DirtyRow]:
    out = []
    for f in step_flags:
        ev = {k: f[k] for k in ("value", "median", "z", "ratio", "batch", "downstream_of") if f.get(k) is not None}
        ev["rows"] = len(f["sample_ids"]) if f.get("sample_ids") is not None else None
        score = SCORES[f["kind"]] + (min(10.0, math.log10(max(f["z"], 1.0))) if f.get("z") else 0.0)
        if "downstream_of" in f:  # a consequence: its root step ranks first
            score -= DOWNSTREAM_PENALTY
        out.append(DirtyRow(f["step"], None, None, f["kind"], ev, score))
    return out


def _corroborate(rows: list[DirtyRow]) -> None:
    step_kinds: dict[int, list[str]] = defaultdict(list)
    for r in rows:
        if r.row is None:
            step_kinds[r.step].append(r.reason)
    for r in rows:
        if r.row is not None and step_kinds.get(r.step):
            r.score += CORROBORATED
            r.evidence["step_flags"] = sorted(set(step_kinds[r.step]))


# --- attribution (optional; the caller passes replay in) ------------------------------------------------------


def _attribution(
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
    of the other rows (0 where not measured)."""
    finite = np.isfinite(x)
    share, ratio = np.zeros(len(x)), np.zeros(len(x))
    if finite.sum() < 2:
        return share, ratio
    med = float(np.median(x[finite]))
    excess = np.where(finite, np.maximum(x - med, 0.0), 0.0)
    if excess.sum() > 0:
        share = excess / excess.sum()
    for i in np.flatnonzero(finite):
        others = np.delete(x, i)
        others = others[np.isfinite(others)]
        m = float(np.median(others)) if len(others) else math.nan
        ratio[i] = x[i] / m if m > 0 else (math.inf if x[i] > 0 else 0.0)
    return share, ratio


def _median(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.median(finite)) if finite else math.nan


# --- skip list ---------------------------------------------------------------------------------------


def skip_ids(report: DirtyReport, *, whole_batches: bool = True) -> list:
    """Sample ids to skip: rows flagged for a SKIP_REASONS reason, and (whole_batches) every
    row of a spiking step for which no row was found to blame -- the way large-model teams
    skip the batches around a spike."""
    ids, seen = [], set()
    blamed_steps = {r.step for r in report.flagged if r.row is not None and r.reason in SKIP_REASONS}

    def add(sid):
        key = (type(sid).__name__, sid)
        if sid is not None and key not in seen:
            seen.add(key)
            ids.append(sid)

    for r in report.flagged:
        if r.row is not None and r.reason in SKIP_REASONS:
            add(r.sample_id)
    if whole_batches:
        downstream = {f["step"] for f in report.steps if "downstream_of" in f}
        spiking = sorted({f["step"] for f in report.steps if f["batch"] == "retained"} - blamed_steps - downstream)
        for f in report.steps:
            if f["step"] in spiking:
                for sid in f.get("sample_ids") or []:
                    add(sid)
    return ids


def write_skip_list(report: DirtyReport, path: str | os.PathLike) -> dict:
    """Write the skip list as JSON (atomically); returns what was written."""
    entries: dict = {}
    for r in report.flagged:
        if r.sample_id is None or r.row is None or r.reason not in SKIP_REASONS:
            continue
        e = entries.setdefault(
            repr(r.sample_id), {"sample_id": r.sample_id, "step": r.step, "row": r.row, "reasons": []}
        )
        if r.reason not in e["reasons"]:
            e["reasons"].append(r.reason)
    return skiplist.write(path, report.skip_ids, list(entries.values()), run=report.run)


def _verdict(report: DirtyReport) -> str:
    rows = [r for r in report.flagged if r.row is not None]
    steps = [r for r in report.flagged if r.row is None]
    if not rows and not steps:
        return f"No dirty data found in {report.scanned['steps']} retained batches ({report.scanned['rows']} rows)."
    parts = []
    if rows:
        kinds = Counter(r.reason for r in rows)
        parts.append(f"{len(rows)} suspicious row(s) (" + ", ".join(f"{n} {k}" for k, n in kinds.most_common()) + ")")
    if steps:
        parts.append(f"{len({r.step for r in steps})} step(s) with loss/gradient trouble")
    top = report.flagged[0]
    where = f"step {top.step}" + (f" row {top.row} (sample {top.sample_id!r})" if top.row is not None else "")
    return f"{'; '.join(parts)}; worst: {where}, {top.reason}. Skip list: {len(report.skip_ids)} sample id(s)."


# --- helpers -------------------------------------------------------------------------------------------


def _batch_size(fields: list[tuple[str, Any]], ids) -> int:
    if ids is not None:
        return len(ids)
    sizes = Counter(
        len(v) if isinstance(v, list) else v.shape[0] for _, v in fields if isinstance(v, list) or v.ndim >= 1
    )
    return sizes.most_common(1)[0][0] if sizes else 0


def _is_mask(name: str) -> bool:
    last = name.rsplit(".", 1)[-1].lower()
    return any(h in last for h in MASK_FIELD_HINTS)


def _is_tokens(name: str, a: np.ndarray) -> bool:
    last = name.rsplit(".", 1)[-1].lower()
    return a.ndim >= 2 or any(h in last for h in TOKEN_FIELD_HINTS)


def _int_or_none(x) -> int | None:
    try:
        return int(x) if x is not None else None
    except (TypeError, ValueError):
        return None
