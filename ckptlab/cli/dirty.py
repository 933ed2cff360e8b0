"""`ckptlab dirty`: find the dirty batches and samples of a run; write a skip list."""

from __future__ import annotations

from pathlib import Path

import click

from ckptlab.cli.common import end_with_problems, find_run, json_option, open_terminal, run_option, trust_option


@click.command("dirty")
@run_option
@json_option
@click.option(
    "--out",
    "out_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the skip list (JSON) here, for ckptlab.skip_samples(...) on resume.",
)
@click.option(
    "--attribute/--no-attribute",
    default=True,
    show_default=True,
    help="Replay flagged steps for per-sample loss and gradient norm.",
)
@click.option("--top", type=click.IntRange(1), default=20, show_default=True, help="Rows to show (--json lists all).")
@click.option("--loss-z", type=float, default=None, help="Loss spike: robust z over the window (default 6, as OLMo).")
@click.option("--grad-z", type=float, default=None, help="Gradient-norm spike: robust z (default 6).")
@click.option("--window", type=click.IntRange(2), default=None, help="Spike window in steps (default 128).")
@click.option(
    "--loss-ratio", type=float, default=None, help="Loss spike: also >= this x the window median (default 1.2)."
)
@click.option(
    "--grad-ratio", type=float, default=None, help="Gradient spike: also >= this x the window median (default 5)."
)
@click.option(
    "--extreme-z", type=float, default=None, help="A value is extreme beyond this robust z of its field (default 10)."
)
@click.option(
    "--pad-id", type=int, default=None, help="Padding token id (default: data_info['pad_id'], else inferred)."
)
@click.option(
    "--vocab-size", type=int, default=None, help="Vocabulary size (default: data_info, else the embedding's rows)."
)
@click.option(
    "--no-skip-batches", is_flag=True, help="Leave whole spike batches without a row to blame out of the skip list."
)
@trust_option
def command(
    run_dir,
    as_json,
    out_path,
    attribute,
    top,
    loss_z,
    grad_z,
    window,
    loss_ratio,
    grad_ratio,
    extreme_z,
    pad_id,
    vocab_size,
    no_skip_batches,
    trust_code,
) -> None:
    """Scan every retained batch for dirty data, and the step health for spikes.

    \b
    Static: non-finite values, all-padding or empty rows, token ids out of range, values
    extreme against the run's own robust statistics, length outliers, the same content under
    another sample id. Dynamic: loss and gradient-norm spikes (thresholds settable; see
    docs/dirty.md), non-finite losses and gradients, mapped to their batches. With --attribute, flagged
    steps are replayed for per-row loss and gradient norm. Prints a ranked list of
    (step, row, sample_id, reason, evidence); the skip list is written only with --out.
    """
    from dataclasses import replace

    from ckptlab.analysis.dirty import scan, skip_ids, verdict, write_skip_list
    from ckptlab.analysis.dirty.findings import DirtyRules
    from ckptlab.render.dirty import render
    from ckptlab.run.reader import open_run

    term = open_terminal(as_json)
    run = open_run(find_run(run_dir, term))
    rules = replace(
        DirtyRules(),
        loss_spike=_rule(DirtyRules().loss_spike, loss_z, window, loss_ratio),
        grad_spike=_rule(DirtyRules().grad_spike, grad_z, window, grad_ratio),
        extreme_z=extreme_z if extreme_z is not None else DirtyRules().extreme_z,
    )
    info = {k: v for k, v in (("pad_id", pad_id), ("vocab_size", vocab_size)) if v is not None}
    attribute_rows, unavailable = _attribution(run, trust_code) if attribute else (None, None)
    with term.progress("scanning batches", total=len(run.steps)) as update:
        report = scan(run, rules, attribute=attribute_rows, data_info=info, progress=update)
    if unavailable and any(f["batch"] == "retained" for f in report.steps):  # else nothing to attribute
        report.attribution = {"status": "unavailable", "note": unavailable, "steps": []}
        term.warn(f"attribution skipped: {unavailable}")
    if no_skip_batches:
        report.skip_ids = skip_ids(report, whole_batches=False)
    if out_path is not None:
        write_skip_list(report, out_path)
        term.note(f"wrote {out_path} ({len(report.skip_ids)} sample ids)")
    report.verdict = verdict(report, written=out_path)  # the skip list as it now is, written or not
    if as_json:
        term.json(report)
    else:
        render(report, term, top)
    end_with_problems(run.problems, run.damaged, term)


def _attribution(run, trust_code: bool):
    """(replay's per-row attribution, None), or (None, why it cannot be had here): replay is
    missing, the run's build_fn/step_fn are not code it may run (training/userfns.py), or it
    is a pipeline's (its stages run together only)."""
    import functools

    from ckptlab.errors import UntrustedCodeError

    try:
        from ckptlab.replayer import attribute_rows
        from ckptlab.training.userfns import trusted_file
    except ImportError as e:
        return None, f"replay attribution is not available ({e})"
    if run.manifest.get("pipeline") is not None:
        return None, "per-row attribution replays one rank alone, and a pipeline stage cannot run without the others"
    try:
        for role, desc in run.manifest.get("functions", {}).items():
            trusted_file(desc, role, run.path, trust=trust_code)
    except UntrustedCodeError as e:
        return None, str(e)
    return functools.partial(attribute_rows, trust_code=trust_code), None


def _rule(rule, z, window, ratio):
    from dataclasses import replace

    changes = {k: v for k, v in (("z", z), ("window", window), ("min_ratio", ratio)) if v is not None}
    return replace(rule, **changes) if changes else rule
