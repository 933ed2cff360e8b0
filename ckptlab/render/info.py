"""Terminal rendering of `ckptlab info`'s RunSummary (its JSON is the summary itself)."""

from __future__ import annotations

import time

from rich.table import Table

from ckptlab.numbers import human_bytes, precise, value
from ckptlab.render.text import safe
from ckptlab.run.environment import summary


def render(s, term) -> None:
    """The run in a screenful: what was recorded, its checkpoints, anomalies, validation, disk
    use and whether the recorded functions' sources still match."""
    term.print(
        f"[bold]{safe(s.run)}[/bold]  (run format {s.format_version}, created {time.strftime('%Y-%m-%d %H:%M', time.localtime(s.created))}, "
        f"torch {safe(s.versions.get('torch'))}, {safe(s.device)})"
    )
    if s.recording is not None:
        r = s.recording
        started = (
            f", since {time.strftime('%Y-%m-%d %H:%M', time.localtime(r['started']))}"
            if isinstance(r.get("started"), (int, float))
            else ""
        )
        term.field(
            "recording",
            f"now, by pid {safe(r.get('pid'))} on host {safe(r.get('host'))}{started}: "
            "what follows is the run as read a moment ago",
        )
    _steps(s, term)
    term.field("recorded on", safe(summary(s.environment) or "not recorded (a run recorded before ckptlab kept it)"))
    term.print(_checkpoints(s.checkpoints))
    _anomalies(s.anomalies, term)
    for e in s.warnings:
        term.field("[yellow]warned[/yellow]", f"step {e['step']}: {safe(e.get('detail') or e['kind'])}")
    v = s.validation
    if v["count"]:
        best = v["best"]
        term.field(
            "validation",
            f"{v['count']} points"
            + (f"; best {safe(v['metric'])}={precise(best['value'])} at step {best['step']}" if best else ""),
        )
    d = s.disk
    term.field(
        "disk",
        ", ".join(
            f"{k} {human_bytes(d[k])}" for k in ("checkpoints", "batches", "journal", "sources", "archive") if d[k]
        )
        + f"; total {human_bytes(d['total'])}",
    )
    _functions(s.functions, term)


def _steps(s, term) -> None:
    """The steps, ranks and sessions recorded, and any step that never returned."""
    st = s.steps
    if st["recorded"]:
        term.field(
            "steps",
            f"{st['recorded']} recorded: {st['first']}..{st['last']}; "
            + (f"batches kept for {_spans(st['batch_ranges'])}" if st["batch_ranges"] else "no batches kept"),
        )
    else:
        term.field("steps", "none recorded yet")
    if s.world_size > 1:
        term.field(
            "ranks",
            f"{s.world_size} ({s.layout}): "
            + "; ".join(f"rank {r} batches {_spans(v)}" for r, v in st["ranks"].items()),
        )
    if st.get("loss_not_known"):
        term.field("loss", f"not known at steps {_spans(st['loss_not_known'])}: they returned none (no NaN)")
    if st["incomplete"]:
        term.field(
            "[yellow]incomplete[/yellow]",
            f"step(s) {st['incomplete']}: batch recorded, but the step never returned (crash?)",
        )
    term.field(
        "sessions",
        f"{len(s.sessions)}: "
        + ", ".join(
            f"#{x['session']} from step {x['start_step']}"
            + (f" (restored {x['restored_from']})" if x.get("restored_from") is not None else "")
            for x in s.sessions
        ),
    )


def _checkpoints(checkpoints) -> Table:
    table = Table(title="checkpoints", title_justify="left", show_edge=False)
    for col in ("step", "reason", "size", "integrity", "health", "validation"):
        table.add_column(col)
    for c in checkpoints:
        integrity = (
            "[green]ok[/green]"
            if c.verified
            else ("[dim]not checked[/dim]" if c.verified is None else f"[red]FAILED[/red] {safe(c.problem)}")
        )
        val = safe(", ".join(f"{k}={value(v)}" for k, v in (c.validation or {}).items()))
        table.add_row(
            str(c.step),
            safe(c.reason),
            human_bytes(c.bytes),
            integrity,
            "healthy" if c.healthy else "[yellow]after anomaly[/yellow]",
            val,
        )
    return table


def _anomalies(anomalies, term) -> None:
    if not anomalies:
        term.field("anomalies", "none seen while recording")
        return
    first = anomalies[0]
    term.field("[red]anomalies[/red]", f"{len(anomalies)}, first at step {first['step']} ({safe(first['kind'])})")
    for e in anomalies[:10]:
        term.print(f"  step {e['step']:>8}  {safe(e['kind']):<18} {safe(value(e.get('value'), missing=''))}")
    if len(anomalies) > 10:
        term.print(f"  ... {len(anomalies) - 10} more (--json lists all)")


def _functions(functions, term) -> None:
    """Each recorded function (build_fn, step_fn): the file replay runs and whether it is as
    recorded (the same answer replay acts on: run/manifest.py `recorded_code`)."""
    for role, f in functions.items():
        file = f.get("runs") or f["file"]
        if f.get("installed"):
            state = "ckptlab's installed module" + (
                ", changed since recording (a ckptlab upgrade): replay runs it" if f["changed"] else ", unchanged"
            )
        elif f["changed"] and f.get("same_tokens"):
            state = "[yellow]changed since recording in comments/formatting only[/yellow]: replay runs it"
        elif f["changed"]:
            state = "[yellow]source changed since recording[/yellow]"
        elif f["changed"] is False:
            state = "unchanged"
        else:
            state = "[yellow]file not found[/yellow]" if not f["found"] else "[yellow]recorded without a hash[/yellow]"
        term.field(safe(role), f"{safe(f['name'])}  ({safe(file)}: {state})")


def _spans(ranges) -> str:
    return ", ".join(f"{a}..{b}" if a != b else str(a) for a, b in ranges)
