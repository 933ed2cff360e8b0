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
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ckptlab.errors import CkptlabError, install_hint
from ckptlab.render.export import ExportSink, ExportSummary, export_run
from ckptlab.run.atomic import create_new
from ckptlab.run.reader import Run
from ckptlab.trackers.points import Row


def require_tensorboard():
    """torch's SummaryWriter (torch.utils.tensorboard: the export's summaries are its protos);
    CkptlabError naming the extra to install when it is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise CkptlabError(
            "exporting to TensorBoard needs the tensorboard package", hint=install_hint("tensorboard", "tensorboard")
        ) from None
    return SummaryWriter


def _event_folder(logdir: str | os.PathLike) -> Path:
    """`logdir`, made, holding no event files yet (TensorBoard would merge two exports)."""
    logdir = Path(logdir)
    if logdir.exists() and (
        not logdir.is_dir() or any(p.name.startswith("events.out.tfevents") for p in logdir.iterdir())
    ):
        raise CkptlabError(
            "already holds TensorBoard event files; refusing to mix two exports",
            path=logdir,
            hint="choose a new folder, e.g. tb/<run name>",
        )
    logdir.mkdir(parents=True, exist_ok=True)
    return logdir


def _masked_crc32c() -> Callable[[bytes], int]:
    """TFRecord's checksum: CRC-32C, rotated and offset. google-crc32c's (C, with the CPU's CRC
    instruction) where installed (the tensorboard extra installs it), else TensorBoard's own, in
    pure Python: ~90 us per 400-byte event."""
    try:
        import google_crc32c
    except ImportError:
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c  # type: ignore[import-untyped]

        return masked_crc32c
    value = google_crc32c.value

    def masked(data: bytes) -> int:
        x = value(data)
        return (((x >> 15) | (x << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    return masked


class EventFile:
    """A TensorBoard event file, written here and now: each event a TFRecord (its length, the
    length's masked CRC-32C, the serialized Event, the Event's masked CRC-32C), each batch of
    rows in one write. torch's SummaryWriter hands each event to its thread through a queue
    and takes the CRCs in pure Python: on a 10^6-step run's 10^5 exported rows the export spent
    a minute waiting for that thread."""

    def __init__(self, logdir: str | os.PathLike):
        from tensorboard.compat.proto.event_pb2 import Event  # type: ignore[import-untyped]

        folder = _event_folder(logdir)
        self._event = Event
        self._crc = _masked_crc32c()
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.0"
        self._file = create_new(folder / name)
        self.write([Event(wall_time=time.time(), file_version="brain.Event:2")])

    def event(self, step: int, summary):
        return self._event(wall_time=time.time(), step=step, summary=summary)

    def write(self, events: list) -> None:
        crc, parts = self._crc, []
        for e in events:
            data = e.SerializeToString()
            head = struct.pack("<Q", len(data))
            parts += [head, struct.pack("<I", crc(head)), data, struct.pack("<I", crc(data))]
        view = memoryview(b"".join(parts))
        while view:  # (unbuffered: a write may take part of it, a full disk raises on the next)
            view = view[self._file.write(view) :]

    def close(self) -> None:
        os.fsync(self._file.fileno())
        self._file.close()


class TensorBoardSink:
    """An ExportSink: rows as TensorBoard scalars, histograms (binned by render/export.py)
    and text, in one event file."""

    def __init__(self, logdir: str | os.PathLike):
        require_tensorboard()
        self.file = EventFile(logdir)

    def log_rows(self, rows: list[Row]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary  # type: ignore[import-untyped]
        from torch.utils.tensorboard.summary import histogram_raw, text

        f, events = self.file, []
        for r in rows:
            # A step's scalars as one event (what add_scalar writes per point, Summary.Value
            # with simple_value, in one Summary).
            if r.scalars:
                values = [Summary.Value(tag=tag, simple_value=float(v)) for tag, v in r.scalars.items()]
                events.append(f.event(r.step, Summary(value=values)))
            for tag, h in r.histograms.items():
                summary = histogram_raw(tag, h.min, h.max, h.num, h.sum, h.sum_squares, h.edges[1:], h.counts)
                events.append(f.event(r.step, summary))
            for a in r.alerts:
                events.append(f.event(r.step, text("anomalies", a.text)))
        f.write(events)

    def close(self) -> None:
        self.file.close()


def write_tensorboard(
    run: Run,
    logdir: str | os.PathLike,
    *,
    gradients: Callable[[int], dict[str, torch.Tensor]] | None = None,
    progress: Callable[[int, int], None] | None = None,
    every: int | None = None,
) -> ExportSummary:
    """Write `run` into `logdir`. `progress(done, total)` is called per checkpoint; curves thinned
    to every `every` steps (export.rows)."""
    sink: ExportSink = TensorBoardSink(logdir)
    try:
        return export_run(
            run,
            sink,
            ExportSummary(str(logdir), 0, 0, 0, [], []),
            gradients=gradients,
            progress=progress,
            every=every,
        )
    finally:
        sink.close()
