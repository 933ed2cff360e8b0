"""JSON rendering shared by every --json output (the conversion itself: ckptlab/jsonable.py)."""

from __future__ import annotations

import json
from typing import Any

from ckptlab.jsonable import plain

__all__ = ["dumps", "plain"]


def dumps(obj: Any, *, indent: int | None = 2) -> str:
    return json.dumps(plain(obj), indent=indent, allow_nan=False)
