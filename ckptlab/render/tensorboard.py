"""Write a run's health as TensorBoard event files (`ckptlab export --tensorboard DIR`).

    summary = write_tensorboard(run, "tb/exp1", gradients=checkpoint_gradients)
    # then: tensorboard --logdir tb

The rows are render/export.py's, as for MLflow and W&B (x axis: the ckptlab step; a
checkpoint "at step k" is the state step k starts in): the names of trackers/points.py as
scalars (train/*, grad_norm/<param>, update_ratio/<param>, weight_norm/<param>, val/<metric>,
anomaly/<kind>, nonfinite/weights/<param>); weights/<param> and grads/<param> as histograms
at each checkpoint; each alert line (an anomaly episode's, and a worse kind's in it) as the
text `anomalies`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from ckptlab.errors import CkptlabError, install_hint
from ckptlab.render.export import ExportSink, ExportSummary, export_run
from ckptlab.run.reader import Run
from ckptlab.trackers.points import Row


def require_tensorboard():
    """torch's SummaryWriter; CkptlabError naming the extra to install when it is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise CkptlabError(
            "exporting to TensorBoard needs the tensorboard package", hint=install_hint("tensorboard", "tensorboard")
        ) from None
    return SummaryWriter


def summary_writer(logdir: str | os.PathLike):
    """A SummaryWriter on a folder that holds no event files yet (TensorBoard would merge them)."""
    SummaryWriter = require_tensorboard()  # noqa: N806 - a class
    logdir = Path(logdir)
    if logdir.exists() and (
        not logdir.is_dir() or any(p.name.startswith("events.out.tfevents") for p in logdir.iterdir())
    ):
        raise CkptlabError(
            "already holds TensorBoard event files; refusing to mix two exports",
            path=logdir,
            hint="choose a new folder, e.g. tb/<run name>",
        )
    return SummaryWriter(log_dir=str(logdir))


class TensorBoardSink:
    """An ExportSink: rows as TensorBoard scalars, histograms (binned by render/export.py)
    and text."""

    def __init__(self, logdir: str | os.PathLike):
        self.writer = summary_writer(logdir)

    def log_rows(self, rows: list[Row]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary  # type: ignore[import-untyped]

        w = self.writer
        events = w._get_file_writer()  # (what add_scalar writes through)
        for r in rows:
            # A step's scalars as one event (what add_scalar writes per point, Summary.Value
            # with simple_value, in one Summary): an event per point made a 10^4-step export
            # of 150 parameters take minutes, the writer's queue taking turns on a lock.
            if r.scalars:
                values = [Summary.Value(tag=tag, simple_value=float(v)) for tag, v in r.scalars.items()]
                events.add_summary(Summary(value=values), r.step)
            for tag, h in r.histograms.items():
                w.add_histogram_raw(
                    tag, h.min, h.max, h.num, h.sum, h.sum_squares, h.edges[1:], h.counts, global_step=r.step
                )
            for a in r.alerts:
                w.add_text("anomalies", a.text, global_step=r.step)

    def close(self) -> None:
        self.writer.close()


def write_tensorboard(
    run: Run,
    logdir: str | os.PathLike,
    *,
    gradients: Callable[[int], dict[str, torch.Tensor]] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ExportSummary:
    """Write `run` into `logdir`. `progress(done, total)` is called per checkpoint."""
    sink: ExportSink = TensorBoardSink(logdir)
    try:
        return export_run(
            run, sink, ExportSummary(str(logdir), 0, 0, 0, [], []), gradients=gradients, progress=progress
        )
    finally:
        sink.close()
