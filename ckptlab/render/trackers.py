"""`ckptlab export --mlflow URI` and `--wandb DIR`: a finished (or running) run, after the fact.

    summary = write_mlflow(run, open_mlflow("sqlite:///mlflow.db", run=run, experiment="exp1", run_name=None))
    summary = write_wandb(run, "wandb-export")     # then: wandb sync --id <summary.run_id> <summary.target>

The rows are render/export.py's, as for TensorBoard; the params are the run's versions and
recording config; the artifact is `ckptlab report --html`'s page. Exporting again sends only
what the previous export did not (a cursor per ckptlab run: the MLflow run's tag
`ckptlab.export_cursor`; for W&B the file `DIR/ckptlab-export.json`), so no point is sent twice,
even after an export that was killed: MLflow's cursor names the batch being sent (see
render/export.py's `export_run`), and a W&B fragment counts only once the state file lists it
as finished (one that is not, an export killed midway left: it is removed and redone).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sqlite3
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
    """Export `run` into the MLflow run `sink` (from `open_mlflow`). The MLflow run ends
    FINISHED, or FAILED (KILLED on Ctrl-C) when the export stopped: its cursor says how far it
    got, and the next export goes on from there. One killed outright stays RUNNING."""
    out = ExportSummary(sink.where, 0, 0, 0, [], [], run_id=sink.run_id)
    try:
        cursor = sink.cursor()
        if pending(run, cursor):
            sink.log_params(run_params(run.manifest))
            export_run(run, sink, out, cursor=cursor, save_cursor=sink.save_cursor, **kw)
            if html:
                with_report(run, sink, out)
        else:
            out.already_exported = True
    except BaseException as e:
        with contextlib.suppress(Exception):
            sink.close(status="KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        if isinstance(e, (OSError, sqlite3.Error)) or type(e).__module__.startswith(("mlflow", "sqlalchemy")):
            # the store's disk or server failed mid-export: one line (the next export resumes)
            first = (str(e).strip().splitlines() or [""])[0]
            raise CkptlabError(
                f"the MLflow store failed while exporting: {type(e).__name__}: {first}", path=sink.where
            ) from None
        raise
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
    wandb_id = f"ckptlab-{key}"
    out = ExportSummary(str(folder), 0, 0, 0, [], [], run_id=wandb_id)
    finished = _drop_unfinished(folder, wandb_id, state.get(key, {}), out)
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
        done = [*finished, Path(sink.where).name]
        state[key] = {"wandb_id": sink.run.id, "run": str(run.path), "cursor": reached, "fragments": done}
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
    # The cursor moves, and the fragment is listed, once it is finished: a fragment of an
    # export that died midway (killed: no except clause ran) is removed by the next export.
    if out.steps or out.checkpoints or out.alerts or out.scalars:
        save(_last(run))
    return out


def _drop_unfinished(folder: Path, run_id: str, entry: dict, out: ExportSummary) -> list[str]:
    """The finished fragments of `run_id` (the state file lists them); remove the others: an
    export killed midway left them, and their points are sent again. A state file from before
    the list: every fragment there was finished (ckptlab removed a failed one itself)."""
    name = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    fragments = sorted(p.name for p in (folder / "wandb").glob("offline-run-*") if name.fullmatch(p.name))
    finished = entry.get("fragments", fragments if entry else [])
    stale = [f for f in fragments if f not in finished]
    for f in stale:
        shutil.rmtree(folder / "wandb" / f, ignore_errors=True)
    if stale:
        out.notes.append(
            f"removed {len(stale)} unfinished fragment(s) of W&B run {run_id} that a stopped export left "
            f"({', '.join(stale)}): their points are sent again"
        )
    return [f for f in finished if f in fragments]


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
