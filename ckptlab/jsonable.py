"""Findings as plain JSON values: the one conversion behind every `--json` and `to_json()`.

    @dataclass
    class Finding:
        name: str
        hist: np.ndarray | None = field(default=None, metadata=NOT_IN_JSON)   # for the plots only

    plain(finding)   # {"name": ...}: dataclasses -> dicts, numpy/torch scalars -> numbers

Non-finite floats become the strings "nan", "inf", "-inf" (standard JSON has no NaN, and null
would hide which one it was); `json_safe` does that alone to JSON values (a run's records) and
`json_restore` undoes it. A field whose metadata is NOT_IN_JSON stays out of the document:
internal working values (sort keys, histograms for plots) that the terminal renderers read.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, TypeGuard

NOT_IN_JSON = {"json": False}


def plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.metadata.get("json", True)}
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [plain(v) for v in obj]
    if isinstance(obj, float):
        return json_safe(obj)
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist") and type(obj).__module__ == "numpy":
        return plain(obj.tolist())
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if hasattr(obj, "item"):  # torch scalars
        return plain(obj.item())
    return str(obj)


def json_safe(d: Any) -> Any:
    """`d` (JSON values: dicts, lists, tuples, numbers, ...) with every non-finite float as the
    string "nan", "inf" or "-inf", so that it is standard JSON; everything else as it is."""
    if isinstance(d, float) and not math.isfinite(d):
        return repr(d)
    if isinstance(d, dict):
        return {k: json_safe(v) for k, v in d.items()}
    if isinstance(d, (list, tuple)):
        return [json_safe(v) for v in d]
    return d


_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def json_restore(d: Any) -> Any:
    """The inverse of `json_safe` on parsed JSON: "nan", "inf", "-inf" back to floats."""
    if isinstance(d, str) and d in _NONFINITE:
        return _NONFINITE[d]
    if isinstance(d, dict):
        return {k: json_restore(v) for k, v in d.items()}
    if isinstance(d, list):
        return [json_restore(v) for v in d]
    return d


def is_int(x: Any) -> TypeGuard[int]:
    """A JSON integer (Python's bool is an int too, and is not one)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    """A JSON number, integer or float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)
