"""`ckptlab info`: what a run holds, and whether it is intact."""

from __future__ import annotations

import click

from ckptlab.cli.common import end_with_problems, find_run, json_option, open_terminal, run_option


@click.command("info")
@run_option
@json_option
@click.option("--no-verify", is_flag=True, help="Skip hashing checkpoint files (faster on large runs).")
def command(run_dir, as_json: bool, no_verify: bool) -> None:
    """Summarize a run: steps recorded, checkpoints (integrity verified against their hashes),
    anomalies seen while recording (and the Recorder's warnings about its own record, such as an
    optimizer that never stepped), validation points, disk use per part, and whether the
    recorded build_fn/step_fn source changed since recording.

    Exits 1 when anything recorded is damaged: a checkpoint that fails its hashes, a corrupt
    or truncated log segment or checkpoint file. A crash's torn tail is only a warning.
    """
    from ckptlab.analysis.summary import summarize
    from ckptlab.render.info import render
    from ckptlab.run.reader import open_run

    term = open_terminal(as_json)
    run = open_run(find_run(run_dir, term))
    summary = summarize(run, verify=not no_verify)
    if as_json:
        term.json(summary)
    else:
        render(summary, term)
    end_with_problems(summary.problems, summary.damaged, term)
