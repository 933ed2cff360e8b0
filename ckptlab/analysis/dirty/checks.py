"""The static stage's run-wide checks, once every batch has been seen: the pad id (given or
inferred), all-padding rows, length outliers, values extreme against the run's own robust
statistics, and duplicates. Each returns its flags as (global row, reason, evidence)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import numpy as np

from ckptlab.analysis.dirty.fields import FloatField, Row, TokenField, int_or_none
from ckptlab.analysis.dirty.findings import DirtyRow, DirtyRules

Flag = tuple[int, str, dict]  # (global row, reason, evidence)


def pad_id(info: dict, tokens: Iterable[TokenField]) -> tuple[int | None, str | None]:
    """The pad id and where it came from: the data_info's, else inferred from the token fields."""
    given = int_or_none(info.get("pad_id", info.get("pad_token_id")))
    if given is not None:
        return given, "data_info"
    # Inferred: the value that ends (or starts) rows in runs of >= 2 in at least 1% of rows
    # (padding); random token data does that with probability ~1/vocab, spread over values.
    values, total = [], 0
    for tf in tokens:
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


def padding_flags(tokens: Iterable[TokenField], pad: int | None) -> list[Flag]:
    """All-padding rows: every token is the pad id (or, with no pad id known, one value
    repeated across a row of >= 4 tokens: padding in all but name)."""
    flags = []
    for tf in tokens:
        a = tf.arrays()
        hit = a["constant"] & ((a["head"] == pad) if pad is not None else (a["width"] >= 4))
        for i in np.flatnonzero(hit):
            evidence = {"field": tf.name, "value": int(a["head"][i]), "length": int(a["width"][i]), "pad_id": pad}
            flags.append((int(a["row"][i]), "all_padding", evidence))
    return flags


def length_flags(
    tokens: Iterable[TokenField],
    strings: dict[str, list[tuple[int, int]]],
    pad: int | None,
    skip: set[int],
    rules: DirtyRules,
) -> list[Flag]:
    """Rows far shorter or longer than the field's median (robust z and a ratio), from the
    unpadded length of token rows (with a pad id known) and the length of strings; rows in
    `skip` (all padding) neither count nor are flagged."""
    series: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    if pad is not None:
        for tf in tokens:
            a = tf.arrays()
            right = np.where(a["tail"] == pad, a["tail_n"], 0)  # right padding, else left
            left = np.where((a["head"] == pad) & (a["tail"] != pad), a["head_n"], 0)
            series[tf.name] = (a["row"], (a["width"] - right - left).astype(np.float64))
    for name, items in strings.items():
        series[name] = (np.array([g for g, _ in items]), np.array([n for _, n in items], dtype=np.float64))
    flags = []
    for name, (rows, lengths) in series.items():
        keep = ~np.isin(rows, list(skip)) if skip else np.ones(len(rows), dtype=bool)
        if keep.sum() < 8:
            continue
        med = float(np.median(lengths[keep]))
        scale = max(1.4826 * float(np.median(np.abs(lengths[keep] - med))), 0.05 * med, 1.0)
        z = (lengths - med) / scale
        ratio = (lengths + 1) / (med + 1)
        out = keep & (np.abs(z) >= rules.length_z) & ((ratio <= 1 / rules.length_ratio) | (ratio >= rules.length_ratio))
        for i in np.flatnonzero(out):
            flags.append(
                (int(rows[i]), "length", {"field": name, "length": int(lengths[i]), "median": med, "z": float(z[i])})
            )
    return flags


def extreme_flags(floats: Iterable[FloatField], rules: DirtyRules) -> list[Flag]:
    """Rows with a feature (or a row summary) beyond rules.extreme_z robust z-scores of the run's."""
    flags = []
    for f in floats:
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
        hit = Z >= rules.extreme_z
        for i in np.flatnonzero(hit.any(1)):
            j = int(np.argmax(Z[i]))
            evidence = {
                "field": f.labels[j],
                "value": float(X[i, j]),
                "median": float(med[j]),
                "scale": float(scale[j]),
                "z": float(Z[i, j]),
                "features": int(hit[i].sum()),
            }
            flags.append((int(rows[i]), "extreme", evidence))
    return flags


def _robust(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-column median and scale: 1.4826 * MAD (a normal's sigma). Where the MAD is 0 (a
    mostly-constant or sparse binary feature) the spread of the central 99.8% stands in, so
    the occasional 1 in a column of 0s is not "infinitely" extreme; then the magnitude."""
    Xf = np.where(np.isfinite(X), X, np.nan)
    with warnings.catch_warnings():  # a column with no finite value: NaN, then 0 below, silently
        warnings.simplefilter("ignore", RuntimeWarning)
        med = np.nanmedian(Xf, 0)
        mad = np.nan_to_num(1.4826 * np.nanmedian(np.abs(Xf - med), 0))
        lo, hi = np.nanpercentile(Xf, [0.1, 99.9], axis=0)
    spread = np.nan_to_num((hi - lo) / 6.18)
    magnitude = np.maximum(np.abs(np.nan_to_num(med)), 1e-12) * 1e-3
    scale = np.where(mad > 0, mad, np.where(spread > 0, spread, magnitude))
    return np.nan_to_num(med), scale


def duplicate_flags(rows: list[Row], dupes: list[tuple[int, int]], padded: set[int]) -> tuple[list[Flag], list[str]]:
    """Rows whose content was seen before under another sample id (`dupes`: (row, first row
    with that content)), all-padding rows aside; and a note when they are not flagged."""
    pairs = [(g, first) for g, first in dupes if g not in padded and first not in padded]
    # The same sample id again is another epoch, not a duplicate.
    pairs = [(g, f) for g, f in pairs if rows[g].sample_id is None or rows[g].sample_id != rows[f].sample_id]
    notes = []
    no_ids = [(g, f) for g, f in pairs if rows[g].sample_id is None]
    if no_ids and len(no_ids) > 0.5 * len(rows):
        notes.append(
            f"{len(no_ids)} rows repeat earlier content without sample ids (multi-epoch training?); not flagged"
        )
        pairs = [p for p in pairs if rows[p[0]].sample_id is not None]
    flags: list[Flag] = []
    for g, f in pairs:
        first = rows[f]
        same = {"step": first.step, "row": first.row, "sample_id": first.sample_id}
        if first.rank is not None:
            same["rank"] = first.rank
        flags.append((g, "duplicate", {"same_as": same}))
    return flags, notes


def merge_same_row(rows: list[DirtyRow]) -> list[DirtyRow]:
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
