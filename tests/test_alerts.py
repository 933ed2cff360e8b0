"""Which anomalous steps alert (trackers/points.py `AlertEpisodes`): one alert when an episode
starts, and another when a worse kind joins it, the same for the Recorder's warning, the live
trackers and `ckptlab export`."""

import logging
import threading

import pytest

import ckptlab
from ckptlab.render.export import ExportSummary, rows
from ckptlab.trackers.live import LiveLog
from tests import digits_models as dm
from tests import optimizer_models as om

SPIKE, NAN, STEPS = 140, 150, 160


@pytest.fixture(scope="module")
def spike_then_nan(tmp_path_factory):
    """An MNIST-like run at batch 8 whose batch at SPIKE has every label wrong (a loss spike)
    and whose batch at NAN holds a NaN pixel, 10 steps later: inside the spike's episode. The
    weights are NaN from then on, so every later step is NaN too. Returns (run, warnings)."""
    run_dir = tmp_path_factory.mktemp("alerts") / "run"
    model, opt = dm.build_digits()
    log, seen = logging.getLogger("ckptlab"), _Records()
    log.addHandler(seen)
    try:
        with ckptlab.Recorder(
            run_dir,
            model,
            opt,
            step_fn=dm.step_digits,
            build_fn=dm.build_digits,
            ckpt_every=1000,
            on_nonfinite="record",
        ) as rec:
            for batch, ids in dm.digit_batches(STEPS, spike_at=SPIKE, nan_at=NAN):
                rec.step(batch, sample_ids=ids)
    finally:
        log.removeHandler(seen)
    return ckptlab.open_run(run_dir), [r.getMessage() for r in seen.records if r.name == "ckptlab.record.health"]


class _Records(logging.Handler):
    """The WARNING records ckptlab logs (pytest's caplog lives one test; this, the module's
    recording)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_a_nan_inside_a_loss_spikes_episode_alerts_too(spike_then_nan):
    """The NaN 10 steps after the spike (within ALERT_GAP = 16) is a new, worse fact: its own
    warning; the NaN steps after it, the same fact, none."""
    run, warnings = spike_then_nan
    kinds = {}
    for e in run.events():
        kinds.setdefault(e["step"], set()).add(e["kind"])
    assert min(kinds) == SPIKE and "loss_spike" in kinds[SPIKE]  # the noisy healthy steps: no spike
    assert {"nonfinite_loss", "nonfinite_grad"} <= kinds[NAN] and sorted(kinds)[-1] == STEPS - 1
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith(f"ckptlab: step {SPIKE}: loss spike")
    assert warnings[1].startswith(f"ckptlab: step {NAN}: nonfinite loss, nonfinite grad")
    assert f"ckptlab replay --run {run.path} --step {NAN}" in warnings[1]


def test_an_export_alerts_at_the_steps_the_recorder_warned(spike_then_nan):
    run, _ = spike_then_nan
    out = ExportSummary(target="", steps=0, scalars=0, histograms=0, checkpoints=[], gradient_checkpoints=[])
    alerts = [(a.step, a.kinds) for row, _ in rows(run, out) for a in row.alerts]
    assert [step for step, _ in alerts] == [SPIKE, NAN] and "nonfinite_loss" in alerts[1][1]
    # An export taken up after the spike still knows the episode it is in.
    cursor = {"health": SPIKE, "validation": -1, "events": SPIKE, "checkpoints": STEPS}
    assert [a.step for row, _ in rows(run, out, cursor=cursor) for a in row.alerts] == [NAN]


class _Tracker:
    kind = "test"

    def __init__(self):
        self.alerts: list[tuple[int, list[str]]] = []
        self.points: dict[int, dict[str, float]] = {}  # step -> the points sent for it
        self.done = threading.Event()

    def log_rows(self, rows):
        self.alerts += [(a.step, a.kinds) for row in rows for a in row.alerts]
        for row in rows:
            self.points.setdefault(row.step, {}).update(row.scalars)

    def log_params(self, params):
        pass

    def close(self):
        self.done.set()


def test_the_live_trackers_alert_by_the_same_rule():
    tracker = _Tracker()
    live = LiveLog([tracker], run_dir="RUN", param_names=[], flush_s=60)
    anomalies = {
        5: ["loss_spike"],
        9: ["grad_spike"],  # as bad as the spike: the same episode, no alert
        12: ["update_explosion"],  # worse
        15: ["nonfinite_loss", "nonfinite_grad"],  # worse still
        16: ["nonfinite_loss"],
        30: ["loss_spike"],  # 14 steps after the last one: still the NaN's episode
        50: ["loss_spike"],  # 20 after: a new episode
    }
    for step in range(60):
        events = [{"kind": k, "value": 1.0} for k in anomalies.get(step, [])]
        live.step(step, {"step": step, "loss": 1.0}, {}, events)
    live.close()
    assert tracker.done.is_set()
    assert [step for step, _ in tracker.alerts] == [5, 12, 15, 50]


# --- a run with a warning about its record, a spike and a step that raised ----------------------------

GRAD_AT, RAISED_AT = 16, 30  # (16: inside the episode a warning at step 0 would start: ALERT_GAP)


def gan_batches():
    """The GAN's batches (tests/optimizer_models.py); at GRAD_AT the real rows are -1000x
    themselves (D calls them fake with a logit in the thousands: its gradient explodes); at
    RAISED_AT they are one column short (D raises)."""
    for s in range(RAISED_AT + 1):
        real, noise = om.batch(s)
        if s == GRAD_AT:
            real = real * -1000
        if s == RAISED_AT:
            real = real[:, :-1]
        yield s, (real, noise)


@pytest.fixture(scope="module")
def warned_spiked_raised(tmp_path_factory):
    """The Recorder given D's optimizer only (G's: an `outside_optimizer` warning at step 0),
    a gradient spike at GRAD_AT, an exception at RAISED_AT; a live tracker and the default
    warning. Returns (run, the warnings' steps, the tracker)."""
    run_dir = tmp_path_factory.mktemp("warned") / "run"
    tracker, seen = _Tracker(), _Records()
    logging.getLogger("ckptlab").addHandler(seen)
    model, opt_d = om.build_d_only()
    try:
        with pytest.warns(UserWarning, match="no optimizer given"):
            with ckptlab.Recorder(
                run_dir, model, opt_d, step_fn=om.step_d_only, build_fn=om.build_d_only, trackers=[tracker]
            ) as rec:
                for s, batch in gan_batches():
                    if s == RAISED_AT:
                        with pytest.raises(RuntimeError):
                            rec.step(batch, sample_ids=om.ids(s))
                    else:
                        rec.step(batch, sample_ids=om.ids(s))
    finally:
        logging.getLogger("ckptlab").removeHandler(seen)
    warned = [int(r.getMessage().split()[2].rstrip(":")) for r in seen.records if r.name == "ckptlab.record.health"]
    return ckptlab.open_run(run_dir), warned, tracker


def test_the_warning_the_trackers_and_an_export_alert_at_the_same_steps(warned_spiked_raised):
    """The step that raised alerts in the live tracker too; the warning about the record at
    step 0 (no fault of a step) alerts nowhere and does not take the spike's episode."""
    run, warned, tracker = warned_spiked_raised
    kinds = {e["step"]: e["kind"] for e in run.events()}
    assert kinds[0] == "outside_optimizer" and kinds[RAISED_AT] == "exception"
    assert "grad_spike" in {e["kind"] for e in run.events() if e["step"] == GRAD_AT}
    out = ExportSummary(target="", steps=0, scalars=0, histograms=0, checkpoints=[], gradient_checkpoints=[])
    exported = list(rows(run, out))
    alerts = {"warning": warned, "live": [s for s, _ in tracker.alerts]}
    alerts["export"] = [a.step for row, _ in exported for a in row.alerts]
    assert alerts == dict.fromkeys(alerts, [GRAD_AT, RAISED_AT]) and out.alerts == 2
    assert tracker.alerts[-1] == (RAISED_AT, ["exception"])
    # The warning is sent and exported as what it is: a point of its own, not an anomaly's.
    first = next(row for row, _ in exported if row.step == 0)
    for points in (first.scalars, tracker.points[0]):
        assert points["warning/outside_optimizer"] == 4 and not any(k.startswith("anomaly/") for k in points)
    assert "anomaly/exception" in tracker.points[RAISED_AT]
