"""Terminal rendering of `ckptlab report`'s HealthReport: the curves as sparklines, then the
findings with their evidence and remedies."""

from __future__ import annotations

import numpy as np

from ckptlab.numbers import LOSS_NOT_KNOWN, value
from ckptlab.render.text import safe, sparkline

SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "dim"}
LABEL = 12  # where a curve's sparkline starts: "grad norm   ▁▂▃"


def render(r, run, term) -> None:
    m = run.metrics()
    st, c = r.steps, r.curve
    if not st["recorded"]:
        term.print(f"[bold]{r.run}[/bold]: no steps recorded yet")
        return
    term.print(f"[bold]{r.run}[/bold]  steps {st['first']}..{st['last']} ({st['recorded']} recorded)")
    loss = m.loss[m.loss_known]  # (a step that returned no loss has no point: not a NaN's "!")
    term.field(
        "loss",
        f"{sparkline(loss)}  {value(c.first)} -> {value(c.last)} (best {value(c.best)} at step {c.best_step})  "
        f"[bold]{c.kind.replace('_', ' ')}[/bold]"
        + (f" (shape: {c.shape.replace('_', ' ')})" if c.kind != c.shape else "")
        if len(loss)
        else f"{LOSS_NOT_KNOWN}: the steps returned none",
        width=LABEL,
    )
    if r.perplexity:
        p = r.perplexity
        with np.errstate(over="ignore"):
            ppl = np.exp(np.minimum(loss, 700))
        term.field(
            "perplexity",
            f"{sparkline(ppl)}  {value(p.first)} -> {value(p.last)} (best {value(p.best)} at step {p.best_step})"
            + (f"; validation best {value(p.val_best)}" if p.val_best is not None else ""),
            width=LABEL,
        )
    val = [(pt["step"], pt["metrics"]) for pt in run.validation()]
    metric = run.manifest.get("config", {}).get("val_metric", "val_loss")
    values = [mm[metric] for _, mm in val if metric in mm]
    if values:
        best = min(values) if run.manifest.get("config", {}).get("val_mode", "min") == "min" else max(values)
        term.field(safe(metric), f"{sparkline(values)}  {len(values)} points, best {value(best)}", width=LABEL)
    g = m.grad_norm
    if np.isfinite(g).any():
        term.field(
            "grad norm",
            f"{sparkline(np.log10(np.maximum(g, 1e-30)))}  median {value(float(np.nanmedian(g)))}, "
            f"max {value(float(np.nanmax(g)))} (log scale, before clipping)",
            width=LABEL,
        )
    term.print("")
    if not r.findings:
        term.print("[green]no findings[/green]")
    for f in r.findings:
        _finding(f, term)
    term.print("")
    term.field("[bold]verdict:[/bold]", safe(r.verdict), width=9)


def _finding(f, term) -> None:
    """One finding: its title; for a warning or an error, its evidence, each of its steps when it
    lists them (slow_steps: each step's time and cause), its remedies."""
    style = SEVERITY_STYLE[f.severity]
    term.field(f"[{style}]{f.severity.upper()}[/{style}]", f"[bold]{f.kind}[/bold]: {safe(f.title)}", width=8)
    if f.severity == "info":
        return
    per_step = f.evidence.get("steps")
    if not (isinstance(per_step, list) and per_step and isinstance(per_step[0], dict) and "detail" in per_step[0]):
        per_step = None
    if f.evidence:
        shown = {k: v for k, v in f.evidence.items() if per_step is None or k != "steps"}
        term.field("        evidence:", safe(_evidence(shown)), width=18)
    for s in (per_step or [])[:10]:  # (slow_steps: each step, its time and its cause)
        term.field(
            f"        step {s['step']}:",
            safe(f"{value(s['wall_time'])} s (usual {value(s['usual_wall_time'])} s): {s['cause']}: {s['detail']}"),
            width=20,
        )
    for remedy in f.remedies:
        term.field("        ->", safe(remedy), width=11)


def _evidence(ev: dict, limit: int = 6) -> str:
    items = list(ev.items())
    text = ", ".join(f"{k}={_short(v)}" for k, v in items[:limit])
    return text + (f", ... ({len(items) - limit} more; --json has all)" if len(items) > limit else "")


def _short(v) -> str:
    if isinstance(v, float):
        return value(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_short(x)}" for k, x in list(v.items())[:3]) + (", ...}" if len(v) > 3 else "}")
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_short(x) for x in list(v)[:5]) + (", ...]" if len(v) > 5 else "]")
    return str(v)
