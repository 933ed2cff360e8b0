"""What `ckptlab export` sends, whatever the viewer: one plan, three writers.

    summary = export_run(run, sink, gradients=checkpoint_gradients, progress=advance)

`rows(run, ...)` lays the run out as one `Row` per step, in step order (a W&B run takes steps
in increasing order only): the step's health (trackers/points.py names it), its validation
metrics, the events recorded there (`anomaly/<kind>` points, and an alert where an episode
starts or a worse kind joins it, trackers/points.py `AlertEpisodes`: the one-line verdict and
the replay command; the Recorder's warnings about its record as `warning/<kind>`, no alert), and at each checkpoint the histograms of every weight tensor and, with
`gradients`, of the gradients of the step that starts there. An `ExportSink`
(render/tensorboard.py's TensorBoardSink, trackers.MLflow, trackers.WandB) writes rows;
exports that can be resumed keep a cursor (how far each stream was sent), so exporting twice
sends every point once, and exporting a run that went on sends only what is new.
"""

from __future__ import annotations

import hashlib
import itertools
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch

from ckptlab.errors import CkptlabError
from ckptlab.io.base import expand_aliases
from ckptlab.run.atomic import write_bytes_atomic
from ckptlab.run.reader import Metrics, Run
from ckptlab.trackers.points import (
    MAX_PARAM_SCALARS,
    PER_PARAM_FIELDS,
    AlertEpisodes,
    Row,
    add_events,
    health_points,
    histogram,
    param_points,
    validation_points,
)

if TYPE_CHECKING:
    from ckptlab.trackers.mlflow_tracker import MLflow
    from ckptlab.trackers.wandb_tracker import WandB

STREAMS = ("health", "validation", "events", "checkpoints")
ROWS_PER_CALL = 100  # rows per sink call (and per saved cursor)
# Points a curve gets at most by default (`strides`): a run of 10^6 steps and 150 parameters
# records 1.5*10^8 per-parameter points and 10^6 of each run curve, which no viewer plots
# (TensorBoard keeps 1000 points a curve, W&B draws ~1500) and which took TensorBoard half an
# hour to write and a tracker's store far longer.
RUN_CURVE_POINTS = 100_000  # train/*, system/*
PARAM_CURVE_POINTS = 10_000  # grad_norm/<param>, update_ratio/<param>, weight_norm/<param>
PER_PARAM_KEYS = tuple(PER_PARAM_FIELDS.values())


@dataclass
class ExportSummary:
    target: str  # the folder or run written
    steps: int  # health rows written (steps)
    scalars: int  # scalar points written
    histograms: int
    checkpoints: list[int]
    gradient_checkpoints: list[int]
    alerts: int = 0
    run_id: str | None = None  # the MLflow / W&B run written
    already_exported: bool = False  # nothing new since the previous export
    notes: list[str] = field(default_factory=list)


@runtime_checkable
class ExportSink(Protocol):
    """Where `export_run` writes a run's rows: TensorBoardSink (render/tensorboard.py), and
    trackers.MLflow / trackers.WandB (render/trackers.py), which are live Trackers too."""

    def log_rows(self, rows: list[Row]) -> None:
        """Write these rows (in increasing step order): scalars, histograms, alerts."""
        ...

    def close(self) -> None:
        """Finish writing (flush files, end the run it started)."""
        ...


def run_key(run: Run) -> str:
    """A name for this run that survives copying and renaming its folder."""
    m = run.manifest
    return hashlib.sha256(f"{m.get('host')}:{m.get('created')}".encode()).hexdigest()[:16]


def pending(run: Run, cursor: dict) -> bool:
    """Whether `run` has anything that an export at `cursor` has not sent yet."""
    last = {k: cursor.get(k, -1) for k in STREAMS}
    steps = run.metrics().step
    return bool(
        (len(steps) and steps[-1] > last["health"])
        or any(v["step"] > last["validation"] for v in run.validation())
        or any(e["step"] > last["events"] for e in run.events())
        or any(c > last["checkpoints"] for c in run.checkpoints)
    )


def rows(
    run: Run,
    out: ExportSummary,
    *,
    cursor: dict | None = None,
    gradients: Callable[[int], dict[str, torch.Tensor]] | None = None,
    progress: Callable[[int, int], None] | None = None,
    every: int | None = None,
) -> Iterator[tuple[Row, dict]]:
    """(row, the cursor once it is written), step by step; `out` counts what was laid out.
    The health curves go out every `every` steps (None: `strides` chooses) and at each step with
    an event, a validation or a checkpoint; validations, events and checkpoints all."""
    last = {k: (cursor or {}).get(k, -1) for k in STREAMS}
    m = run.metrics()
    names = m.param_names
    per_param, kept = _curves(m, every, out)
    validation: dict[int, dict] = {}
    for v in run.validation():
        if v["step"] > last["validation"]:
            validation.setdefault(int(v["step"]), {}).update(v.get("metrics", {}))
    every_event = _by_step(run.events())
    events = {s: e for s, e in every_event.items() if s > last["events"]}
    checkpoints = [c for c in run.checkpoints if c > last["checkpoints"]]
    marks = {*every_event, *validation, *run.checkpoints}
    health, full, params = _health_rows(m, last["health"], kept, marks, per_param)
    episodes = AlertEpisodes()  # which steps alert, taken up where the last export left it
    for step in sorted(s for s in every_event if s <= last["events"]):
        episodes.due(step, every_event[step])
    done = 0
    for step in sorted({*health, *validation, *events, *checkpoints}):
        row = Row(step)
        if step in health:
            i = health[step]
            arrays = {key: values[at[i]] for key, (at, values) in params.items() if i in at}
            if i in full:
                record = m.scalars[i]
                row.time = record.get("time")
                row.scalars.update(health_points(record, arrays, names, per_param=per_param))
            else:  # a per-parameter record kept where the run's curves are not
                row.scalars.update(param_points(arrays, names))
            last["health"] = step
            out.steps += 1
        if step in validation:
            row.scalars.update(validation_points(validation[step]))
            last["validation"] = step
        if step in events:
            out.alerts += add_events(row, events[step], episodes, str(run.path))
            last["events"] = step
        if step in checkpoints:
            _checkpoint(run, step, row, gradients, out)
            last["checkpoints"] = step
            done += 1
            if progress is not None:
                progress(done, len(checkpoints))
        out.scalars += len(row.scalars)
        out.histograms += len(row.histograms)
        yield row, dict(last)


def _curves(m: Metrics, every: int | None, out: ExportSummary) -> tuple[bool, dict[str, tuple[int, int]]]:
    """Whether the per-parameter curves are sent, and every curve's thinning (`strides`), each
    said in `out.notes` where it leaves points out."""
    per_param = len(m.param_names) <= MAX_PARAM_SCALARS
    if not per_param:
        out.notes.append(f"{len(m.param_names)} parameters: per-parameter curves left out (limit {MAX_PARAM_SCALARS})")
    kept = strides(m, every, per_param)
    thinned = [f"{_CURVES[key]} a point per {bucket} steps" for key, (c, bucket) in kept.items() if bucket > c]
    if thinned:
        out.notes.append(f"curves thinned: {', '.join(thinned)} ({len(m)} steps recorded), {_THINNED}")
    return per_param, kept


def _health_rows(
    m: Metrics, after: int, kept: dict[str, tuple[int, int]], marks: set[int], per_param: bool
) -> tuple[dict[int, int], set[int], dict[str, tuple[dict[int, int], np.ndarray]]]:
    """The health rows to send after step `after`: {step: row}; the rows whose run curves are
    sent; and per per-parameter field, the rows whose record is sent ({row: its place among the
    field's records}) and the records. Chosen with numpy (`strides`, and every step in
    `marks`), so a long run's thinned-out rows are never visited."""
    new = m.step > after
    marked = np.isin(m.step, sorted(marks))
    full = set(np.flatnonzero(new & (marked | _kept(m.step, kept["health"][1]))).tolist())
    params: dict[str, tuple[dict[int, int], np.ndarray]] = {}
    for key in PER_PARAM_KEYS if per_param else ():
        have, values = m.measured(key)
        take = np.flatnonzero(new[have] & (marked[have] | _kept(m.step[have], kept[key][1])))
        params[key] = (dict(zip(have[take].tolist(), take.tolist())), values)
    health = {int(m.step[i]): i for i in sorted(full.union(*(at for at, _ in params.values())))}
    return health, full, params


_THINNED = "and each step with an event, validation or checkpoint; --every 1 sends all"
_CURVES = {
    "health": "train/ and system/",
    "param_grad_norm": "grad_norm/<param>",
    "update_ratio": "update_ratio/<param>",
    "weight_norm": "weight_norm/<param>",
}


def strides(m: Metrics, every: int | None, per_param: bool = True) -> dict[str, tuple[int, int]]:
    """For the run's curves ("health") and each per-parameter field: (its cadence, its bucket):
    the steps between its records (health every N steps: N; the median gap), and the thinning:
    a point per `bucket` steps (`_kept`). `every`: that bucket; None: the cadence times the
    smallest of 1, 2, 5, 10, 20, 50, ... that keeps the curve within RUN_CURVE_POINTS points
    (PARAM_CURVE_POINTS for a per-parameter curve). Thinned where the bucket is the larger."""
    out = {}
    for key in ("health", *(PER_PARAM_KEYS if per_param else ())):
        steps = m.step if key == "health" else m.step[m.measured(key)[0]]
        cadence = max(1, int(np.median(np.diff(steps)))) if len(steps) > 1 else 1
        cap = RUN_CURVE_POINTS if key == "health" else PARAM_CURVE_POINTS
        nice = (b * 10**e for e in itertools.count() for b in (1, 2, 5))
        out[key] = (cadence, every if every is not None else cadence * next(k for k in nice if len(steps) <= cap * k))
    return out


def _kept(steps: np.ndarray, bucket: int) -> np.ndarray:
    """Where a curve thinned to a point per `bucket` steps keeps the points of `steps` (in
    order): the first record in each bucket of step numbers. Fixed by the step numbers, so an
    export taken up again keeps the same points; a record alone in its bucket is kept however
    irregular the records (a run resumed with another cadence)."""
    b = steps // bucket
    return np.concatenate([b[:1] == b[:1], b[1:] != b[:-1]])


def _by_step(events) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for e in events:
        out.setdefault(int(e["step"]), []).append(e)
    return out


def _checkpoint(run: Run, step: int, row: Row, gradients, out: ExportSummary) -> None:
    tensors, aliases = run.checkpoint(step).load_model()  # verifies the hashes
    full = expand_aliases(tensors, aliases)
    _histograms(row, "weights", {n: full[n] for n in run.param_names if n in full})
    out.checkpoints.append(step)
    if gradients is None or step not in run.steps:
        return
    try:
        grads = gradients(step)
    except CkptlabError as e:  # e.g. the recorded build_fn cannot be imported here
        out.notes.append(f"no gradient histograms at step {step}: {e}")
        return
    _histograms(row, "grads", grads)
    out.gradient_checkpoints.append(step)


def _histograms(row: Row, group: str, tensors: dict[str, torch.Tensor]) -> None:
    """`group/<name>` of the finite values; `nonfinite/group/<name>` counts the others
    (no viewer can bin NaN)."""
    for name, t in tensors.items():
        h, bad = histogram(t)
        if bad:
            row.scalars[f"nonfinite/{group}/{name}"] = float(bad)
        if h is not None:
            row.histograms[f"{group}/{name}"] = h


def export_run(run: Run, sink: ExportSink, out: ExportSummary, *, cursor=None, save_cursor=None, **kw) -> ExportSummary:
    """Write every row of `run` (after `cursor`) through `sink.log_rows`, ROWS_PER_CALL at a
    time. With `save_cursor` (a sink that keeps a cursor: MLflow), each batch is announced
    before it is sent (the cursor's `sending`: how far the cursor will be once it is sent) and
    the cursor moves past it after: an export killed in between leaves `sending`, and the next
    export sends the rows up to there through `sink.log_rows_once` (the points the store does
    not hold yet), so every point arrives once whatever instant the kill came at."""
    cursor = dict(cursor or {})
    unsure = cursor.pop("sending", None)
    unsure_through = max(unsure.values(), default=-1) if isinstance(unsure, dict) else -1
    if unsure_through >= 0:
        out.notes.append(
            f"the previous export stopped while sending steps up to {unsure_through}: "
            "what the store already holds of them is not sent again"
        )
    done = {k: cursor.get(k, -1) for k in STREAMS}

    def send(batch: list[Row], reached: dict) -> None:
        if save_cursor is not None:
            save_cursor({**done, "sending": reached})
        again = [r for r in batch if r.step <= unsure_through]
        if again:
            out.scalars -= sink.log_rows_once(again)  # type: ignore[attr-defined]  # only a sink with a cursor
        if len(again) < len(batch):
            sink.log_rows(batch[len(again) :])
        done.update(reached)
        if save_cursor is not None:
            save_cursor(dict(done))

    batch: list[Row] = []
    for row, reached in rows(run, out, cursor=done, **kw):
        batch.append(row)
        if len(batch) == ROWS_PER_CALL:
            send(batch, reached)
            batch = []
    if batch:
        send(batch, reached)
    return out


def report_html(run: Run, folder: Path) -> Path:
    """`ckptlab report --html` for `run`, written into `folder` (for an artifact)."""
    from ckptlab.analysis.health import diagnose
    from ckptlab.render.html import report_page

    path = Path(folder) / "ckptlab-report.html"
    write_bytes_atomic(path, report_page(diagnose(run, plots=True)).encode())
    return path


def with_report(run: Run, sink: MLflow | WandB, out: ExportSummary) -> None:
    """Attach the report page to `sink` (a note, not a failure, when it cannot be made)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = report_html(run, Path(tmp))
        except CkptlabError as e:
            out.notes.append(f"no report page: {e}")
            return
        sink.log_file(path)
