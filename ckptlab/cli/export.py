"""`ckptlab export`: hand a run's health to the viewers people already use."""

from __future__ import annotations

from pathlib import Path

import click

from ckptlab.cli.common import find_run, json_option, open_terminal, run_option, trust_option


@click.command("export")
@run_option
@click.option(
    "--tensorboard",
    "tb_dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Write TensorBoard event files into this folder (must hold none yet); view with `tensorboard --logdir`.",
)
@click.option(
    "--grads/--no-grads",
    default=True,
    show_default=True,
    help="Histogram each checkpoint's gradients by replaying the step that starts there (runs your recorded build_fn/step_fn).",
)
@trust_option
@json_option
def command(run_dir, tb_dir: Path, grads: bool, trust_code: bool, as_json: bool) -> None:
    """Export the run's health as TensorBoard event files.

    \b
    Per step: loss, gradient norm (before clipping), learning rate, update ratio, step time,
    per-parameter gradient norms / update ratios / weight norms; validation metrics; the
    anomalies the Recorder flagged (as text). Per checkpoint: a histogram of every weight
    tensor and, with --grads (default), of the gradients of the step that starts there.
    Needs the tensorboard package: pip install 'ckptlab[tensorboard]'.
    """
    from ckptlab.render.tensorboard import require_tensorboard, write_tensorboard
    from ckptlab.run.reader import open_run

    term = open_terminal(as_json)
    require_tensorboard()  # before anything runs: a missing extra is one line, not a late failure
    run = open_run(find_run(run_dir, term))
    gradients = None
    if grads:
        from ckptlab.replayer.driver import Replayer
        from ckptlab.replayer.gradients import checkpoint_gradients

        replayer = Replayer(run, trust_code=trust_code)
        gradients = lambda step: checkpoint_gradients(run, step, replayer=replayer)  # noqa: E731
    with term.progress("exporting checkpoints", total=len(run.checkpoints)) as advance:
        summary = write_tensorboard(run, tb_dir, gradients=gradients, progress=advance)
    for note in summary.notes:
        term.warn(note)
    if as_json:
        term.json(summary)
        return
    term.print(
        f"wrote [bold]{summary.logdir}[/bold]: {summary.steps} steps, {summary.scalars} scalar points, "
        f"{summary.histograms} histograms at checkpoints {summary.checkpoints}"
        + (f" (gradients at {summary.gradient_checkpoints})" if summary.gradient_checkpoints else "")
    )
    term.print(f"view it with: tensorboard --logdir {summary.logdir}")
