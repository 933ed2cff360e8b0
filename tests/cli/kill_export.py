"""`ckptlab ARGS`, SIGKILLed at a chosen instant of an export: what a kill -9, an OOM killer or
a lost machine does to `ckptlab export` (no except clause, no finally, no atexit runs).

    CKPTLAB_TEST_KILL=after:log_batch:3 python -m tests.cli.kill_export export --run R --mlflow URI

CKPTLAB_TEST_KILL is `before|after:CALL:N`: die before (or right after) the Nth call of CALL,
one of `log_batch` (MlflowClient's, counting the calls that carry metrics), `set_tag`
(MlflowClient's), `log_rows` and `close` (the W&B tracker's). CKPTLAB_TEST_ROWS and
CKPTLAB_TEST_METRICS shrink the batches (rows per batch, metrics per MLflow call) so that a
small run makes many. The export itself runs unchanged: the kill lands between the real calls.
`arm` does the same in a process the test forked (no second interpreter to start).
"""

from __future__ import annotations

import os
import signal
import sys


def die_at(cls, name: str, when: str, n: int) -> None:
    original = getattr(cls, name)
    calls = 0

    def wrapper(self, *args, **kwargs):
        nonlocal calls
        counted = name != "log_batch" or kwargs.get("metrics")
        calls += 1 if counted else 0
        if counted and when == "before" and calls == n:
            os.kill(os.getpid(), signal.SIGKILL)
        out = original(self, *args, **kwargs)
        if counted and when == "after" and calls == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(cls, name, wrapper)


def arm(kill: str, rows: int | None = None, metrics: int | None = None) -> None:
    """Make this process die at `kill` (`before|after:CALL:N`); batches of `rows` rows and
    `metrics` metrics per MLflow call."""
    from ckptlab.render import export
    from ckptlab.trackers import mlflow_tracker

    export.ROWS_PER_CALL = rows or export.ROWS_PER_CALL
    mlflow_tracker.METRICS_PER_CALL = metrics or mlflow_tracker.METRICS_PER_CALL
    when, name, n = kill.split(":")
    if name in ("log_batch", "set_tag"):
        from mlflow.tracking import MlflowClient

        die_at(MlflowClient, name, when, int(n))
    else:
        from ckptlab.trackers.wandb_tracker import WandB

        die_at(WandB, name, when, int(n))


def main() -> None:
    from ckptlab.cli import main as ckptlab

    env = os.environ.get
    rows, metrics = env("CKPTLAB_TEST_ROWS"), env("CKPTLAB_TEST_METRICS")
    arm(os.environ["CKPTLAB_TEST_KILL"], rows=int(rows) if rows else None, metrics=int(metrics) if metrics else None)
    ckptlab(sys.argv[1:])


if __name__ == "__main__":
    main()
