"""`ckptlab report`: what the training curves say, with evidence and remedies."""

from __future__ import annotations

from pathlib import Path

import click

from ckptlab.cli.common import end_with_problems, find_run, json_option, open_terminal, run_option


@click.command("report")
@run_option
@json_option
@click.option(
    "--html",
    "html_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write a self-contained HTML page with plots (no network needed to view it).",
)
@click.option(
    "--no-weights", is_flag=True, help="Skip reading checkpoints (weight histograms, drift, bit-identical layers)."
)
@click.option(
    "--patience",
    type=click.IntRange(1),
    default=3,
    show_default=True,
    help="Validation evaluations without improvement before validation counts as turned up.",
)
@click.option(
    "--flops-per-token",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="The model's training FLOPs per token (about 6 x its parameters for a transformer): adds the MFU.",
)
@click.option(
    "--peak-flops",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="The device's peak FLOP/s for the MFU (default: a known GPU's dense bf16 peak; the CPU has none).",
)
@click.option(
    "--fail-on",
    type=click.Choice(["never", "warning", "error"]),
    default="never",
    show_default=True,
    help="Exit 1 when a finding is at least this severe (for CI).",
)
def command(
    run_dir,
    as_json: bool,
    html_path: Path | None,
    no_weights: bool,
    patience: int,
    flops_per_token: float | None,
    peak_flops: float | None,
    fail_on: str,
) -> None:
    """Diagnose the training curves of a run.

    \b
    The loss curve is classified (fast drop, slow drop, flat, NaN/Inf explosion, overfitting,
    oscillation, plateau, spikes and how they recovered); a NaN/Inf that a recorded batch
    carried in names its row and sample id instead. Gradients are checked (explosion,
    vanishing, dead, per-layer imbalance) and parameters (frozen, update ratio outside
    [1e-3, 1e-1], non-finite or exploding weights, drift across checkpoints). Language
    models also get perplexity. Where the time went: a loop waiting for its data, steps far
    slower than their neighbours (with the cause: a checkpoint, a GC pause, a recompile, a
    long batch, a data wait), throughput that falls and stays down, memory pressure, and the
    MFU when --flops-per-token is given. Each finding comes with its steps, evidence and remedies.
    Thresholds are documented in docs/report.md.
    """
    from dataclasses import replace

    from ckptlab.analysis.health import HealthRules, diagnose
    from ckptlab.render.report import render
    from ckptlab.run.reader import open_run

    term = open_terminal(as_json)
    run = open_run(find_run(run_dir, term))
    with term.status("reading the run"):
        rules = replace(HealthRules(), patience=patience, flops_per_token=flops_per_token, peak_flops=peak_flops)
        report = diagnose(run, rules, weights=not no_weights, plots=html_path is not None)
    if html_path is not None:
        from ckptlab.render.html import report_page
        from ckptlab.run.atomic import write_bytes_atomic

        html_path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(html_path, report_page(report).encode())
        term.note(f"wrote {html_path}")
    if as_json:
        term.json(report)
    else:
        render(report, run, term)
    end_with_problems(run.problems, run.damaged, term)
    order = {"never": -1, "error": 0, "warning": 1}[fail_on]
    if order >= 0 and any({"error": 0, "warning": 1, "info": 2}[f.severity] <= order for f in report.findings):
        raise click.exceptions.Exit(1)
