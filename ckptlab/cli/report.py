"""`ckptlab report`: what the training curves say, with evidence and remedies."""

from __future__ import annotations

from pathlib import Path

import click

from ckptlab.cli.common import find_run, json_option, run_option

SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "dim"}


@click.command("report")
@run_option
@json_option
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write a self-contained HTML page with plots (no network needed to view it).")
@click.option("--no-weights", is_flag=True, help="Skip reading checkpoints (weight histograms, drift, bit-identical layers).")
@click.option("--patience", type=click.IntRange(1), default=3, show_default=True,
              help="Validation evaluations without improvement before validation counts as turned up.")
@click.option("--fail-on", type=click.Choice(["never", "warning", "error"]), default="never", show_default=True,
              help="Exit 1 when a finding is at least this severe (for CI).")
def command(run_dir, as_json: bool, html_path: Path | None, no_weights: bool, patience: int, fail_on: str) -> None:
    """Diagnose the training curves of a run.

    \b
    The loss curve is classified (fast drop, slow drop, flat, NaN/Inf explosion, overfitting,
    oscillation, plateau, spikes and how they recovered), gradients checked (explosion,
    vanishing, dead, per-layer imbalance) and parameters (frozen, update ratio outside
    [1e-3, 1e-1], non-finite or exploding weights, drift across checkpoints). Language
    models also get perplexity. Each finding comes with its steps, evidence and remedies.
    Thresholds are documented in docs/report.md.
    """
    from dataclasses import replace

    from ckptlab.analysis.health import HealthRules, diagnose
    from ckptlab.render.console import Terminal
    from ckptlab.run.reader import open_run

    term = Terminal(json_mode=as_json)
    run = open_run(find_run(run_dir, term))
    with term.status("reading the run"):
        report = diagnose(run, replace(HealthRules(), patience=patience), weights=not no_weights, plots=html_path is not None)
    if html_path is not None:
        from ckptlab.render.html import report_page
        from ckptlab.run.layout import write_bytes_atomic

        html_path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(html_path, report_page(report).encode())
        term.note(f"wrote {html_path}")
    if as_json:
        term.json(report)
    else:
        render(report, run, term)
    for p in run.problems:
        term.warn(p)
    order = {"never": -1, "error": 0, "warning": 1}[fail_on]
    if order >= 0 and any({"error": 0, "warning": 1, "info": 2}[f.severity] <= order for f in report.findings):
        raise click.exceptions.Exit(1)


def render(r, run, term) -> None:
    import numpy as np

    from ckptlab.render.text import sparkline

    m = run.metrics()
    st, c = r.steps, r.curve
    if not st["recorded"]:
        term.print(f"[bold]{r.run}[/bold]: no steps recorded yet")
        return
    term.print(f"[bold]{r.run}[/bold]  steps {st['first']}..{st['last']} ({st['recorded']} recorded)")
    term.print(f"loss        {sparkline(m.loss)}  {_g(c.first)} -> {_g(c.last)} (best {_g(c.best)} at step {c.best_step})  "
               f"[bold]{c.kind.replace('_', ' ')}[/bold]" + (f" (shape: {c.shape.replace('_', ' ')})" if c.kind != c.shape else ""))
    if r.perplexity:
        p = r.perplexity
        with np.errstate(over="ignore"):
            ppl = np.exp(np.minimum(m.loss, 700))
        term.print(f"perplexity  {sparkline(ppl)}  {_g(p.first)} -> {_g(p.last)} (best {_g(p.best)} at step {p.best_step})"
                   + (f"; validation best {_g(p.val_best)}" if p.val_best is not None else ""))
    val = [(pt["step"], pt["metrics"]) for pt in run.validation()]
    metric = run.manifest.get("config", {}).get("val_metric", "val_loss")
    values = [mm[metric] for _, mm in val if metric in mm]
    if values:
        best = min(values) if run.manifest.get("config", {}).get("val_mode", "min") == "min" else max(values)
        term.print(f"{metric:<11} {sparkline(values)}  {len(values)} points, best {_g(best)}")
    g = m.grad_norm
    if np.isfinite(g).any():
        term.print(f"grad norm   {sparkline(np.log10(np.maximum(g, 1e-30)))}  median {_g(float(np.nanmedian(g)))}, "
                   f"max {_g(float(np.nanmax(g)))} (log scale, before clipping)")
    term.print("")
    if not r.findings:
        term.print("[green]no findings[/green]")
    for f in r.findings:
        style = SEVERITY_STYLE[f.severity]
        term.print(f"[{style}]{f.severity.upper():<7}[/{style}] [bold]{f.kind}[/bold]: {_esc(f.title)}")
        if f.severity == "info":
            continue
        if f.evidence:
            term.print(f"        evidence: {_esc(_evidence(f.evidence))}")
        for remedy in f.remedies:
            term.print(f"        -> {_esc(remedy)}")
    term.print("")
    term.print(f"[bold]verdict:[/bold] {_esc(r.verdict)}")


def _evidence(ev: dict, limit: int = 6) -> str:
    items = list(ev.items())
    text = ", ".join(f"{k}={_short(v)}" for k, v in items[:limit])
    return text + (f", ... ({len(items) - limit} more; --json has all)" if len(items) > limit else "")


def _short(v) -> str:
    if isinstance(v, float):
        return _g(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_short(x)}" for k, x in list(v.items())[:3]) + (", ...}" if len(v) > 3 else "}")
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_short(x) for x in list(v)[:5]) + (", ...]" if len(v) > 5 else "]")
    return str(v)


def _g(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def _esc(text: str) -> str:
    from rich.markup import escape

    return escape(str(text))
