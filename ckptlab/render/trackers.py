"""`ckptlab export --mlflow URI` and `--wandb DIR`: a finished (or running) run, after the fact.

    summary = write_mlflow(run, "file:./mlruns", experiment="exp1")
    summary = write_wandb(run, "wandb-export")     # then: wandb sync --id <summary.run_id> <summary.target>

The rows are render/export.py's, as for TensorBoard; the params are the run's versions and
recording config; the artifact is `ckptlab report --html`'s page. Exporting again sends only
what the previous export did not (a cursor per ckptlab run: the MLflow run's tag
`ckptlab.export_cursor`; for W&B the file `DIR/ckptlab-export.json`), so no point is sent twice.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ckptlab.errors import CkptlabError
from ckptlab.io.files import read_text
from ckptlab.render.export import ExportSummary, export_run, pending, run_key, with_report
from ckptlab.run.atomic import write_bytes_atomic
from ckptlab.run.reader import Run
from ckptlab.trackers.points import run_params

if TYPE_CHECKING:
    from ckptlab.trackers.mlflow_tracker import MLflow

CURSOR_FILE = "ckptlab-export.json"


def open_mlflow(uri, *, run: Run, experiment: str, run_name: str | None) -> MLflow:
    """The MLflow run this ckptlab run exports into (checked reachable: before any work)."""
    from ckptlab.trackers.mlflow_tracker import MLflow

    return MLflow.for_export(uri, experiment=experiment, run_name=run_name or run.path.name, run_key=run_key(run))


def write_mlflow(run: Run, sink: MLflow, *, html: bool = True, **kw) -> ExportSummary:
    """Export `run` into the MLflow run `sink` (from `open_mlflow`)."""
    out = ExportSummary(sink.where, 0, 0, 0, [], [], run_id=sink.run_id)
    try:
        cursor = sink.cursor()
        if not pending(run, cursor):
            out.already_exported = True
            return out
        sink.log_params(run_params(run.manifest))
        export_run(run, sink, out, cursor=cursor, save_cursor=sink.save_cursor, **kw)
        if html:
            with_report(run, sink, out)
    finally:
        sink.close()
    return out


def check_wandb() -> None:
    from ckptlab.trackers.wandb_tracker import require_wandb

    require_wandb()


def write_wandb(
    run: Run,
    folder: str | os.PathLike,
    *,
    project: str = "ckptlab",
    run_name: str | None = None,
    html: bool = True,
    **kw,
) -> ExportSummary:
    """Export `run` as an offline W&B run under `folder` (`wandb sync` uploads it). A second
    export of the same ckptlab run adds a fragment of the same W&B run id with only the new
    points (`wandb sync --id <run id>` uploads the fragments in order)."""
    from ckptlab.trackers.wandb_tracker import WandB

    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise CkptlabError("is not a folder", path=folder)
    key = run_key(run)
    state = _read_state(folder)
    cursor = state.get(key, {}).get("cursor", {})
    out = ExportSummary(str(folder), 0, 0, 0, [], [], run_id=f"ckptlab-{key}")
    if not pending(run, cursor):
        out.already_exported = True
        return out
    sink = WandB(
        dir=folder,
        mode="offline",
        project=project,
        name=run_name or run.path.name,
        id=out.run_id,
        config=run_params(run.manifest),
    )
    out.target = sink.where

    def save(reached: dict) -> None:
        state[key] = {"wandb_id": sink.run.id, "run": str(run.path), "cursor": reached}
        folder.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(folder / CURSOR_FILE, (json.dumps(state, indent=2, sort_keys=True) + "\n").encode())

    try:
        export_run(run, sink, out, cursor=cursor, **kw)
        if html:
            with_report(run, sink, out)
    except BaseException:
        sink.close()
        shutil.rmtree(Path(sink.where), ignore_errors=True)  # half a fragment: the next export redoes it whole
        raise
    sink.close()
    # The cursor moves once the fragment is finished: an export that died midway is redone whole.
    if out.steps or out.checkpoints or out.alerts or out.scalars:
        save(_last(run))
    return out


def _last(run: Run) -> dict:
    steps = run.metrics().step
    return {
        "health": int(steps[-1]) if len(steps) else -1,
        "validation": max((v["step"] for v in run.validation()), default=-1),
        "events": max((e["step"] for e in run.events()), default=-1),
        "checkpoints": max(run.checkpoints, default=-1),
    }


def _read_state(folder: Path) -> dict:
    path = folder / CURSOR_FILE
    if not path.is_file():
        return {}
    try:
        state = json.loads(read_text(path))
    except (ValueError, UnicodeDecodeError) as e:
        raise CkptlabError(f"unreadable export cursor ({e})", path=path) from None
    if not isinstance(state, dict):
        raise CkptlabError("unreadable export cursor (not a JSON object)", path=path)
    return state
