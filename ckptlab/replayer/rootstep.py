"""The root step of a fault, ready to be replayed as often as the analysis needs.

    root = RootStep(investigation, window)   # window.root: the step; window.root_state: its state
    h = root.step()                          # the root step again, from the state it started in
    h = root.step(batch, tracer=tracer)      # with another batch (some rows), traced per op
    root.fault(h)                            # the anomalies that replay shows
    rows = root.attempt("rows alone", per_row, root, default={})   # an experiment the user's code may refuse
    root.close()

The stages of blame.py (rows.py, parameters.py, origin.py, counterfactuals.py, search.py) are
plain functions of this one object: it holds what they share (the recorded batch and its rows,
the replay handle, the report being written, the replays' findings that later stages read).

Every experiment that runs the user's step on something the record never ran (some rows, an
older state, another learning rate, float32) goes through `attempt`: the user's code may refuse
it (a batch with rows removed that its loss cannot take, a model that needs more than one row),
and then that experiment failed, is listed in `failed` (the report's `failed_experiments`), and
the investigation goes on without it.
"""

from __future__ import annotations

import copy

from ckptlab.analysis.anomalies import step_anomalies
from ckptlab.analysis.batches import batch_rows
from ckptlab.replayer.findings import ReplayReport
from ckptlab.replayer.startstate import new_anomalies
from ckptlab.run.manifest import OptimizerGroups
from ckptlab.training.crash import describe, is_step_error
from ckptlab.training.health import StepHealth


class RootStep:
    """The traced root step: its batch, rows and sample ids, the runner it replays on, the
    state and spike detectors it started with, and the report its analysis writes."""

    _report: ReplayReport | None  # the report the stages write into
    _base: StepHealth | None  # the root step as replayed (parameter blame)
    older_fault: bool | None  # the same batch from an older checkpoint: faults?

    def __init__(self, inv, window):
        """`inv`: the Investigation (its run, metrics, replayer, budget, log and timing);
        `window`: the replayed window whose root step is analysed, with the state that step
        started in."""
        self.inv, self.root, self.start = inv, window.root, window.start
        self.snap, self.dets = window.root_state, window.root_detectors
        self.bad_start = window.bad_start  # weights non-finite before the window: no new anomaly
        self.replayer = inv.replayer
        self.rec = self.replayer.batch(self.root)
        self.ids = self.rec.sample_ids
        self.rows = batch_rows(self.rec.batch, self.ids)
        self.runner = self.replayer.build()
        # whose each parameter group is, and which group each parameter is in (the manifest's)
        self.optimizers = OptimizerGroups.of(inv.run.manifest)
        self._report = None
        self._base = None
        self.older_fault = None
        self.failed: list[dict] = []  # the experiments the user's code refused (`attempt`)

    @property
    def report(self) -> ReplayReport:
        """The report the stages write into (blame.py sets it before any stage runs)."""
        assert self._report is not None, "blame.explain/explain_crash set the report before the stages read it"
        return self._report

    @report.setter
    def report(self, rep: ReplayReport) -> None:
        self._report = rep

    @property
    def base(self) -> StepHealth:
        """The root step as replayed, for parameter blame (blame.explain sets it first)."""
        assert self._base is not None, "blame.explain replays the root step before the stages read it"
        return self._base

    @base.setter
    def base(self, h: StepHealth) -> None:
        self._base = h

    def close(self) -> None:
        self.replayer.close(self.runner)

    def fresh(self) -> None:
        """Put the runner back in the state the root step started in."""
        self.replayer.restore(self.runner, self.snap)

    def step(self, batch=None, tracer=None) -> StepHealth:
        self.fresh()
        return self.replayer.run_step(self.runner, self.rec, batch, tracer=tracer)

    def fault(self, h: StepHealth) -> list[str]:
        """The anomalies of a replay of the root step, judged by the detectors it started with
        (a first update with an empty second moment that exploded among them, as the window
        judged it: the probe flags it on every step that measures its update), less the
        non-finite norms of weights that were so before the window began (startstate.py): every
        replay from that state shows them, whatever its batch."""
        return new_anomalies([e["kind"] for e in step_anomalies(h, copy.deepcopy(self.dets))], self.bad_start)

    def attempt(self, experiment: str, fn, *args, default=None):
        """`fn(*args)`, one experiment of the investigation. When the user's code raises in it
        (training/crash.py's `is_step_error`), the experiment failed: `failed` gets
        {"experiment", "error", "source"} and `default` comes back; ckptlab's own errors stay
        errors."""
        try:
            return fn(*args)
        except Exception as e:
            if not is_step_error(e):
                raise
            d = describe(e, self.runner.model)
            self.failed.append({"experiment": experiment, "error": d["error"], "source": d.get("source")})
            self.inv.log(f"{experiment} could not run: {d['error']}")
            return default

    def sample_id(self, row: int):
        return self.ids[row] if self.ids is not None and row < len(self.ids) else None
