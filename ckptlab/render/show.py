"""Terminal rendering of a dump file (`ckptlab show FILE.h5`): what it is about, then its
index, tensor by tensor, and what was left out."""

from __future__ import annotations

from ckptlab.numbers import human_bytes
from ckptlab.render.text import safe

# Rows of the index listed in full; the rest is counted.
MAX_ROWS = 200


def render(d, term) -> None:
    a = d.attrs
    term.print(
        f"[bold]{safe(d.path)}[/bold]: ckptlab dump of step {a.get('root_step', '?')}"
        + (
            f" (asked about step {a['requested_step']})"
            if a.get("requested_step") not in (None, a.get("root_step"))
            else ""
        )
        + (f" of run {safe(a['run'])}" if a.get("run") else "")
    )
    if a.get("verdict"):
        term.field("verdict", safe(a["verdict"]))
    if a.get("origin_op"):
        where = f" in {safe(a.get('origin_module') or '<outside the model>')}" + (
            f" ({safe(a['origin_source'])})" if a.get("origin_source") else ""
        )
        term.field(
            "origin",
            f"{safe(a.get('origin_kind', ''))}: {safe(a['origin_op'])} ({safe(a.get('origin_phase', ''))}){where}",
        )
    for line in d.came_from:
        term.field("", safe(line))
    written, omitted = d.written, d.omitted
    term.field(
        "tensors",
        f"{len(written)} written, {human_bytes(a.get('data_bytes', 0))} uncompressed, "
        f"{human_bytes(d.file_bytes)} on disk"
        + (f"; selected modules: /{safe(a['select'])}/" if a.get("select") else "; every module"),
    )
    for row in written[:MAX_ROWS]:
        term.print("  " + safe(_line(row)))
    if len(written) > MAX_ROWS:
        term.print(f"  ... {len(written) - MAX_ROWS} more (`ckptlab show --json` lists them all)")
    if omitted:
        term.print(
            f"[yellow]left out[/yellow] {len(omitted)} tensors, {human_bytes(sum(r['bytes'] for r in omitted))}: "
            f"over --dump-max-bytes {a.get('max_bytes', '?')} (or not dense tensors)"
        )
        for row in omitted[:20]:
            term.print(
                f"           {safe(row['path'])} {safe(row['shape'])} {human_bytes(row['bytes'])}"
                + (f" ({safe(row['note'])})" if row["note"] else "")
            )
        if len(omitted) > 20:
            term.print(f"           ... {len(omitted) - 20} more")


def _line(row: dict) -> str:
    """`origin/input0  float32[6, 8, 8]  origin_input: forward _softmax.default at m.py:40; 144 non-finite from [5, 0, 0]`"""
    what = " ".join(x for x in (row["phase"], row["op"].removeprefix("aten."), row["module"]) if x)
    at = f" at {row['source']}" if row["source"] else ""
    bad = ""
    if row["nonfinite"] > 0:
        first = row["first_nonfinite"].split("; ")[0]
        bad = f"; {row['nonfinite']} non-finite" + (f", first at {first}" if first else "")
    return f"{row['path']}  {row['dtype']}{row['shape']}  {row['role']}" + (f": {what}" if what else "") + at + bad
