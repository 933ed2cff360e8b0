"""Walking a recorded batch, and reading the model's shape off the manifest: the helpers that
dirty, report and replay's blame share.

    for path, values in leaves(batch): ...          # "inputs.ids", numpy array
    n = batch_rows(batch, sample_ids)               # how many rows the batch has
    sub = select_rows(batch, [3, 5], n)             # the batch restricted to rows 3 and 5
    new = replace_rows(batch, n, [3], row_batch(other, 0, m), 1)  # row 3 <- row 0 of `other`
    vocab = embedding_tables(run.manifest)          # rows of each embedding-like table

A step with gradient accumulation is recorded as its micro-batches together,
`{"micro_batches": [mb0, mb1, ...], "micro_rows": [rows of mb0, ...], ...}`, or is a plain
list of them that `step_fn` loops over, `[(x0, y0), (x1, y1), ...]`; either way its rows (and
sample ids) are numbered across the micro-batches in order: `row_groups` and `micro_row` map
between the two, `batch_rows` / `select_rows` count and select across them, and `row_batch` /
`replace_rows` take a row out of its micro-batch and put one into it. A plain list
is read so only when the step's row count (its sample ids) says so (`micro_list`): an ordinary
`(x, y)` batch is never taken for two micro-batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, overload

import numpy as np
import torch

# Names of embedding tables (updated sparsely: only the rows in the batch move).
EMBEDDING_HINTS = ("emb", "wte", "wpe", "tok")


def is_embedding(name: str) -> bool:
    return any(h in name.lower() for h in EMBEDDING_HINTS)


def embedding_tables(manifest: dict) -> list[int]:
    """The row counts of the model's 2-D embedding-like parameters, in model order (the first
    is usually the token table, so its rows are the vocabulary size)."""
    return [
        int(p["shape"][0])
        for p in manifest.get("parameters", [])
        if len(p.get("shape", ())) == 2 and is_embedding(p["name"])
    ]


# --- walking a batch ---------------------------------------------------------------------------------


def leaves(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, value) for every array-like or string-list leaf of a batch's nesting; tensors
    come back as numpy arrays (bfloat16 and friends as float32)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        for k, v in zip(obj._fields, obj):
            yield from leaves(v, f"{path}.{k}" if path else k)
    elif isinstance(obj, (list, tuple)):
        if obj and all(isinstance(v, (str, bytes)) for v in obj):
            yield path or "0", list(obj)
            return
        for i, v in enumerate(obj):
            yield from leaves(v, f"{path}.{i}" if path else str(i))
    elif isinstance(obj, np.ndarray):
        if obj.dtype.kind in "biufc":
            yield path, obj
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        if t.is_complex():
            t = t.abs()
        elif t.is_floating_point() and t.dtype not in (torch.float16, torch.float32, torch.float64):
            t = t.float()  # bfloat16, float8: numpy has no such dtype
        yield path, t.numpy()


def python_leaves(obj, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, leaf) for every leaf of a batch's nesting, as it is (tensors stay tensors), with
    the path written the way Python reaches it: `['input_ids']`, `[0]`, `.targets`."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from python_leaves(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        fields = getattr(type(obj), "_fields", None)
        for i, v in enumerate(obj):
            yield from python_leaves(v, f"{path}.{fields[i]}" if fields else f"{path}[{i}]")
    else:
        yield path, obj


MICRO_BATCHES, MICRO_ROWS = "micro_batches", "micro_rows"


def micro_rows(batch, n: int | None = None) -> list[int] | None:
    """The row count of each micro-batch, when `batch` records an accumulated step: the dict
    form, or (given the step's `n` rows) a plain list of micro-batches (`micro_list`)."""
    if not isinstance(batch, dict):
        return micro_list(batch, n)
    parts, sizes = batch.get(MICRO_BATCHES), batch.get(MICRO_ROWS)
    if not isinstance(parts, list) or not isinstance(sizes, list) or len(parts) != len(sizes):
        return None
    return [int(n) for n in sizes]


@overload
def row_groups(batch, rows: int) -> list[tuple[int, Any, int]]: ...
@overload
def row_groups(batch, rows: int | None) -> list[tuple[int, Any, int | None]]: ...
def row_groups(batch, rows):
    """(first row, the part of the batch that holds its rows, row count): one per micro-batch
    of an accumulated step (each counted), else the batch itself (`rows` rows)."""
    sizes = micro_rows(batch, rows)
    if sizes is None:
        return [(0, batch, rows)]
    firsts = np.cumsum([0, *sizes[:-1]]).tolist()
    return list(zip(firsts, _parts(batch), sizes))


def _parts(batch) -> list:
    """An accumulated step's micro-batches (of either form)."""
    return batch[MICRO_BATCHES] if isinstance(batch, dict) else list(batch)


def micro_row(batch, row: int, n: int | None = None) -> tuple[int, int] | None:
    """(micro-batch, row within it) of a row of an accumulated step's batch (of `n` rows: a
    plain list of micro-batches is one only given `n`); None otherwise."""
    sizes = micro_rows(batch, n)
    if sizes is None:
        return None
    for m, n in enumerate(sizes):
        if row < n:
            return m, row
        row -= n
    return None


def batch_rows(batch, ids) -> int | None:
    """Rows in the batch: one per sample id, else (across its micro-batches) the most common
    leading dimension."""
    if ids is not None:
        return len(ids)
    sizes = micro_rows(batch)
    if sizes is not None:
        return sum(sizes)
    dims = [
        leaf.shape[0] for _, leaf in python_leaves(batch) if isinstance(leaf, (torch.Tensor, np.ndarray)) and leaf.ndim
    ]
    return max(set(dims), key=dims.count) if dims else None


def select_rows(obj, rows: list[int], n: int):
    """The batch restricted to `rows` (every leaf whose first dimension is the batch's, the
    columns of a sequence-first `(T, n, ...)` leaf, and the elements of a flattened `(T*n,)`
    leaf that are those rows' (`flat_rows`); in an accumulated step's batch, the micro-batches
    that keep a row, each restricted to its rows)."""
    sizes = micro_rows(obj, n)
    if sizes is not None and sum(sizes) == n:
        parts, kept = [], []
        for first, part, k in row_groups(obj, n):
            mine = [r - first for r in rows if first <= r < first + k]
            if mine:
                parts.append(select_rows(part, mine, k))
                kept.append(len(mine))
        return {**obj, MICRO_BATCHES: parts, MICRO_ROWS: kept} if isinstance(obj, dict) else type(obj)(parts)
    return _select(obj, rows, n, flat_layouts(obj, n))


def _select(obj, rows: list[int], n: int, flat: dict[int, tuple[str, int]]):
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        dim = row_dim(obj.shape, n)
        if dim is None:
            index = flat_rows(flat.get(obj.shape[0]) if obj.ndim else None, rows, n)
            return obj if index is None else obj[index]
        return obj[rows] if dim == 0 else obj[:, rows]
    if isinstance(obj, dict):
        return {k: _select(v, rows, n, flat) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
        return type(obj)(*[_select(v, rows, n, flat) for v in obj])
    if isinstance(obj, (list, tuple)):
        if len(obj) == n and not any(isinstance(v, (torch.Tensor, np.ndarray, dict, list, tuple)) for v in obj):
            return type(obj)(obj[i] for i in rows)  # a per-row list (e.g. texts)
        return type(obj)(_select(v, rows, n, flat) for v in obj)
    return obj


def flat_layouts(batch, n: int) -> dict[int, tuple[str, int]]:
    """The lengths a leaf of `batch` has when it is another, 2-D, leaf's rows flattened, each
    with how it was laid out: `("seq", T)` for a sequence-first `(T, n)` leaf flattened (element
    `t * n + row`, as `targets.view(-1)` of a word-level language model's chunk), `("batch", T)`
    for a `(n, T)` leaf flattened (element `row * T + t`). A length that both layouts would give
    is left out: which rows its elements hold cannot be told."""
    found: dict[int, set[tuple[str, int]]] = {}
    for _, leaf in python_leaves(batch):  # (2-D leaves only: an image's (n, 3, H, W) flattens no target)
        if not isinstance(leaf, (torch.Tensor, np.ndarray)) or leaf.ndim != 2:
            continue
        first, second = int(leaf.shape[0]), int(leaf.shape[1])
        if first == n and second not in (1, n):
            found.setdefault(n * second, set()).add(("batch", second))
        elif second == n and first not in (1, n):
            found.setdefault(first * n, set()).add(("seq", first))
    return {length: next(iter(ways)) for length, ways in found.items() if len(ways) == 1 and length != n}


def flat_rows(layout: tuple[str, int] | None, rows: list[int], n: int) -> list[int] | None:
    """The elements of a flattened leaf (`flat_layouts`) that hold `rows`, in the order the
    same leaf of the selected rows flattens to; None for a leaf that is not one."""
    if layout is None:
        return None
    how, t = layout
    if how == "seq":
        return [i * n + r for i in range(t) for r in rows]
    return [r * t + i for r in rows for i in range(t)]


def micro_list(batch, n: int | None) -> list[int] | None:
    """The row count of each micro-batch when `batch`, a plain list or tuple, is the micro-
    batches of a step of `n` rows (its sample ids numbered across them in order): two or more
    parts built alike, whose rows (each its most common leading dimension) add up to `n`, and
    no leaf of which has the `n` rows itself (read as one batch, it would not fit). Bare
    tensors whose dimension 1 is `n` are a sequence-first `(T, n)` batch instead. None when
    it is not so."""
    if not n or not isinstance(batch, (list, tuple)) or hasattr(type(batch), "_fields") or len(batch) < 2:
        return None
    arrays = [leaf for _, leaf in python_leaves(batch) if isinstance(leaf, (torch.Tensor, np.ndarray)) and leaf.ndim]
    if not arrays or any(a.shape[0] == n for a in arrays) or len({_built(p) for p in batch}) != 1:
        return None
    if all(isinstance(p, (torch.Tensor, np.ndarray)) and p.ndim > 1 and p.shape[1] == n for p in batch):
        return None
    sizes = [k for k in (batch_rows(p, None) for p in batch) if k is not None]
    return sizes if len(sizes) == len(batch) and sum(sizes) == n else None


def _built(obj) -> tuple:
    """How a batch is built, sizes aside: its nesting, field names, and array dtypes and ranks."""
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return ("array", str(obj.dtype), obj.ndim)
    if isinstance(obj, dict):
        return ("dict", tuple((k, _built(v)) for k, v in obj.items()))
    if _is_row_list(obj):
        return ("values",)
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_built(v) for v in obj))
    return (type(obj).__name__,)


def row_dim(shape, n: int) -> int | None:
    """The dimension of a batch leaf of this shape that holds the batch's `n` rows: 0, or 1
    for a sequence-first leaf (T, n, ...) (as the trace maps elements to rows); None when the
    leaf has no rows (a shared tensor, a scalar)."""
    if len(shape) and shape[0] == n:
        return 0
    if len(shape) > 1 and shape[1] == n:
        return 1
    return None


def _is_row_list(obj) -> bool:
    return isinstance(obj, (list, tuple)) and not any(
        isinstance(v, (torch.Tensor, np.ndarray, dict, list, tuple)) for v in obj
    )


def zip_leaves(fn, a, b):
    """A batch shaped like `a` whose every array leaf (tensor, numpy array, or a per-row list
    of plain values) is `fn(leaf of a, leaf of b at the same place)`. ValueError when the two
    batches are not built alike."""
    if isinstance(a, (torch.Tensor, np.ndarray)) or _is_row_list(a):
        return fn(a, b)
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            raise ValueError("the batches have different fields")
        return {k: zip_leaves(fn, v, b[k]) for k, v in a.items()}
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            raise ValueError("the batches are nested differently")
        out = [zip_leaves(fn, x, y) for x, y in zip(a, b)]
        return type(a)(*out) if hasattr(type(a), "_fields") else type(a)(out)
    return a


def row_batch(batch, row: int, n: int):
    """Row `row` of a batch of `n` rows as a batch of its own, of one row; of an accumulated
    step's batch, taken out of its micro-batch (a plain batch built as that micro-batch is)."""
    for first, part, k in row_groups(batch, n):
        if first <= row < first + k:
            return select_rows(part, [row - first], k)
    raise IndexError(f"row {row} is not in a batch of {n} rows")


def replace_rows(dst, n_dst: int, rows: list[int], src, n_src: int):
    """`dst` (a batch of n_dst rows) with its rows `rows` replaced by the n_src = len(rows) rows
    of `src`, in order. In an accumulated step's batch (either one) rows are counted across
    the micro-batches, and each is put into its own micro-batch (`row_batch`). ValueError when
    a row leaf's shape or type differs between the two."""
    if micro_rows(dst, n_dst) is not None or micro_rows(src, n_src) is not None:
        return _replace_across(dst, n_dst, rows, src, n_src)

    flat = flat_layouts(dst, n_dst)

    def put(d, s):
        if isinstance(d, (torch.Tensor, np.ndarray)):
            dim = row_dim(d.shape, n_dst)
            if dim is None:
                index = flat_rows(flat.get(d.shape[0]) if d.ndim else None, rows, n_dst)
                if index is None:
                    return d
                if type(s) is not type(d) or s.shape[1:] != d.shape[1:] or s.shape[0] != len(index):
                    raise ValueError(f"a flattened field has {s.shape[0]} elements here for {len(index)} there")
                out = d.clone() if isinstance(d, torch.Tensor) else d.copy()
                out[index] = s.to(d.dtype) if isinstance(d, torch.Tensor) else s.astype(d.dtype)
                return out
            if dim == 1:  # sequence-first: rows are columns; the same code, transposed
                return put(d.swapaxes(0, 1), s.swapaxes(0, 1)).swapaxes(0, 1)
            if type(s) is not type(d) or s.ndim != d.ndim or s.shape[0] != n_src or s.shape[1:] != d.shape[1:]:
                raise ValueError(f"a field has rows of shape {tuple(s.shape[1:])} here and {tuple(d.shape[1:])} there")
            out = d.clone() if isinstance(d, torch.Tensor) else d.copy()
            out[rows] = s.to(d.dtype) if isinstance(d, torch.Tensor) else s.astype(d.dtype)
            return out
        if len(d) != n_dst:
            return d
        out = list(d)
        for i, r in enumerate(rows):
            out[r] = s[i]
        return type(d)(out)

    return zip_leaves(put, dst, src)


def _replace_across(dst, n_dst: int, rows: list[int], src, n_src: int):
    """replace_rows, row by row, where either batch records an accumulated step."""
    sizes = micro_rows(dst, n_dst)
    parts = []
    for first, part, k in row_groups(dst, n_dst):
        for i, r in enumerate(rows):
            if first <= r < first + k:
                part = replace_rows(part, k, [r - first], row_batch(src, i, n_src), 1)
        parts.append(part)
    if sizes is None:  # a plain dst: one part, the batch itself
        return parts[0]
    return {**dst, MICRO_BATCHES: parts} if isinstance(dst, dict) else type(dst)(parts)
