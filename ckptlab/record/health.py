"""Each step's health record (loss, grad norms, lr, update ratios, ...) and its anomalies,
read when they are due, and the alerts they raise.

Where the health is read (`health_read`): "immediate" reads it as the step ends (a device
sync on a GPU); "deferred" reads step n's health when step n+1 ends, so nothing in a recorded
step waits for the GPU. Either way the steps that ran wait in a queue until `settle` reads
and records them (and raises NonFiniteLoss for a non-finite loss among them, when asked to).

The default alert (`on_anomaly="warn"`) is a WARNING on this module's logger, a child of the
`ckptlab` logger: with no logging configured, Python prints it on stderr. It is raised when an
anomaly episode starts and when a worse kind joins it (trackers/points.py `AlertEpisodes`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable

from ckptlab.analysis.anomalies import (
    IDLE_OPTIMIZER,
    OUTSIDE_OPTIMIZER,
    detectors,
    idle_optimizer_text,
    outside_optimizer_text,
    spike_events,
    step_anomalies,
    update_events,
)
from ckptlab.errors import NonFiniteLoss
from ckptlab.record.config import RecordConfig
from ckptlab.record.precursors import Precursors
from ckptlab.run import framelog, records
from ckptlab.run.reader import Progress
from ckptlab.run.writer import RunWriter
from ckptlab.trackers.points import AlertEpisodes, alert_text
from ckptlab.training.crash import describe, is_step_error
from ckptlab.training.health import CommonHealth, StepHealth
from ckptlab.training.pending import PendingHealth
from ckptlab.training.world import World

log = logging.getLogger(__name__)

# The first steps of a session on which the Recorder checks that its optimizers are the ones
# that train: the weights' norms at the step's start and end, when no optimizer stepped, and
# those of the parameters no optimizer given holds (training/probe.py `StepProbe.watch`;
# nothing is measured for it after them).
WATCHED_STEPS = 3

Alert = Callable[[int, list[dict]], None]


class HealthLog:
    """The health of the steps that ran, queued until read, then appended to the journal
    (rank 0), sent to the trackers (`live`) and judged for anomalies (`first_anomaly`: the
    run's first step with one, earlier sessions included)."""

    def __init__(
        self,
        writer: RunWriter,
        world: World,
        config: RecordConfig,
        *,
        deferred: bool,
        live=None,
        names: list[str] | None = None,
    ):
        self.writer, self.world, self.config = writer, world, config
        self.names = names or []
        self._precursors = Precursors(names) if names is not None else None
        self.deferred, self.live = deferred, live
        self.run_dir = writer.run_dir
        if isinstance(config.on_anomaly, str):  # "warn": one warning a run, not a rank
            self.on_anomaly: Alert | None = _warn_anomaly(str(self.run_dir)) if world.is_main else None
        else:
            self.on_anomaly = config.on_anomaly
        self._spikes = detectors()
        self.first_anomaly: int | None = None
        self._queue: list[tuple[int, PendingHealth, dict, float]] = []  # (step, health, system fields, time)
        self._watched: list[str] | None = []  # what the watched steps saw (None: judged)
        self._outside_said = False  # parameters moved outside every optimizer: warned (once a session)

    def resume(self, progress: Progress | None) -> None:
        """Continue a run: its first anomaly, and spikes judged against the run so far, not a blank."""
        if progress is None:
            return
        self.first_anomaly = progress.first_anomaly
        for loss, grad in progress.recent:
            self._spikes["loss"].check(loss)
            self._spikes["grad"].check(grad)

    def queue(self, n: int, pending: PendingHealth, system: dict, *, want: bool = False) -> StepHealth | None:
        """Step n ran: queue its health, with its `system` fields (record/system.py, and
        `ckpt_wait`); record what is due (all of it when read at once, all but this step's when
        deferred). Returns this step's health when read and `want`ed."""
        self._queue.append((n, pending, system, time.time()))
        health = self.settle(keep=1 if self.deferred else 0)
        if not want:
            return None
        return health.health() if isinstance(health, CommonHealth) else health

    def settle(self, keep: int = 0, *, raise_nonfinite: bool = True) -> StepHealth | CommonHealth | None:
        """Read and record the health of the steps that ran, leaving the last `keep` pending;
        then NonFiniteLoss for the first non-finite loss among them (if asked to), once the
        steps after it are recorded too. Returns the last health recorded (the usual step's
        as a CommonHealth: training/health.py)."""
        health: StepHealth | CommonHealth | None = None
        bad = None
        while len(self._queue) > keep:
            n, pending, wait, t = self._queue.pop(0)
            common = pending.common() if self.live is None else None  # (the trackers take the arrays)
            if common is not None:
                health = self._record_common(n, common, wait, t)
            else:
                health = self._record(n, pending.result(grads_live=not self.deferred), wait, t)
            self._judge_optimizer(n, pending)
            if bad is None and health.loss_nonfinite:
                assert health.loss is not None, "loss_nonfinite: a loss was returned"
                bad = (n, health.loss)
        if bad is not None and raise_nonfinite and self.config.on_nonfinite == "raise":
            self.settle(0, raise_nonfinite=False)
            raise NonFiniteLoss(bad[0], bad[1], str(self.run_dir))
        return health

    def settle_quietly(self) -> None:
        """On the way out of a failed step (or the interpreter): record the health still
        pending, without raising over the error that is already on its way. Not when
        distributed: reading combines the ranks (a collective), and the other ranks are not
        failing with this one."""
        if self.world.distributed:
            return
        with contextlib.suppress(Exception):
            self.settle(0, raise_nonfinite=False)

    def _record(self, n: int, health: StepHealth, system: dict, t: float) -> StepHealth:
        """Step n's health and anomalies, appended to the journal."""
        events = step_anomalies(health, self._spikes)
        if self._precursors is not None:
            self._precursors.add(n, health, events)
        if events and self.first_anomaly is None:
            self.first_anomaly = n
        scalars = {"step": n, "time": t, **health.scalars(), **system}
        arrays = health.arrays()
        self._append(n, records.encode_step(scalars, arrays) if self.world.is_main else b"", events, (scalars, arrays))
        if self.live is not None:  # queued: the trackers are sent to off this thread
            self.live.step(n, scalars, arrays, events)
        if events and self.on_anomaly is not None:
            self.on_anomaly(n, events)
        return health

    def _record_common(self, n: int, health: CommonHealth, system: dict, t: float) -> CommonHealth:
        """`_record` of the usual step (training/health.py `CommonHealth`): the same record,
        events and alerts, with no numpy call (no tracker: `settle`)."""
        # (nothing else can happen on such a step: training/health.py `read_common`)
        events = spike_events(health.loss, health.grad_norm, self._spikes)
        ratios = None
        if health.update is not None:
            events += update_events(health.update[2])
            ratios = health.update[1] if health.stepped else None
        if self._precursors is not None:
            self._precursors.add_row(n, health.norms, ratios, events)
        if events and self.first_anomaly is None:
            self.first_anomaly = n
        scalars = {"step": n, "time": t, **health.scalars(), **system}
        arrays = health.arrays()
        self._append(
            n, records.encode_step_floats(scalars, arrays) if self.world.is_main else b"", events, (scalars, arrays)
        )
        if events and self.on_anomaly is not None:
            self.on_anomaly(n, events)
        return health

    def _append(self, n: int, record: bytes, events: list[dict], values: tuple[dict, dict]) -> None:
        """Step n's record (`values`: its scalars and arrays) and its events, to the journal
        (rank 0's)."""
        if self.world.is_main:
            self.writer.append_step(n, record, values)
            for event in events:
                self.writer.append_json(framelog.EVENT, n, event)

    def _judge_optimizer(self, n: int, pending: PendingHealth) -> None:
        """After the first WATCHED_STEPS steps: if the optimizer never stepped while the
        weights moved, it is not the one that trains (a trainer that made its own): a warning
        and an IDLE_OPTIMIZER event. On a watched step, parameters that no optimizer given
        holds had a gradient and moved: another optimizer trains them (a second one the
        Recorder was not told about): a warning and an OUTSIDE_OPTIMIZER event
        (docs/alerts.md). Each once a session."""
        if pending.moved_outside and not self._outside_said:
            self._outside_said = True
            names = [self.names[i] if i < len(self.names) else str(i) for i in pending.moved_outside]
            self._warn_record(
                n, {"kind": OUTSIDE_OPTIMIZER, "value": len(names), "detail": outside_optimizer_text(names)}
            )
        watched = pending.watched
        if watched is None or self._watched is None:
            return
        self._watched.append(watched)
        if watched == "stepped" or len(self._watched) < WATCHED_STEPS:
            if watched == "stepped":
                self._watched = None
            return
        seen, self._watched = self._watched, None
        if "moved" not in seen:
            return
        self._warn_record(n, {"kind": IDLE_OPTIMIZER, "value": len(seen), "detail": idle_optimizer_text(len(seen))})

    def _warn_record(self, n: int, event: dict) -> None:
        """A warning about the record itself (no fault of a step): an event (a `warning/<kind>`
        point for the trackers, no alert), and a UserWarning."""
        if self.world.is_main:
            self.writer.append_json(framelog.EVENT, n, event)
            if self.live is not None:
                self.live.events(n, [event])
            warnings.warn(f"ckptlab: step {n}: {event['detail']}", stacklevel=5)

    def record_error(self, n: int, error: BaseException, model) -> None:
        """Step n raised: an `exception` event (what, and where in the user's code), when its
        own code raised it (not ckptlab, not a KeyboardInterrupt). Never raises over the error
        on its way."""
        if not is_step_error(error):
            return
        event = {"kind": "exception", **describe(error, model)}
        if self.world.distributed:
            event["rank"] = self.world.rank
        with contextlib.suppress(Exception):
            if self.first_anomaly is None:
                self.first_anomaly = n
            if self.world.is_main:
                self.writer.append_json(framelog.EVENT, n, event)
            else:  # (a peer's collective then fails too: rank 0 records that error, not this one)
                self.writer.append_rank_event(n, event)
            if self.live is not None:  # (rank 0's: the trackers alert where the warning does)
                self.live.events(n, [event])
            if self.on_anomaly is not None:
                self.on_anomaly(n, [event])


def _warn_anomaly(run_dir: str) -> Alert:
    """The default alert: a warning when an anomaly episode starts, and again when a worse
    kind of anomaly joins it (trackers/points.py `AlertEpisodes`), naming what happened and
    the command that explains it."""
    episodes = AlertEpisodes()

    def warn(step: int, events: list[dict]) -> None:
        alerting = episodes.due(step, events)
        if alerting:
            log.warning("ckptlab: %s", alert_text(run_dir, step, alerting))

    return warn
