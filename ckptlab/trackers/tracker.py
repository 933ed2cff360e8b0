"""What a live tracker is: the interface trackers/live.py sends the Recorder's health through.

    class MyTracker:                      # any object with these members is a Tracker
        kind = "mine"
        def log_rows(self, rows): ...     # trackers/points.py's rows, in step order
        def log_params(self, params): ...
        def close(self): ...

`MLflow` (trackers/mlflow_tracker.py) and `WandB` (trackers/wandb_tracker.py) are the two that
ckptlab ships; `RecordConfig.trackers` takes a list of Trackers (or runs that `resolve` wraps
in one). A Protocol, not a base class: a tracker declares nothing, it only has the members
(`isinstance(obj, Tracker)` checks that it has them all).
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

from ckptlab.trackers.points import Row


@runtime_checkable
class Tracker(Protocol):
    """One run in a tracking service that ckptlab logs into. Called from the LiveLog's
    background thread only; whatever a method raises stops that tracker (reported once),
    never the training."""

    kind: str  # which service ("mlflow", "wandb"): names the tracker in reports

    def log_rows(self, rows: list[Row]) -> None:
        """Send the points of these steps (in increasing step order) and their alerts."""
        ...

    def log_params(self, params: dict[str, str]) -> None:
        """Record the run's parameters (versions, recording config), once at the start."""
        ...

    def close(self) -> None:
        """Send what is buffered and end the run if the tracker started it."""
        ...


# What `RecordConfig.trackers` takes (and `resolve` turns into Trackers): a list or tuple whose
# items are Trackers or what `resolve` wraps in one: a wandb run, Lightning's WandbLogger /
# MLFlowLogger (known by class name, so neither library is imported to type them: the items
# are Any); one Tracker alone; "auto" (the runs already active here); None (no trackers).
TrackerSpec: TypeAlias = list[Any] | tuple[Any, ...] | Tracker | Literal["auto"] | None
