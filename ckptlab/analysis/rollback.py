"""Choose the checkpoint to roll back to. Pure: reads a run, returns a choice (moving files
is run/archive.py's job, exporting run/portable.py's).

    choice = choose(run, metric="val_loss", mode="min")     # best validation, early-stopping style
    choice = choose(run, before_anomaly=True)               # last healthy checkpoint before trouble
    choice.step, choice.why, choice.candidates

Two ways to choose:
- by a validation metric: early stopping (`health.early_stopping`) finds where validation
  turned up (`patience` evaluations without improving); the checkpoint at its best step is
  chosen (the Recorder checkpoints every new best, `keep_best=True`). Without one there,
  the retained checkpoint with the best recorded value, else the latest one before it.
- before the first anomaly (non-finite loss/gradient/weight, loss or gradient spike): the
  latest checkpoint taken strictly before that step, as the Recorder's retention protects.
With neither asked for: by the metric when the run has validation points, else before the
first anomaly. A metric other than the run's val_metric needs its mode (min or max) given.
A candidate that fails its integrity check is never chosen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ckptlab.analysis.anomalies import nonfinite_loss
from ckptlab.analysis.health import EarlyStop, early_stopping, validation_series
from ckptlab.errors import CkptlabError, RetiredError
from ckptlab.run.reader import Run


@dataclass
class Candidate:
    step: int
    reason: str  # why it was taken: start, periodic, best, manual
    validation: dict  # metrics measured on this state (validation logged at this step)
    healthy: bool  # taken before the first anomaly
    integrity: str  # "ok", "not checked", or the failure
    chosen: bool = False


@dataclass
class RollbackChoice:
    run: str
    by: str  # "metric" | "before_anomaly"
    metric: str | None
    mode: str | None
    patience: int | None
    step: int | None  # the chosen checkpoint
    why: str
    candidates: list[Candidate]
    first_anomaly: dict | None  # {"step", "kind"}
    early_stop: EarlyStop | None
    last_step: int | None  # the last step recorded
    notes: list[str] = field(default_factory=list)


def first_anomaly(run: Run) -> dict | None:
    """The earliest recorded anomaly, or a non-finite loss in the per-step health."""
    found = [{"step": int(e["step"]), "kind": e.get("kind", "anomaly")} for e in run.events()]
    m = run.metrics()
    bad = np.flatnonzero(nonfinite_loss(m.loss, m.loss_known))
    if len(bad):
        found.append({"step": int(m.step[bad[0]]), "kind": "nonfinite_loss"})
    return min(found, key=lambda e: e["step"]) if found else None


def candidates(run: Run, *, verify: bool = True) -> list[Candidate]:
    anomaly = first_anomaly(run)
    by_step: dict[int, dict] = {}
    for p in run.validation():
        by_step.setdefault(int(p["step"]), {}).update(p.get("metrics", {}))
    out = []
    for step in run.checkpoints:
        c = run.checkpoint(step)
        integrity = "not checked"
        if verify:
            try:
                c.verify()
                integrity = "ok"
            except RetiredError:  # retired by retention since the run was listed: not a candidate
                continue
            except CkptlabError as e:
                integrity = str(e)
        val = dict(c.commit.get("validation") or {})
        val.update(by_step.get(step, {}))
        healthy = bool(c.commit.get("healthy", True)) and (anomaly is None or step < anomaly["step"])
        out.append(Candidate(step, c.reason, val, healthy, integrity))
    return out


def choose(
    run: Run,
    *,
    metric: str | None = None,
    mode: str | None = None,
    before_anomaly: bool = False,
    patience: int = 3,
    verify: bool = True,
) -> RollbackChoice:
    """Pick the checkpoint; raises CkptlabError when there is nothing to choose from, or when
    `metric` is not the run's val_metric and `mode` is not given (the run's val_mode is about
    its own metric: borrowed for an accuracy, it would choose the worst checkpoint)."""
    config = run.manifest.get("config", {})
    explicit = metric is not None
    run_metric = config.get("val_metric", "val_loss")
    if explicit and mode is None and metric != run_metric and not before_anomaly:
        raise CkptlabError(
            f"--metric {metric} is not the run's val_metric ({run_metric}), so its direction is unknown: "
            "pass --mode min (lower is better) or --mode max (higher is better)",
            path=run.path,
        )
    metric = metric or run_metric
    mode = mode or config.get("val_mode", "min")
    if mode not in ("min", "max"):
        raise CkptlabError(f"--mode must be min or max, not {mode!r}")
    cands = candidates(run, verify=verify)
    if not cands:
        raise CkptlabError("the run has no complete checkpoint to roll back to", path=run.path)
    m = run.metrics()
    steps = [*run.steps, *m.step.tolist()]
    last = max(steps) if steps else None
    anomaly = first_anomaly(run)
    series = validation_series(run, metric)
    choice = RollbackChoice(str(run.path), "metric", metric, mode, patience, None, "", cands, anomaly, None, last)
    if before_anomaly:
        _before_anomaly(choice)
    elif (es := early_stopping(series, metric, mode, patience)) is not None:  # None: no validation points
        _by_metric(choice, es)
    elif explicit:
        raise CkptlabError(
            f"no validation values of {metric!r} recorded (log them with rec.log_validation({metric}=...))",
            path=run.path,
        )
    elif anomaly is not None:
        _before_anomaly(choice)
    else:
        raise CkptlabError(
            "no validation metric and no anomaly recorded: nothing to choose by",
            path=run.path,
            hint="log validation with rec.log_validation(val_loss=...)",
        )
    for c in cands:
        c.chosen = c.step == choice.step
    return choice


def _usable(c: Candidate) -> bool:
    return c.integrity in ("ok", "not checked")


def _before_anomaly(choice: RollbackChoice) -> None:
    choice.by, choice.metric, choice.mode, choice.patience = "before_anomaly", None, None, None
    a = choice.first_anomaly
    if a is None:
        raise CkptlabError(
            "no anomaly recorded: nothing to roll back before",
            path=choice.run,
            hint="roll back by a validation metric instead (--metric NAME)",
        )
    before = [c for c in choice.candidates if c.step < a["step"]]
    usable = [c for c in before if _usable(c)]
    if not usable:
        raise CkptlabError(
            f"no intact checkpoint before the first anomaly ({a['kind']} at step {a['step']})", path=choice.run
        )
    pick = usable[-1]
    if pick is not before[-1]:
        choice.notes.append(f"checkpoint {before[-1].step} failed its integrity check; using {pick.step}")
    choice.step = pick.step
    choice.why = (
        f"the last intact checkpoint before the first anomaly ({a['kind']} at step {a['step']}); "
        f"{a['step'] - pick.step} step(s) before it"
    )


def _by_metric(choice: RollbackChoice, es: EarlyStop) -> None:
    choice.early_stop = es
    sign = 1.0 if choice.mode == "min" else -1.0
    turned = (
        f"validation turned up after step {es.best_step} (no improvement in {es.patience} evaluations, by step {es.stop_step})"
        if es.stop_step is not None
        else f"validation was still improving (best at step {es.best_step})"
    )
    if (
        es.stop_step is not None
        and sign * (es.global_best_value - es.best_value) < 0
        and es.global_best_step > es.stop_step
    ):
        choice.notes.append(
            f"{choice.metric} later reached {es.global_best_value:.6g} at step {es.global_best_step}; "
            f"a larger --patience would pick that instead"
        )
    usable = [c for c in choice.candidates if _usable(c)]
    ideal = _metric_pick(choice, es, choice.candidates)  # were every checkpoint intact
    pick = _metric_pick(choice, es, usable)
    if pick is None:
        raise CkptlabError(
            f"no intact checkpoint at or before the best {choice.metric} (step {es.best_step})", path=choice.run
        )
    if ideal is not None and ideal is not pick and not _usable(ideal):
        choice.notes.append(f"checkpoint {ideal.step} failed its integrity check; using {pick.step}")
    choice.step = pick.step
    if pick.step == es.best_step:
        choice.why = f"best {choice.metric} = {es.best_value:.6g} at step {es.best_step}: {turned}"
    elif ideal is not None and ideal.step == es.best_step:  # there is one, but it is corrupt
        choice.why = f"the checkpoint at the best step {es.best_step} failed its integrity check; " + (
            f"checkpoint {pick.step} has the best recorded {choice.metric} = {pick.validation[choice.metric]:.6g} ({turned})"
            if _scored(choice, es, pick)
            else f"checkpoint {pick.step} is the latest intact one before it ({turned})"
        )
    elif _scored(choice, es, pick):
        choice.why = (
            f"no checkpoint at the best step {es.best_step}; checkpoint {pick.step} has the best recorded "
            f"{choice.metric} = {pick.validation[choice.metric]:.6g} ({turned})"
        )
    else:
        choice.why = (
            f"no checkpoint at the best step {es.best_step} (record with keep_best=True to keep one); "
            f"checkpoint {pick.step} is the latest before it ({turned})"
        )


def _scored(choice: RollbackChoice, es: EarlyStop, c: Candidate) -> bool:
    """`c` has a recorded value of the metric, up to where validation turned up."""
    v = c.validation.get(choice.metric)
    return isinstance(v, (int, float)) and math.isfinite(v) and (es.stop_step is None or c.step <= es.stop_step)


def _metric_pick(choice: RollbackChoice, es: EarlyStop, cands: list[Candidate]) -> Candidate | None:
    """Among `cands`: the checkpoint at the best step, else the one with the best recorded
    value (up to where validation turned up), else the latest before the best step."""
    sign = 1.0 if choice.mode == "min" else -1.0
    at_best = next((c for c in cands if c.step == es.best_step), None)
    if at_best is not None:
        return at_best
    scored = [c for c in cands if _scored(choice, es, c)]
    if scored:
        return min(scored, key=lambda c: sign * c.validation[choice.metric])
    before = [c for c in cands if c.step <= es.best_step]
    return before[-1] if before else None
