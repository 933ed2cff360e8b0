"""The live side of the report's precursor finding (analysis/health/precursors.py): when a step
has a loss anomaly (a spike, a non-finite loss), the Recorder looks back over the per-parameter
gradient norms and update ratios of the steps before it and, when one stood out, says so in
the anomaly's event and its alert:

    step 42: loss spike (after side.weight got its first non-zero gradient at step 37
    (exactly 0 before)); explain it with ckptlab replay --run runs/exp1 --step 42

Each step only adds references to arrays its health record already holds (a bounded deque of
the window the report looks at); the look back runs at a loss anomaly alone.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ckptlab.analysis.health.precursors import BASELINE, describe, spikes_before
from ckptlab.analysis.health.rules import HealthRules
from ckptlab.training.health import StepHealth

LOSS_EVENTS = ("loss_spike", "nonfinite_loss")
RULES = HealthRules()


class Precursors:
    """The recent rows of per-parameter gradient norms and update ratios (the parameters in
    `names` order), and the look back at a loss anomaly."""

    def __init__(self, names: list[str]):
        self.names = names
        self._rows: deque = deque(maxlen=RULES.precursor_window + BASELINE + 1)
        self._last_event = -(10**9)

    def add(self, step: int, health: StepHealth, events: list[dict]) -> None:
        """Step `step`'s numbers; a loss event among `events` gets a `precursor` key (the
        parameter, what spiked, its step and ratio) when one stood out before it."""
        updates = health.update_ratio if health.update_ratio is not None and health.stepped else None
        self.add_row(step, health.param_grad_norm, updates, events)

    def add_row(self, step: int, grads, updates, events: list[dict]) -> None:
        """`add` of the numbers themselves: the per-parameter gradient norms (an array or a
        list), the update ratios (None: not measured this step)."""
        if grads is None or len(grads) != len(self.names):
            return
        self._rows.append((step, grads, updates))
        loss = next((e for e in events if e["kind"] in LOSS_EVENTS), None)
        if loss is None:
            return
        quiet = step - self._last_event <= RULES.precursor_window  # (an episode's later steps: aftermath)
        self._last_event = step
        if quiet or len(self._rows) < 2:
            return
        found = self.look_back()
        if found:
            top = found[0]
            ratio = top["ratio"] if np.isfinite(top["ratio"]) else None  # (a first non-zero gradient)
            loss["precursor"] = {"param": top["param"], "what": top["what"], "step": top["step"], "ratio": ratio}
            loss["precursor_text"] = describe(top)

    def look_back(self) -> list[dict]:
        rows = list(self._rows)
        steps = np.array([r[0] for r in rows])
        grads = np.array([r[1] for r in rows], dtype=np.float64)
        grads[grads < 0] = np.nan  # -1: no gradient
        nan = np.full(len(self.names), np.nan)
        updates = np.array([r[2] if r[2] is not None else nan for r in rows], dtype=np.float64)
        return spikes_before(steps, self.names, [("gradient", grads), ("update", updates)], len(rows) - 1, RULES)
