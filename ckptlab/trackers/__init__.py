"""Trackers: ckptlab's health where people already watch training (MLflow, Weights & Biases).

    from ckptlab.trackers import MLflow, WandB
    rec = ckptlab.Recorder(..., trackers=[MLflow("sqlite:///mlflow.db", experiment="exp1"), WandB(project="exp1")])
    rec = ckptlab.Recorder(..., trackers="auto")   # the W&B / MLflow run already active here

`points.py` names what is sent (shared with `ckptlab export`), `tracker.py` declares what a
tracker is (the `Tracker` Protocol), `live.py` sends it off the training thread,
`mlflow_tracker.py` / `wandb_tracker.py` talk to the libraries (imported only when a tracker
is made). docs/integrations.md lists every name and step.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from ckptlab.trackers.tracker import Tracker, TrackerSpec


def __getattr__(name: str):
    if name == "MLflow":
        from ckptlab.trackers.mlflow_tracker import MLflow

        return MLflow
    if name == "WandB":
        from ckptlab.trackers.wandb_tracker import WandB

        return WandB
    raise AttributeError(f"module 'ckptlab.trackers' has no attribute {name!r}")


def resolve(spec: TrackerSpec, loggers: Iterable[Any] = ()) -> list[Tracker]:
    """The trackers to log into, from `RecordConfig.trackers`: a list of `MLflow`/`WandB`
    objects (or W&B runs, or framework loggers), or "auto": the W&B run and MLflow run
    already active in this process, and `loggers` (a Lightning trainer's W&B / MLflow
    loggers). Libraries not imported yet are not imported: "auto" finds nothing there."""
    if spec is None:
        return []
    if isinstance(spec, str):
        if spec != "auto":
            from ckptlab.errors import RecordError

            raise RecordError(f"trackers={spec!r}: pass a list of trackers or 'auto'")
        found = [t for t in (_wrap(lg) for lg in loggers) if t is not None]
        kinds = {t.kind for t in found}
        wandb = sys.modules.get("wandb")
        if "wandb" not in kinds and wandb is not None and getattr(wandb, "run", None) is not None:
            run = _wrap(wandb.run)
            if run is not None:  # None: not a wandb Run (a stand-in): nothing to log into
                found.append(run)
        mlflow = sys.modules.get("mlflow")
        active = mlflow.active_run() if mlflow is not None and hasattr(mlflow, "active_run") else None
        if "mlflow" not in kinds and mlflow is not None and active is not None:
            from ckptlab.trackers.mlflow_tracker import MLflow

            found.append(MLflow(mlflow.get_tracking_uri(), run_id=active.info.run_id))
        if not found:
            import warnings

            warnings.warn("ckptlab: trackers='auto' found no W&B or MLflow run to log into", stacklevel=3)
        return found
    out: list[Tracker] = []
    for item in spec if isinstance(spec, (list, tuple)) else [spec]:
        t = _wrap(item)
        if t is None:
            from ckptlab.errors import RecordError

            raise RecordError(
                f"trackers: {type(item).__name__} is not a tracker (use ckptlab.trackers.MLflow / WandB, or a wandb run)"
            )
        out.append(t)
    return out


def _wrap(obj: Any) -> Tracker | None:
    """A Tracker for `obj`: one with `log_rows` and `kind` as is (ours, or the user's own);
    a wandb run; Lightning's WandbLogger / MLFlowLogger (by name: no Lightning import here)."""
    if hasattr(obj, "log_rows") and hasattr(obj, "kind"):
        return obj
    name = type(obj).__name__
    if name == "WandbLogger":
        obj = obj.experiment
        name = type(obj).__name__
    if name == "MLFlowLogger":
        from ckptlab.trackers.mlflow_tracker import MLflow

        return MLflow(client=obj.experiment, run_id=obj.run_id)
    if name == "Run" and type(obj).__module__.startswith("wandb"):
        from ckptlab.trackers.wandb_tracker import WandB

        return WandB(run=obj)
    return None
