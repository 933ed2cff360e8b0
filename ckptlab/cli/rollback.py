"""`ckptlab rollback`: go back to the best-validation or last healthy checkpoint."""

from __future__ import annotations

from pathlib import Path

import click

from ckptlab.cli.common import find_run, json_option, open_terminal, run_option


@click.command("rollback")
@run_option
@json_option
@click.option(
    "--metric", default=None, help="Validation metric to choose by (default: the run's val_metric, e.g. val_loss)."
)
@click.option(
    "--mode",
    type=click.Choice(["min", "max"]),
    default=None,
    help="Whether lower or higher --metric is better (default: the run's val_mode; required when --metric is not the run's val_metric).",
)
@click.option(
    "--before-anomaly", is_flag=True, help="Choose the last healthy checkpoint before the first anomaly instead."
)
@click.option(
    "--patience",
    type=click.IntRange(1),
    default=3,
    show_default=True,
    help="Evaluations without improvement before validation counts as turned up (early stopping).",
)
@click.option(
    "--to",
    "to_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Export the chosen checkpoint here as plain files (model.safetensors, optimizer.pt) instead of rewinding the run.",
)
@click.option("--dry-run", is_flag=True, help="Show the candidates and what would happen; change nothing.")
@click.option("--no-verify", is_flag=True, help="Do not hash every candidate (the chosen one is always verified).")
def command(run_dir, as_json, metric, mode, before_anomaly, patience, to_dir, dry_run, no_verify) -> None:
    """Choose a checkpoint and restore it.

    \b
    Candidates are the retained checkpoints with their validation metrics, health and
    integrity. By --metric (the default when validation was logged): early stopping, the
    best value before validation turned up. By --before-anomaly: the last healthy checkpoint
    before the first anomaly. Then --to DIR exports it; without --to the run is rewound:
    later steps move under RUN/archive/<name>/ (never deleted) and
    Recorder(..., resume=True) continues from the chosen step. Stop training first.
    An interrupted rollback is finished by running this command again.
    """
    from ckptlab.analysis.rollback import choose
    from ckptlab.errors import CkptlabError
    from ckptlab.jsonable import plain
    from ckptlab.render.rollback import render
    from ckptlab.run import archive, lock
    from ckptlab.run.reader import open_run

    if before_anomaly and (metric or mode):
        raise click.UsageError("--before-anomaly chooses by health; do not combine it with --metric/--mode")
    term = open_terminal(as_json)
    path = find_run(run_dir, term)
    if not dry_run and to_dir is None:  # refuse at once, not after hashing every candidate
        lock.check_unlocked(path)  # (rewinding takes the lock itself: run/archive.py)
    pending = archive.unfinished_rollback(path)
    if pending is not None:
        if dry_run:
            raise CkptlabError(
                f"a rollback into {pending} was interrupted", path=path, hint="run without --dry-run to finish it"
            )
        plan = archive.finish_interrupted(path)
        if plan is not None:  # None: another process finished it first; go on as if we had started later
            result = {"finished_interrupted": True, "action": {"kind": "rewind", **plan.summary()}}
            if as_json:
                term.json(result)
            else:
                term.print(
                    f"finished the interrupted rollback to step {plan.step} (archive {plan.archive}); nothing else was changed. "
                    "Run the command again to choose anew."
                )
            return
    run = open_run(path)
    with term.status("verifying checkpoints"):
        choice = choose(
            run, metric=metric, mode=mode, before_anomaly=before_anomaly, patience=patience, verify=not no_verify
        )
    assert choice.step is not None  # choose() picks a checkpoint or raises
    target = run.checkpoint(choice.step)
    target.verify()  # always, even with --no-verify: nothing moves on a corrupt target
    action = _act(run, path, choice, to_dir, dry_run)
    if as_json:
        term.json({**plain(choice), "action": action})
    else:
        render(choice, action, term)


def _act(run, path: Path, choice, to_dir: Path | None, dry_run: bool) -> dict:
    from ckptlab.run import archive
    from ckptlab.run.portable import export_checkpoint

    if to_dir is not None:
        if dry_run:
            return {"kind": "export", "dry_run": True, "to": str(to_dir), "step": choice.step}
        info = export_checkpoint(run.checkpoint(choice.step), to_dir, run=str(path))
        return {
            "kind": "export",
            "dry_run": False,
            "to": str(to_dir),
            "step": choice.step,
            "files": info["files"],
            "load": info["load"],
        }
    plan = archive.plan_rewind(path, choice.step)
    if plan.empty:
        return {
            "kind": "none",
            "dry_run": dry_run,
            "step": choice.step,
            "note": f"nothing was recorded after step {choice.step}: the run already ends there",
        }
    if not dry_run:
        archive.rewind(
            path,
            choice.step,
            archive=plan.archive,
            info={"by": choice.by, "metric": choice.metric, "mode": choice.mode, "why": choice.why},
        )
    return {
        "kind": "rewind",
        "dry_run": dry_run,
        **plan.summary(),
        "resume": f"Recorder({str(path)!r}, ..., resume=True) restores checkpoint {choice.step} and records on from step {choice.step}",
    }
