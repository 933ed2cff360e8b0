"""What makes a step faulty: each anomaly kind defined once, for the Recorder (events while
training), replay (finding the root step) and report (its per-step findings), so all three call
the same steps anomalous.

A step is anomalous when
- `nonfinite_loss`: its loss is NaN/Inf (a loss not known, of a step that returned none, is
  no fault: recorded null, NaN in `Metrics.loss` where `Metrics.loss_known` is False);
- `nonfinite_grad`: a gradient element, or a parameter's gradient norm, is NaN/Inf -- except on a
  step a GradScaler skipped (`scaler_skipped`: its gradients overflowed, the update was not
  applied and the scale backed off: that is how float16 training finds its scale);
- `nonfinite_weight`: (when measured) a weight tensor's norm after the update is NaN/Inf;
- `loss_spike`: its loss spikes (LOSS_RULE, analysis/spikes.py);
- `grad_spike`: its gradient norm explodes: a spike (GRAD_RULE, >= 5x the median), or over
  GRAD_EXPLOSION whatever came before (which needs no history: it holds from the first step);
- `update_explosion`: its update moves the weights by more than UPDATE_EXPLOSION of their norm
  (measured every `health_every` steps while recording, exactly at every replayed step while
  replaying);
- `first_update`: (where updates are measured) a parameter whose optimizer second moment was
  empty (Adam's `exp_avg_sq` all zero, or no state yet) met a nonzero gradient and its update
  moved it by more than UPDATE_EXPLOSION of its norm.

Each predicate takes one step's values or a whole series (numpy arrays, one row a step), so the
Recorder's per-step check and report's scan of the recorded metrics are the same test.
"""

from __future__ import annotations

import math

import numpy as np

from ckptlab.analysis.spikes import GRAD_RULE, LOSS_RULE, Spike, SpikeDetector, SpikeRule, find_spikes
from ckptlab.run.records import IDLE_OPTIMIZER, OUTSIDE_OPTIMIZER, RECORD_WARNINGS  # noqa: F401 (their home for readers)

# A weight tensor set that moves by more than half its own norm in one step is exploding
# (healthy training moves ~1e-3..1e-2 of it per step; see report's update-ratio band).
UPDATE_EXPLOSION = 0.5
# A pre-clip global gradient norm over this is an explosion with or without history: healthy
# norms are O(0.1..10), and the spike rule needs 16 steps of baseline before it says anything.
GRAD_EXPLOSION = 1000.0
# Anomalous steps at most this far apart belong to one fault episode: after a real root the
# damage shows step after step (huge or non-finite weights), while isolated spikes that
# recovered are not the cause of a later NaN.
EPISODE_GAP = 3


# --- the definitions -------------------------------------------------------------------------------


def nonfinite_loss(loss, known=True):
    """The loss is NaN/Inf (a scaler skip does not excuse it: backing off the scale cannot fix a
    forward pass that overflows). A bool, or a bool array for a series. Not where it is not
    known: a step's loss None, or a series' rows where `known` (`Metrics.loss_known`) is False."""
    if loss is None:
        return False
    return ~np.isfinite(loss) & np.asarray(known, dtype=bool)


def nonfinite_grad(nonfinite_grads, param_grad_norm, scaler_skipped):
    """Non-finite gradient elements, or a non-finite per-parameter gradient norm (an overflowed
    norm of finite elements), on a step the GradScaler did not skip. `param_grad_norm` is
    float[P] for a step or float[S, P] for a series; a row that is all NaN was not recorded
    (NO_GRAD, -1, is finite: no gradient is not a bad one)."""
    norms = np.asarray(param_grad_norm)
    if norms.dtype.kind != "f":  # (a float32 series stays as it is: a GB on a long run)
        norms = norms.astype(np.float64)
    if norms.shape[-1] == 0:
        bad_norm = np.zeros(norms.shape[:-1], dtype=bool)
    else:
        bad_norm = ~np.isfinite(norms).all(axis=-1) & ~np.isnan(norms).all(axis=-1)
    return ((np.asarray(nonfinite_grads) > 0) | bad_norm) & ~np.asarray(scaler_skipped, dtype=bool)


def nonfinite_weight(weight_norm):
    """How many weight tensors have a non-finite norm after the update (a step: an int; a
    series: one count a row). Only meaningful where the norms were measured."""
    return (~np.isfinite(np.asarray(weight_norm))).sum(axis=-1)


def grad_exploded(norm: float, spike: Spike | None, bar: float = GRAD_EXPLOSION) -> bool:
    """A gradient-norm spike (the detector's verdict on `norm`), or a finite norm over `bar`."""
    return spike is not None or (math.isfinite(norm) and norm > bar)  # (over_bar's test: the Recorder's per step)


def over_bar(norms: np.ndarray, bar: float = GRAD_EXPLOSION) -> np.ndarray:
    """bool[S]: `grad_exploded`'s bar on a series of norms (finite and over `bar`)."""
    with np.errstate(invalid="ignore"):
        return np.isfinite(norms) & (norms > bar)


def first_update(empty, update_ratio, param_grad_norm) -> list[int]:
    """The parameters whose second moment was empty before the update (`empty`: the flags of
    training/first_update.py; None: not measured) that a nonzero gradient reached and whose
    update moved them by more than UPDATE_EXPLOSION of their norm: an optimizer's first update
    with an empty second moment that exploded (Adam moves every element by ~lr at once)."""
    if empty is None or update_ratio is None:
        return []
    with np.errstate(invalid="ignore"):
        hit = (
            (np.asarray(empty) > 0) & (np.asarray(param_grad_norm) > 0) & (np.asarray(update_ratio) > UPDATE_EXPLOSION)
        )
    return np.flatnonzero(hit).tolist()


def update_exploded(ratio):
    """||dw|| / ||w|| over all parameters together above UPDATE_EXPLOSION (None: not measured)."""
    return ratio is not None and ratio > UPDATE_EXPLOSION


# --- a step, as the Recorder and replay see it ----------------------------------------------------


def detectors() -> dict[str, SpikeDetector]:
    return {"loss": SpikeDetector(LOSS_RULE), "grad": SpikeDetector(GRAD_RULE)}


def step_anomalies(h, dets: dict[str, SpikeDetector]) -> list[dict]:
    """The anomalies of one step's health (a training.health.StepHealth), as events {kind, value, ...};
    feeds the step to the spike detectors (a spike's event adds its median and z)."""
    events = []
    if nonfinite_loss(h.loss):
        events.append({"kind": "nonfinite_loss", "value": h.loss})
    if nonfinite_grad(h.nonfinite_grads, h.param_grad_norm, h.scaler_skipped):
        events.append({"kind": "nonfinite_grad", "value": h.nonfinite_grads})
    if h.weight_norm is not None and nonfinite_weight(h.weight_norm):
        events.append({"kind": "nonfinite_weight", "value": int(nonfinite_weight(h.weight_norm))})
    events += spike_events(h.loss, h.grad_norm, dets) + update_events(h.update_ratio_global)
    first = first_update(getattr(h, "second_moment_empty", None), h.update_ratio, h.param_grad_norm)
    if first:  # value: their largest finite update ratio (inf: all moved from zero); parameters: their indices
        ratios = np.asarray(h.update_ratio)[first]
        finite = ratios[np.isfinite(ratios)]
        value = float(finite.max()) if finite.size else math.inf
        events.append({"kind": "first_update", "value": value, "parameters": first})
    return events


def spike_events(loss: float | None, grad_norm: float, dets: dict[str, SpikeDetector]) -> list[dict]:
    """A step's loss and gradient-norm spikes, as events (the whole of `step_anomalies` for a
    step whose numbers are all finite and whose update was not measured); feeds both to the
    detectors (a loss not known, None, to neither)."""
    events = []
    spike = dets["loss"].check(loss) if loss is not None else None
    if spike is not None:
        events.append({"kind": "loss_spike", "value": loss, "median": spike.median, "z": spike.z})
    spike = dets["grad"].check(grad_norm)
    if grad_exploded(grad_norm, spike):
        spread = {"median": spike.median, "z": spike.z} if spike is not None else {}
        events.append({"kind": "grad_spike", "value": grad_norm, **spread})
    return events


def update_events(ratio: float | None) -> list[dict]:
    """The update explosion of a step whose global update ratio is `ratio` (None: not
    measured), as events."""
    return [{"kind": "update_explosion", "value": ratio}] if update_exploded(ratio) else []


# --- a series, as report sees it ------------------------------------------------------------------


def grad_explosions(norms, rule: SpikeRule = GRAD_RULE, bar: float = GRAD_EXPLOSION) -> list[tuple[int, Spike | None]]:
    """(index, spike or None) of every step whose gradient norm explodes, scanning the series as
    the Recorder would (None: over `bar` without being a spike)."""
    norms = np.asarray(norms, dtype=np.float64).reshape(-1)
    spikes: dict[int, Spike | None] = dict(find_spikes(norms, rule))
    for i in np.flatnonzero(over_bar(norms, bar)).tolist():
        spikes.setdefault(i, None)
    return sorted(spikes.items())


def episode_start(anomalies: dict[int, list[str]], step: int) -> int:
    """The first step of the run of anomalous steps (gaps <= EPISODE_GAP) ending at `step`."""
    start = step
    for s in sorted((s for s in anomalies if s < step), reverse=True):
        if start - s > EPISODE_GAP:
            break
        start = s
    return start


# --- what the Recorder says about its own record ---------------------------------------------------

# Recorded as an event, but no fault of a step: the optimizer the Recorder was given never
# stepped in a session's first steps while the weights changed (IDLE_OPTIMIZER), or parameters
# that no optimizer given holds had a gradient and changed (OUTSIDE_OPTIMIZER: another optimizer
# trains them) (record/health.py), so the record misses updates, or their optimizer's state. Replay does not look for it as a fault; it gives it as the reason
# a replay leaves the record.
# (The kinds are the run format's: run/records.py, which read_progress also needs.)
_WARNED = "the Recorder warned at step"


def idle_optimizer_text(steps: int) -> str:
    """What an IDLE_OPTIMIZER event says, and what to do."""
    return (
        f"the optimizer given to the Recorder did not step in the first {steps} steps, yet the weights changed: "
        "it is not the one that trains them (a trainer that made its own?), so the record misses their updates; "
        "give the Recorder the optimizer that steps (optimizer=None for a loop that updates the weights by hand)"
    )


def outside_optimizer_text(names: list[str]) -> str:
    """What an OUTSIDE_OPTIMIZER event says of the parameters `names`, and what to do."""
    few = ", ".join(f"`{n}`" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (
        f"{few} had a gradient and changed, though no optimizer given to the Recorder holds "
        f"{'them' if len(names) > 1 else 'it'}: another optimizer trains {'them' if len(names) > 1 else 'it'} "
        "(a second one the Recorder was not told about?), whose state the checkpoints miss, so replay will not "
        "follow the run; give the Recorder every optimizer, as a list or a dict (optimizer=[opt_d, opt_g])"
    )


def record_warning_note(event: dict) -> str:
    """A RECORD_WARNINGS event as a replay's note (`is_record_warning` finds it again)."""
    return f"{_WARNED} {event['step']}: {event.get('detail') or event['kind']}"


def is_record_warning(note: str) -> bool:
    return note.startswith(_WARNED)
