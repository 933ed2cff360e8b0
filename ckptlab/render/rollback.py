"""Terminal rendering of `ckptlab rollback`: the candidates, the choice, and what was done."""

from __future__ import annotations

from rich.table import Table

from ckptlab.numbers import value
from ckptlab.render.text import safe


def render(choice, action: dict, term) -> None:
    table = Table(title=f"candidates ({choice.run})", title_justify="left", show_edge=False)
    for col in ("", "step", "reason", "validation", "health", "integrity"):
        table.add_column(col)
    for c in choice.candidates:
        val = safe(", ".join(f"{k}={value(v)}" for k, v in c.validation.items()) or "-")
        integrity = (
            "[green]ok[/green]"
            if c.integrity == "ok"
            else ("[dim]not checked[/dim]" if c.integrity == "not checked" else f"[red]{safe(c.integrity)}[/red]")
        )
        table.add_row(
            "[bold]>[/bold]" if c.chosen else "",
            str(c.step),
            safe(c.reason),
            val,
            "healthy" if c.healthy else "[yellow]after anomaly[/yellow]",
            integrity,
        )
    term.print(table)
    if choice.first_anomaly:
        term.print(f"first anomaly: {choice.first_anomaly['kind']} at step {choice.first_anomaly['step']}")
    term.print(f"[bold]chosen: step {choice.step}[/bold]: {safe(choice.why)}")
    for note in choice.notes:
        term.note(note)
    dry = "[dim](dry run: nothing changed)[/dim] " if action.get("dry_run") else ""
    if action["kind"] == "export":
        term.print(
            f"{dry}export to {action['to']}" + ("" if action.get("dry_run") else f": {', '.join(action['files'])}")
        )
        if not action.get("dry_run"):
            term.print(f"load it with: {safe(action['load'])}")
    elif action["kind"] == "none":
        term.print(f"{dry}{safe(action['note'])}")
    else:
        arch = action["archived_steps"]
        verb = "would move" if action.get("dry_run") else "moved"
        term.print(
            f"{dry}rewind: {verb} steps {arch[0]}..{arch[1] if arch else ''} to {action['archive']} "
            f"({len(action['checkpoints_moved'])} checkpoint(s), {len(action['segments_moved'])} segment(s) moved, "
            f"{len(action['segments_split'])} split)"
            if arch
            else f"{dry}rewind to step {choice.step}"
        )
        if not action.get("dry_run"):
            term.print(safe(action["resume"]))
