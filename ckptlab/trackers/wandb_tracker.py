"""Weights & Biases: ckptlab's points as history, anomalies as alerts, in a W&B run.

    tracker = WandB(project="exp1")                 # a run of its own (offline: mode="offline")
    tracker = WandB(run=wandb.run)                  # or the run you (or your framework) started
    rec = ckptlab.Recorder(..., trackers=[tracker])

In a run of its own, ckptlab logs at `step=` the ckptlab step. In someone else's run it never
passes `step=` (that would move the run's step past yours): its points are named
`ckptlab/...`, and plotted against `ckptlab/step`. An anomaly becomes the point
`anomaly/<kind>`, an entry of the run summary's `ckptlab/anomalies` (the last 20 alert lines),
and `run.alert(...)` (W&B's e-mail/Slack alert) when the run is online.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ckptlab.errors import CkptlabError, install_hint
from ckptlab.trackers.points import Alert, Row

KEEP_ALERTS = 20  # alert lines kept in the run summary


def require_wandb():
    try:
        import wandb
    except ImportError:
        raise CkptlabError(
            "logging to Weights & Biases needs the wandb package", hint=install_hint("wandb", "wandb")
        ) from None
    return wandb


def quiet_settings(wandb, **extra):
    """No console capture, no system-metrics sampler, no terminal output: the run must not
    take over the training's stdout nor spend its CPU."""
    return wandb.Settings(console="off", silent=True, x_disable_stats=True, x_disable_meta=True, **extra)


class WandB:
    """One W&B run that ckptlab logs into.

    Args:
        run: log into this run (yours, or your framework's); not finished on close.
        project, name, id, dir, mode, config: `wandb.init` arguments for a run of its own
            (mode "offline" writes a run that `wandb sync` uploads later); finished on close.
        prefix: put before every name: "ckptlab/" by default in a run that is not its own.

    A Tracker (trackers/tracker.py) for the Recorder, and an ExportSink (render/export.py) for
    `ckptlab export --wandb`.
    """

    kind = "wandb"

    def __init__(
        self,
        run=None,
        *,
        project: str | None = "ckptlab",
        name: str | None = None,
        id: str | None = None,  # noqa: A002 - wandb.init's own name
        dir: str | os.PathLike | None = None,  # noqa: A002
        mode: str | None = None,
        config: dict | None = None,
        prefix: str | None = None,
    ):
        wandb = require_wandb()
        self.owned = run is None
        if run is None:
            if dir is not None:
                Path(dir).mkdir(parents=True, exist_ok=True)
            try:
                run = wandb.init(
                    project=project,
                    name=name,
                    id=id,
                    dir=None if dir is None else os.fspath(dir),
                    mode=mode,
                    config=config,
                    resume="allow" if id is not None else None,
                    reinit="create_new",
                    settings=quiet_settings(wandb),
                )
            except Exception as e:  # noqa: BLE001 - not logged in, server unreachable, ...: one line
                raise CkptlabError(f"cannot start a Weights & Biases run: {type(e).__name__}: {e}") from None
        self.run = run
        self.prefix = ("" if self.owned else "ckptlab/") if prefix is None else prefix
        self.offline = bool(getattr(run.settings, "_offline", False)) or getattr(run.settings, "mode", "") in (
            "offline",
            "dryrun",
        )
        self._alerts: list[str] = []
        if not self.owned:
            run.define_metric(f"{self.prefix}step")
            run.define_metric(f"{self.prefix}*", step_metric=f"{self.prefix}step")

    @property
    def where(self) -> str:
        return str(Path(self.run.dir).parent) if self.offline else str(getattr(self.run, "url", None) or self.run.id)

    def log_rows(self, rows: list[Row]) -> None:
        import wandb

        for r in rows:
            data: dict = {self.prefix + k: v for k, v in r.scalars.items()}
            for name, h in r.histograms.items():
                data[self.prefix + name] = wandb.Histogram(np_histogram=(np.asarray(h.counts), np.asarray(h.edges)))
            if self.owned:
                self.run.log(data, step=r.step)
            else:  # never move the step of a run that is not ours
                self.run.log({**data, f"{self.prefix}step": r.step})
            for a in r.alerts:
                self.alert(a)

    def alert(self, a: Alert) -> None:
        self._alerts = [*self._alerts, a.text][-KEEP_ALERTS:]
        self.run.summary[f"{self.prefix or 'ckptlab/'}anomalies"] = self._alerts
        if not self.offline:  # the level by name: wandb's type stub leaves out wandb.AlertLevel
            self.run.alert(title=f"ckptlab: {', '.join(a.kinds)} at step {a.step}", text=a.text, level="WARN")

    def log_params(self, params: dict[str, str]) -> None:
        self.run.config.update({f"{self.prefix}{k}": v for k, v in params.items()}, allow_val_change=True)

    def log_file(self, path: Path) -> None:
        self.run.save(str(path), base_path=str(Path(path).parent), policy="now")

    def close(self) -> None:
        if self.owned:
            self.run.finish()
