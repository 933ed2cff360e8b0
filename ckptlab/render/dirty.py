"""Terminal rendering of `ckptlab dirty`'s DirtyReport."""

from __future__ import annotations

from rich.table import Table

from ckptlab.numbers import value
from ckptlab.render.text import safe


def render(r, term, top: int) -> None:
    s = r.scanned
    info = r.data_info
    term.print(
        f"[bold]{r.run}[/bold]  scanned {s['steps']} retained batches ({s['rows']} rows; steps {s['first']}..{s['last']}) "
        f"at {s['batches_per_s'] or 0:.0f} batches/s"
    )
    term.print(
        f"data       fields {safe(', '.join(s['fields'])) or '-'}; pad id {_src(info['pad_id'], info['pad_source'])}; "
        f"vocab size {_src(info['vocab_size'], info['vocab_source'])}"
    )
    a = r.attribution
    term.print(
        f"attribution {a['status']}"
        + (f" ({a['note']})" if a.get("note") else "")
        + (f": steps {a['steps']}" if a.get("steps") else "")
    )
    if r.flagged:
        table = Table(
            title=f"flagged (top {min(top, len(r.flagged))} of {len(r.flagged)})", title_justify="left", show_edge=False
        )
        ranked = any(row.rank is not None for row in r.flagged)  # a distributed run
        for col in ("score", "step", *(("rank",) if ranked else ()), "row", "sample_id", "reason", "evidence"):
            table.add_column(col)
        for row in r.flagged[:top]:
            rank = ("-" if row.rank is None else str(row.rank),) if ranked else ()
            table.add_row(
                f"{row.score:.0f}",
                str(row.step),
                *rank,
                "-" if row.row is None else str(row.row),
                "-" if row.sample_id is None else safe(repr(row.sample_id)),
                row.reason,
                safe(_evidence(row.evidence)),
            )
        term.print(table)
    for note in r.notes:
        term.note(note)
    term.print(f"[bold]verdict:[/bold] {safe(r.verdict)}")


def _src(value, source) -> str:
    return "unknown" if value is None else f"{value} ({source})"


def _evidence(ev: dict) -> str:
    parts = []
    for k, v in ev.items():
        if k in ("also",):
            continue
        if isinstance(v, float):
            v = value(v)
        elif isinstance(v, dict):
            v = "{" + ", ".join(f"{a}={b}" for a, b in v.items()) + "}"
        parts.append(f"{k}={v}")
    return ", ".join(parts)
