"""`ckptlab export`: hand a run's health to the viewers people already use."""

from __future__ import annotations

from pathlib import Path

import click

from ckptlab.cli.common import end_with_problems, find_run, json_option, open_terminal, run_option, trust_option


@click.command("export")
@run_option
@click.option(
    "--tensorboard",
    "tb_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write TensorBoard event files into this folder (must hold none yet); view with `tensorboard --logdir`.",
)
@click.option(
    "--mlflow",
    "mlflow_uri",
    default=None,
    metavar="URI",
    help="Log into an MLflow tracking store: sqlite:///mlflow.db (MLflow 3's local default), a server "
    "(http://host:5000), or a folder / file: URI (MLflow's file store). The run is found again by its tag "
    "ckptlab.run on the next export.",
)
@click.option(
    "--wandb",
    "wandb_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write an offline Weights & Biases run into this folder (no network); upload it with the `wandb sync` command printed.",
)
@click.option(
    "--experiment",
    default="ckptlab",
    show_default=True,
    help="MLflow experiment / W&B project to log into.",
)
@click.option("--run-name", default=None, help="Name of the MLflow / W&B run (default: the run directory's name).")
@click.option(
    "--html/--no-html",
    default=True,
    show_default=True,
    help="Attach `ckptlab report --html`'s page to the MLflow / W&B run.",
)
@click.option(
    "--grads/--no-grads",
    default=True,
    show_default=True,
    help="Histogram each checkpoint's gradients by replaying the step that starts there (runs your recorded build_fn/step_fn).",
)
@click.option(
    "--every",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Send the health curves every N steps (and at each step with an anomaly, a validation or a "
    "checkpoint). Default: every step up to 100,000 points a curve (10,000 a per-parameter curve); on a "
    "longer run every 2, 5, 10, 20, 50, ... steps, whichever keeps it within that. --every 1: every point.",
)
@trust_option
@json_option
def command(
    run_dir,
    tb_dir: Path | None,
    mlflow_uri: str | None,
    wandb_dir: Path | None,
    experiment: str,
    run_name: str | None,
    html: bool,
    grads: bool,
    every: int | None,
    trust_code: bool,
    as_json: bool,
) -> None:
    """Export the run's health to TensorBoard, MLflow or Weights & Biases.

    \b
    Per step: train/loss, train/grad_norm (before clipping), train/lr, train/update_ratio,
    train/step_time, train/nonfinite_grads; per parameter grad_norm/<param>, update_ratio/<param>,
    weight_norm/<param>; val/<metric> at each validation; anomaly/<kind> and an alert line per
    anomaly episode and per worse kind in it (with the replay command). Per checkpoint: a histogram
    of every weight tensor and, with --grads (default), of the gradients of the step that starts
    there. MLflow and W&B also get the run's versions and config as params and the report page
    (--html). Exporting to MLflow or W&B again sends only what is new, and an export that was
    stopped (even killed) is finished by running it again: every point once. Needs the viewer's
    extra: pip install -e ".[tensorboard]" / ".[mlflow]" / ".[wandb]". A folder is MLflow's file
    store: reading it back needs MLFLOW_ALLOW_FILE_STORE=true (sqlite: does not).
    """
    chosen = [t for t in (tb_dir, mlflow_uri, wandb_dir) if t is not None]
    if len(chosen) != 1:
        raise click.UsageError("choose one of --tensorboard DIR, --mlflow URI, --wandb DIR")
    from ckptlab.run.reader import open_run

    term = open_terminal(as_json)
    _require_viewer(tb_dir, wandb_dir)
    run = open_run(find_run(run_dir, term))
    sink = None
    if mlflow_uri is not None:
        from ckptlab.render.trackers import open_mlflow

        sink = open_mlflow(mlflow_uri, run=run, experiment=experiment, run_name=run_name)
    gradients = _gradients(run, trust_code) if grads else None
    with term.progress("exporting checkpoints", total=len(run.checkpoints)) as advance:
        kw = {"gradients": gradients, "progress": advance, "every": every}
        if tb_dir is not None:
            from ckptlab.render.tensorboard import write_tensorboard

            summary = write_tensorboard(run, tb_dir, **kw)
        elif sink is not None:
            from ckptlab.render.trackers import write_mlflow

            summary = write_mlflow(run, sink, html=html, **kw)
        else:
            from ckptlab.render.trackers import write_wandb

            assert wandb_dir is not None, "exactly one of the three destinations was chosen"
            summary = write_wandb(run, wandb_dir, project=experiment, run_name=run_name, html=html, **kw)
    _say(term, summary, run, as_json, tb_dir, wandb_dir)
    # What was readable is exported; damage (a corrupt segment, a checkpoint that fails its
    # check) is then the command's one error line and exit 1, as in `info`.
    end_with_problems(run.problems, run.damaged, term)


def _require_viewer(tb_dir, wandb_dir) -> None:
    """Before anything runs: a missing extra or an unreachable store is one line, not a late failure."""
    if tb_dir is not None:
        from ckptlab.render.tensorboard import require_tensorboard

        require_tensorboard()
    elif wandb_dir is not None:
        from ckptlab.render.trackers import check_wandb

        check_wandb()
    else:
        from ckptlab.trackers.mlflow_tracker import require_mlflow

        require_mlflow()


def _gradients(run, trust_code: bool):
    """step -> the gradients of the step that starts at that checkpoint, by replaying it."""
    from ckptlab.replayer.driver import Replayer
    from ckptlab.replayer.gradients import checkpoint_gradients

    replayer = Replayer(run, trust_code=trust_code)
    return lambda step: checkpoint_gradients(run, step, replayer=replayer)


def _say(term, summary, run, as_json: bool, tb_dir, wandb_dir) -> None:
    """The export's notes on stderr, then what it wrote (or that nothing was new)."""
    for note in summary.notes:
        term.warn(note)
    if as_json:
        term.json(summary)
    elif summary.already_exported:
        where = summary.target + (f" (run {summary.run_id})" if summary.run_id else "")
        term.print(f"{where}: already holds everything in {run.path}; nothing new to export")
    else:
        _wrote(term, summary, tb_dir, wandb_dir)


def _wrote(term, summary, tb_dir, wandb_dir) -> None:
    term.print(
        f"wrote [bold]{summary.target}[/bold]"
        + (f" (run {summary.run_id})" if summary.run_id else "")
        + f": {summary.steps} steps, {summary.scalars} scalar points, "
        f"{summary.histograms} histograms at checkpoints {summary.checkpoints}"
        + (f" (gradients at {summary.gradient_checkpoints})" if summary.gradient_checkpoints else "")
        + (f", {summary.alerts} anomaly alerts" if summary.alerts else "")
    )
    if tb_dir is not None:
        term.print(f"view it with: tensorboard --logdir {summary.target}")
    elif wandb_dir is not None:
        # --id: the fragments of one run id (one per export that found new points) go up in order
        term.print(f"upload it with: wandb sync --id {summary.run_id} {summary.target}")
