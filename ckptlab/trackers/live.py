"""Live logging: the Recorder's health reaches MLflow / W&B as it is recorded, off the
training thread.

    live = LiveLog(trackers, run_dir="runs/exp1", param_names=names, params=params)
    live.step(n, scalars, arrays, events)    # training thread: appends to a queue, returns
    live.validation(n, {"val_loss": 0.3})
    live.events(n, [event])                  # a step that raised; a warning about the record
    live.close()                             # sends what is left, ends the trackers' runs

A background thread wakes every `flush_s` seconds, names the queued steps' points
(trackers/points.py) and sends them in one batch per tracker, so the training thread pays
one queue append per step. A tracker that raises is reported once (a WARNING on the
`ckptlab.trackers.live` logger: on stderr unless the user's logging routes it elsewhere) and
sent nothing more; training and recording go on. If a tracker cannot keep up, the queue
holds at most `max_pending` steps and the oldest are dropped (and counted in one warning).
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import numpy as np

from ckptlab.trackers.points import (
    ALERT_GAP,
    AlertEpisodes,
    Row,
    add_events,
    health_points,
    run_params,
    validation_points,
)
from ckptlab.trackers.tracker import Tracker

FLUSH_S = 2.0  # W&B and MLflow servers take batches well; a point is on screen within seconds
MAX_PENDING = 10_000  # steps queued before the oldest are dropped (~minutes of a fast run)
CLOSE_TIMEOUT_S = 60.0  # a hung server must not keep the training process from exiting

log = logging.getLogger(__name__)


class LiveLog:
    def __init__(
        self,
        trackers: list[Tracker],
        *,
        run_dir: str,
        param_names: list[str],
        params: dict[str, str] | None = None,
        episode_gap: int = ALERT_GAP,
        flush_s: float | None = None,
        max_pending: int = MAX_PENDING,
    ):
        self.trackers = list(trackers)
        self.run_dir, self.param_names = run_dir, list(param_names)
        self.flush_s = FLUSH_S if flush_s is None else flush_s
        self._queue: deque = deque(maxlen=max_pending)
        self._dropped = 0
        self._episodes = AlertEpisodes(episode_gap)  # which anomalous steps alert
        self._failed: dict[int, str] = {}  # id(tracker) -> why it stopped
        self._wake = threading.Event()
        self._stop = False
        if params:
            self._queue.append(("params", params))
        self._thread = threading.Thread(target=self._loop, name="ckptlab-trackers", daemon=True)
        self._thread.start()

    # --- the training thread: O(1) per call ----------------------------------------------

    def step(self, step: int, scalars: dict, arrays: dict, events: list[dict]) -> None:
        self._put(("step", step, scalars, copy_arrays(arrays), events))

    def validation(self, step: int, metrics: dict) -> None:
        self._put(("validation", step, dict(metrics)))

    def events(self, step: int, events: list[dict]) -> None:
        """Events of step `step` that come without its health: the exception of a step that
        raised (it has none), the Recorder's warnings about its record."""
        self._put(("events", step, list(events)))

    def _put(self, item) -> None:
        if len(self._queue) == self._queue.maxlen:
            self._dropped += 1
        self._queue.append(item)

    def close(self, timeout: float | None = None) -> None:
        timeout = CLOSE_TIMEOUT_S if timeout is None else timeout
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning(
                "ckptlab: trackers did not finish sending within %g s; leaving them (training is done)", timeout
            )
            return
        for t in self.trackers:
            if id(t) not in self._failed:
                self._call(t, "close")

    @property
    def failed(self) -> dict[str, str]:
        """kind of tracker -> why it stopped receiving points."""
        return {t.kind: self._failed[id(t)] for t in self.trackers if id(t) in self._failed}

    # --- the background thread -------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            self._wake.wait(self.flush_s)
            self._wake.clear()
            stop = self._stop
            self._send(self._drain())
            if stop:
                return

    def _drain(self) -> list:
        items = []
        while self._queue:
            items.append(self._queue.popleft())
        return items

    def _send(self, items: list) -> None:
        rows: dict[int, Row] = {}
        params: dict[str, str] = {}
        for item in items:
            if item[0] == "params":
                params.update(item[1])
            elif item[0] == "validation":
                _, step, metrics = item
                rows.setdefault(step, Row(step)).scalars.update(validation_points(metrics))
            elif item[0] == "events":
                _, step, events = item
                add_events(rows.setdefault(step, Row(step)), events, self._episodes, self.run_dir)
            else:
                _, step, scalars, arrays, events = item
                row = rows.setdefault(step, Row(step))
                row.time = scalars.get("time")
                row.scalars.update(health_points(scalars, arrays, self.param_names))
                if events:  # an episode's start, or a worse kind in it, alerts
                    add_events(row, events, self._episodes, self.run_dir)
        if self._dropped:
            log.warning("ckptlab: trackers fell behind: %d steps were not sent", self._dropped)
            self._dropped = 0
        ordered = [rows[s] for s in sorted(rows)]
        for t in self.trackers:
            if params:
                self._call(t, "log_params", params)
            if ordered:
                self._call(t, "log_rows", ordered)

    def _call(self, tracker: Tracker, method: str, *args) -> None:
        if id(tracker) in self._failed:
            return
        try:
            getattr(tracker, method)(*args)
        except Exception as e:  # noqa: BLE001 - a tracker never breaks the training
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
            self._failed[id(tracker)] = why
            log.warning("ckptlab: %s stopped receiving points (%s); training and recording go on", tracker.kind, why)


def live_log(trackers: list[Tracker], run_dir: str, manifest: dict) -> LiveLog | None:
    """The Recorder's LiveLog on `trackers` (None without any): params first, then each step."""
    if not trackers:
        return None
    names = [p["name"] for p in manifest.get("parameters", [])]
    return LiveLog(trackers, run_dir=run_dir, param_names=names, params=run_params(manifest))


def copy_arrays(arrays: dict) -> dict:
    """The step's arrays, safe to read later on another thread."""
    return {k: np.array(v, copy=True) for k, v in arrays.items()}
