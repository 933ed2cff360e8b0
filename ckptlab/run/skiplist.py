"""Skip lists: the sample ids a resumed run should never see again (`ckptlab dirty --out`).

    {"format": "ckptlab-skip", "version": 1, "run": "runs/exp1", "created": 1.7e9,
     "sample_ids": [1597, "doc-3-4"],
     "entries": [{"sample_id": 1597, "step": 5431, "row": 5, "reasons": ["nonfinite"]}]}

A plain JSON list of ids is accepted too. `ckptlab.skip_samples` reads them on resume.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ckptlab.errors import CkptlabError
from ckptlab.io.files import read_text
from ckptlab.run.atomic import write_json_atomic

SKIP_FORMAT = "ckptlab-skip"


def write(path: str | os.PathLike, sample_ids: list, entries: list[dict], *, run: str | None = None) -> dict:
    """Write a skip list atomically; returns the document written."""
    doc = {
        "format": SKIP_FORMAT,
        "version": 1,
        "run": run,
        "created": time.time(),
        "sample_ids": sample_ids,
        "entries": entries,
    }
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(target, doc)
    return doc


def read(path: str | os.PathLike) -> list:
    """The sample ids of a skip list (or of a plain JSON list of ids)."""
    p = Path(path)
    try:
        doc = json.loads(read_text(p))
    except FileNotFoundError:
        raise CkptlabError("no such skip list", path=p) from None
    except ValueError as e:
        raise CkptlabError(f"not a JSON skip list ({e})", path=p) from None
    except RecursionError:
        raise CkptlabError("not a JSON skip list (nested too deeply)", path=p) from None
    if isinstance(doc, list):
        return doc
    if not isinstance(doc, dict) or doc.get("format") != SKIP_FORMAT:
        raise CkptlabError("not a ckptlab skip list (written by `ckptlab dirty --out`)", path=p)
    return list(doc.get("sample_ids", []))
