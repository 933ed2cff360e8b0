"""JSON rendering shared by every --json output.

Findings are dataclasses; numpy scalars/arrays become numbers/lists; non-finite floats become
the strings "nan", "inf", "-inf" (standard JSON has no NaN, and null would hide which one it was).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any


def plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if not f.name.startswith("_")}
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [plain(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist") and type(obj).__module__ == "numpy":
        return plain(obj.tolist())
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if hasattr(obj, "item"):  # torch scalars
        return plain(obj.item())
    return str(obj)


def dumps(obj: Any, *, indent: int | None = 2) -> str:
    return json.dumps(plain(obj), indent=indent, allow_nan=False)
