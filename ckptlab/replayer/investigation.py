"""One investigation of one requested step: plan the window, replay it, judge it, explain it.

    inv = Investigation(run, 5432, device=None, from_step=None, log=print)
    report = inv.investigate(trace=True, counterfactuals=True)

    plan = inv.plan()                                  # Plan: where the replay starts, and why
    window = inv.replay_window(plan.start, snap_from)  # Window: every step checked; the root
    report = inv.report(plan, window, trace=..., counterfactuals=...)   # + blame.py's evidence

The distributed driver (distributed.py) uses the same three pieces, with the window replayed
by one process per rank.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ckptlab.analysis.anomalies import (
    EPISODE_GAP,
    RECORD_WARNINGS,
    detectors,
    episode_start,
    nonfinite_loss,
    step_anomalies,
)
from ckptlab.analysis.spikes import LOSS_RULE, SpikeDetector
from ckptlab.errors import ReplayError, RetiredError
from ckptlab.numbers import absdiff, ranges, same, same_loss
from ckptlab.replayer.agreement import judge, survives_noise, why_bits_differ
from ckptlab.replayer.blame import explain, explain_crash
from ckptlab.replayer.divergence import check_divergence
from ckptlab.replayer.driver import Replayer
from ckptlab.replayer.findings import FirstUpdate, Origin, ReplayReport, StepCheck
from ckptlab.replayer.optstate import first_updates
from ckptlab.replayer.rootstep import RootStep
from ckptlab.replayer.search import DEFAULT_BUDGET, Budget
from ckptlab.replayer.startstate import describe as describe_start
from ckptlab.replayer.startstate import new_anomalies, nonfinite_params
from ckptlab.replayer.verdict import verdict
from ckptlab.run.layout import batches_root
from ckptlab.run.manifest import data_group
from ckptlab.run.reader import Metrics, Run
from ckptlab.training.crash import describe, is_step_error
from ckptlab.training.health import StepHealth
from ckptlab.training.step import StepRunner


@dataclass
class Plan:
    """Where a replay starts, and what the record says about the requested step."""

    fault_recorded: bool  # the requested step was anomalous when recorded
    episode: int  # the first recorded anomaly of the episode that ends at the requested step
    start: int  # the checkpoint the replay starts from


@dataclass
class Window:
    """What replaying the steps `start`..requested found."""

    start: int  # the checkpoint the window was replayed from
    checks: list[StepCheck]  # every replayed step against the record
    root: int | None  # the first step of the replayed anomaly episode; None: no fault
    root_state: Any = None  # a snapshot of the state the root step started in
    root_detectors: dict[str, SpikeDetector] | None = None  # spike detectors primed up to the root
    crash: dict | None = None  # the step that raised on replay (the window ends there): training/crash.py
    bad_start: list[dict] = field(default_factory=list)  # weights already non-finite at `start` (startstate.py)
    first_updates: list[FirstUpdate] = field(default_factory=list)  # optstate.py: first updates that exploded


class Investigation:
    """One replay of one requested step: plan the window, replay it, judge it, explain it."""

    def __init__(
        self, run: Run, step: int, *, device, from_step, log, rank: int = 0, trust_code: bool = False, dump=None
    ):
        self.run, self.step, self.from_step = run, step, from_step
        self.dump = dump  # a DumpRequest (dump.py) or None
        self.log = log or (lambda msg: None)
        self.progress: Callable[[int, int], None] = lambda done, total: None
        self.t0 = time.perf_counter()
        self.timing: dict[str, float] = {}
        self.metrics = run.metrics()
        if self.metrics.index(step) is None and step not in run.steps:
            raise ReplayError(run.missing_step(step), path=run.path)
        self.replayer = Replayer(run, device=device, log=self.log, rank=rank, trust_code=trust_code)
        self.budget = Budget(DEFAULT_BUDGET)  # extra replays for the deeper searches (search.py)
        self.folded: tuple[int, int] | None = None  # replayed on K of the recorded W processes (fold.py)

    # 1. where to start -----------------------------------------------------------------------

    def recorded_anomalies(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for e in self.run.events():
            if e["kind"] not in RECORD_WARNINGS:  # (no fault of a step: the driver's note)
                out.setdefault(int(e["step"]), []).append(e["kind"])
        i = self.metrics.index(self.step)
        if i is not None and nonfinite_loss(self.metrics.loss[i], self.metrics.loss_known[i]):
            out.setdefault(self.step, []).append("nonfinite_loss")
        return out

    def choose_start(self, before: int) -> int:
        """The checkpoint to replay from (`_start`), held with its batches against the
        retention of a run that is still recording (Run.hold) until the replay ends."""
        for attempt in range(3):
            run = self.run
            try:
                k = self._start(before)
            except ReplayError:  # on a live run, maybe from a listing retention has since changed
                if attempt == 2 or not run.recording:
                    raise
                run.refresh()
                continue
            older = [c for c in run.checkpoints if c < k]  # the older state a counterfactual starts from
            first = older[-1] if older and set(range(older[-1], k)) <= set(run.steps) else k
            if run.hold([k, *older[-1:]], (first, self.step)):
                return k
            run.refresh()  # retention retired part of it since the run was listed: list again
        raise RetiredError(f"checkpoint {k} (or a batch log after it)", path=self.run.path)

    def _start(self, before: int) -> int:
        """The latest checkpoint at or before `before` (the first anomaly of the episode) in
        the step's session, with every batch from it to the step; else, when retention pruned
        some, the latest checkpoint before the step that has them (with a note)."""
        run = self.run
        if self.from_step is not None:
            if self.from_step not in run.checkpoints:
                raise ReplayError(
                    f"--from-step {self.from_step} is not a checkpoint (checkpoints: {run.checkpoints})", path=run.path
                )
            if self.from_step > self.step:
                raise ReplayError(f"--from-step {self.from_step} is after step {self.step}", path=run.path)
            return self.from_step
        sessions = [s["start_step"] for s in run.manifest.get("sessions", [])]
        session_start = max([s for s in sessions if s <= self.step], default=0)
        candidates = [c for c in run.checkpoints if session_start <= c <= min(before, self.step)]
        if not candidates:
            first = run.checkpoints[0] if run.checkpoints else None
            if first is not None and first > self.step:
                raise ReplayError(
                    f"step {self.step} is before the first retained checkpoint ({first}); nothing to start from",
                    path=run.path,
                )
            raise ReplayError(
                f"no checkpoint to replay step {self.step} from (checkpoints: {run.checkpoints})", path=run.path
            )
        k = candidates[-1]
        for bad in [d for d in run.damaged_checkpoints if k < d <= min(before, self.step)]:
            self.replayer.notes.append(
                f"checkpoint {bad} is damaged (`ckptlab info` says how); replaying from checkpoint {k}, "
                "the latest intact one before the fault"
            )
        return _whole_window(run, k, self.step, before, self.replayer.notes)

    def plan(self) -> Plan:
        anomalies = self.recorded_anomalies()
        episode = episode_start(anomalies, self.step)
        return Plan(fault_recorded=self.step in anomalies, episode=episode, start=self.choose_start(episode))

    # 2-3. replay the window ---------------------------------------------------------------------

    def detectors(self, k: int) -> dict[str, SpikeDetector]:
        """Spike detectors primed with the record of the steps before `k`."""
        dets = detectors()
        hist = self.metrics.window(max(0, k - LOSS_RULE.window), k - 1)
        for loss, grad in zip(self.metrics.loss[hist], self.metrics.grad_norm[hist]):
            dets["loss"].check(float(loss))
            dets["grad"].check(float(grad))
        return dets

    @staticmethod
    def anomalies(h: StepHealth, dets: dict[str, SpikeDetector]) -> list[str]:
        return [e["kind"] for e in step_anomalies(h, dets)]

    def replay_window(self, k: int, snap_from: int) -> Window:
        """Replay k..step; the root is the first step of the anomaly episode ending at `step`.

        Keeps the state (and spike detectors) before each anomalous step from `snap_from` on,
        so the root can be traced without replaying the window twice."""
        r = self.replayer
        t = measured_exactly(r, r.build())
        r.load_checkpoint(t, k)
        bad = nonfinite_params(t.model)  # already bad: their non-finite norms are no new anomaly
        if r.world is not None and r.world.stages is not None:  # (a pipeline: every stage's, judged alike)
            bad = [b for part in r.world.gather_objects(bad) for b in part]
        dets = self.detectors(k)
        checks: list[StepCheck] = []
        kept: dict[int, tuple] = {}
        crash, firsts = None, []
        for s in range(k, self.step + 1):
            self.progress(s - k, self.step - k + 1)
            rec = r.batch(s)
            snap = r.snapshot(t, s) if s >= snap_from else None  # near the recorded fault: keep state
            dets_before = copy.deepcopy(dets)
            try:
                h, first = measured_step(r, t, rec, s)
            except Exception as e:
                if not is_step_error(e):
                    raise
                crash = {"step": s, **describe(e, t.model)}
                checks.append(self.crashed(s, crash))
                kept[s] = (snap, dets_before)
                break
            found = new_anomalies(self.anomalies(h, dets), bad)
            firsts += first  # (found has them as `first_update`: the step whose update exploded)
            error = self.recorded_error(s) if self.metrics.index(s) is None else None
            checks.append(compare(self.metrics, s, h, found, error))
            if found:
                kept[s] = (snap, dets_before)
                for old in [x for x in kept if x < s - 16 * EPISODE_GAP]:
                    del kept[old]  # bounded memory: only the recent episode matters
        r.close(t)
        last = checks[-1].step if checks else self.step  # the requested step, or one that raised
        root = _root_of(checks, last, crash)
        snap, dets_before = kept.get(root, (None, None)) if root is not None else (None, None)
        return Window(k, checks, root, snap, dets_before, crash, bad, firsts)

    def write_dump(self, report: ReplayReport, captured) -> None:
        if captured is None:
            report.notes.append(
                f"no dump written to {self.dump.path}: no fault reproduced, so there is no root step to dump"
            )
            return
        from ckptlab.replayer.dump import write

        t0 = time.perf_counter()
        entries, came_from, notes = captured
        report.notes.extend(notes)
        report.dump = write(report, entries, came_from, self.dump)
        self.timing["dump_write_s"] = time.perf_counter() - t0

    def recorded_error(self, step: int) -> str | None:
        """The exception step `step` raised when recorded (its `exception` event), if any: the
        replayed rank's own when it recorded one (a rank whose step raised makes its peers'
        collectives fail: rank 0's event is then that failure)."""
        found = [e for e in self.run.events() if e.get("kind") == "exception" and int(e["step"]) == step]
        mine = [e for e in found if int(e.get("rank", 0)) == (self.replayer.rank or 0)]
        return (mine or found)[0].get("error") if found else None

    def crashed(self, s: int, crash: dict) -> StepCheck:
        """Step s raised on replay: it matches the record when the record has it raising too
        (no health recorded, and an exception event of the same type when there is one)."""
        i = self.metrics.index(s)
        recorded = self.recorded_error(s)
        same_error = recorded is None or recorded.split(":", 1)[0] == crash.get("type")
        return StepCheck(
            s,
            math.nan,
            self.metrics.loss_at(i),
            math.nan,
            float(self.metrics.grad_norm[i]) if i is not None else None,
            i is None and same_error,
            ["exception"],
            error=crash.get("error"),
            recorded_error=recorded,
        )

    def state_before(self, k: int, root: int):
        """A snapshot of the state in which `root` starts, by replaying k..root-1 again."""
        r = self.replayer
        t = r.build()
        r.load_checkpoint(t, k)
        for s in range(k, root):
            r.run_step(t, r.batch(s), measure_update=False)
        snap = r.snapshot(t, root)
        r.close(t)
        return snap

    def root_at(self, step: int) -> Window:
        """`step` taken as the root, with the state it starts in (replayed from the checkpoint
        before it): what per-row attribution of any recorded step starts from."""
        k = self.choose_start(step)
        return Window(k, [], step, self.state_before(k, step), self.detectors(step))

    def with_root_state(self, window: Window) -> Window:
        """The window, with the state its root started in (replayed again when the window did
        not keep it: a root before `snap_from`)."""
        if window.root is not None and window.root_state is None:
            window.root_state = self.state_before(window.start, window.root)
            window.root_detectors = self.detectors(window.root)
        return window

    # the whole investigation ---------------------------------------------------------------------

    def investigate(self, *, trace: bool, counterfactuals: bool) -> ReplayReport:
        plan = self.plan()
        t0 = time.perf_counter()
        k = plan.start
        window = self.replay_window(k, snap_from=max(k, plan.episode - 2))
        # The root at the very first replayed step may have begun earlier: look from further back.
        earlier = [c for c in self.run.checkpoints if c < k and set(range(c, k)) <= set(self.run.steps)]
        if window.root == k and earlier and self.from_step is None:
            self.log(
                f"the fault shows at the first replayed step {k}; replaying from checkpoint {earlier[-1]} to look further back"
            )
            k = earlier[-1]
            window = self.replay_window(k, snap_from=max(k, plan.episode - 2))
        self.timing["replay_s"] = time.perf_counter() - t0
        return self.report(plan, self.with_root_state(window), trace=trace, counterfactuals=counterfactuals)

    def report(
        self, plan: Plan, window: Window, *, trace: bool, counterfactuals: bool, rank: int | None = None
    ) -> ReplayReport:
        """Judge the replayed window (determinism, reproduction) and explain the root step;
        `rank`: the process whose batch brought the fault (reported as its data-parallel rank)."""
        root, checks = window.root, window.checks
        pre_fault = [c for c in checks if root is None or c.step < root]
        if root is None and plan.fault_recorded:
            pre_fault = [c for c in checks if c.step < self.step]
        divergence = next((c for c in pre_fault if not c.match), None)
        report = ReplayReport(
            run=str(self.run.path),
            requested_step=self.step,
            # Not reproduced: still the step the record says the fault began at.
            root_step=root if root is not None or not plan.fault_recorded else plan.episode,
            start_checkpoint=window.start,
            fault_recorded=plan.fault_recorded,
            reproduced=root is not None,
            deterministic=divergence is None,
            first_divergence=first_divergence(divergence),
            origin=Origin("none", None, None, None, None, None),
            samples=[],
            parameters=[],
            chain=[],
            counterfactuals=[],
            steps=checks,
            verdict="",
            notes=self.replayer.notes,
            **data_group(self.run.manifest, rank),
        )
        execution(report, self.run, self.replayer.compiled)
        report.recorded_error = self.recorded_error(report.root_step if report.root_step is not None else self.step)
        judge(report, pre_fault or checks[:1], self.run.manifest)
        if root is None and plan.fault_recorded:
            self.not_reproduced(report, plan, trace)
        why_bits_differ(self, report, trace)
        report.start_state, report.first_updates = _start_state(self, report, window), window.first_updates
        captured = self.blame_root(report, window, trace, counterfactuals) if root is not None else None
        report.verdict = verdict(report)
        if self.dump is not None and not _raised_at_root(window):
            self.write_dump(report, captured)
        self.timing["total_s"] = time.perf_counter() - self.t0
        report.timing = self.timing
        return report

    def not_reproduced(self, report: ReplayReport, plan: Plan, trace: bool) -> None:
        """A recorded fault the replay did not reproduce: where the replay left the record, and
        (no exception recorded) the weights the record shows non-finite, and why it left."""
        report.left_record_step = next((c.step for c in report.steps if not c.match), None)
        if report.recorded_error is not None:
            return
        report.origin = recorded_weights(self.metrics, plan.episode)
        # One process only: a distributed run replayed in this process (one rank's share)
        # never matches its record, so "the replays agree but not the record" would mislead.
        if trace and report.left_record_step is not None and self.run.world_size == 1:
            t0 = time.perf_counter()
            report.divergence = check_divergence(self, report.left_record_step)
            self.timing["divergence_s"] = time.perf_counter() - t0

    def blame_root(self, report: ReplayReport, window: Window, trace: bool, counterfactuals: bool):
        """blame.py's stages over the root step; what the dump will hold (None: no dump).
        Not bit-exact: first, does the fault survive ulp-level noise (agreement.py)?"""
        root = RootStep(self, window)
        if window.crash is None or not _raised_at_root(window):
            survives_noise(root, report)
            return explain(root, report, trace, counterfactuals, dump=self.dump)
        if self.dump is not None:
            report.notes.append("no dump: the step raised before its tensors could be followed to a fault")
        explain_crash(root, report, window.crash, trace)
        return None


# The anomalies that leave the training state damaged (weights moved too far or non-finite,
# a non-finite gradient or loss on its way into them): a later step that raises may be their
# symptom. A loss or gradient spike alone leaves nothing behind.
LASTING_DAMAGE = {"update_explosion", "first_update", "nonfinite_weight", "nonfinite_grad", "nonfinite_loss"}


def _root_of(checks: list[StepCheck], last: int, crash: dict | None) -> int | None:
    """The root of the replayed window's fault: the first anomalous step of the episode that
    ends at `last`, whatever the symptom (a step that raised after an update exploded is the
    explosion's symptom, not its root), but only after damage that lasts: a spike that
    recovered is no cause of a later step's exception, which is then its own root."""
    replayed = {c.step: c.anomalies for c in checks if c.anomalies}
    root = episode_start(replayed, last) if last in replayed else None
    if crash is None or root is None or root == crash["step"]:
        return root
    before = {k for s, kinds in replayed.items() if root <= s < crash["step"] for k in kinds}
    return root if before & LASTING_DAMAGE else crash["step"]


def _raised_at_root(window: Window) -> bool:
    """The root step itself raised (not a later step of its episode)."""
    return window.crash is not None and window.crash["step"] == window.root


def measured_exactly(r: Replayer, t: StepRunner) -> StepRunner:
    """`t` (and every runner `r` builds after it) measuring each step's update exactly: a copy
    of every parameter before the update, +1x their bytes (docs/replay.md). On a GPU without
    that room, the update is measured as the run recorded it (a note says so)."""
    if r.update_ratio == "exact":
        t.probe.update_mode = "exact"
        return t
    need = sum(p.numel() * p.element_size() for p in t.probe.params)
    if r.device.type == "cuda" and torch.cuda.mem_get_info(r.device)[0] < 2 * need:
        note = f"too little free GPU memory to measure every update exactly: measured as recorded ({r.update_ratio})"
        if note not in r.notes:
            r.notes.append(note)
        return t
    r.update_ratio = t.probe.update_mode = "exact"
    return t


def measured_step(r: Replayer, t: StepRunner, rec, step: int) -> tuple[StepHealth, list[FirstUpdate]]:
    """One replayed step with its update and weight norms measured (every step, whatever the
    record's `health_every`), and the parameters whose first update with an empty second
    moment exploded in it (optstate.py). Measuring only reads the state."""
    h = r.run_step(t, rec, measure_update=True)
    return h, first_updates(step, h, t.probe.all_names)


def _start_state(inv: Investigation, report: ReplayReport, window: Window) -> dict | None:
    """The weights already non-finite in the start checkpoint, and the rows of the root step
    (else the requested one) that read them (startstate.py); None when the state was sound."""
    if not window.bad_start:
        return None
    batch, ids = inv.run.batch(report.root_step if report.root_step is not None else inv.step, inv.replayer.rank)
    return describe_start(inv.run, window.start, window.bad_start, batch, ids)


def _whole_window(run: Run, k: int, step: int, before: int, notes: list[str]) -> int:
    """`k`, when every batch from it to `step` is in the run; else, when retention pruned some,
    the latest checkpoint before `step` that has them all (noted); else a ReplayError that says
    what is missing and why (retention, or a damaged log)."""
    kept = set(run.steps)
    missing = sorted(set(range(k, step + 1)) - kept)
    if not missing:
        return k
    logs = [d for d in run.damaged if d.startswith(str(batches_root(run.path)))]  # damage, not retention
    whole = [c for c in run.checkpoints if k < c <= step and set(range(c, step + 1)) <= kept]
    if whole and not logs:
        notes.append(
            f"the anomaly episode that ends at step {step} began at step {before}, but retention pruned "
            f"the batches of steps {missing[0]}..{missing[-1]}: replaying from checkpoint {whole[-1]}, the "
            f"latest before step {step} (`ckptlab replay --run {run.path} --step {before}` explains "
            "the episode's start)"
        )
        return whole[-1]
    if step in missing and not logs:
        raise ReplayError(
            f"the batch of step {step} was pruned by retention, so it cannot be replayed "
            f"(batches kept: {ranges(sorted(kept))})",
            path=run.path,
            hint="replay a step whose batch is kept, from a checkpoint before it",
        )
    why = (
        f"a batch log is damaged: {logs[0]}"
        if logs
        else f"pruned by retention; checkpoints kept: {run.checkpoints}, batches kept: {ranges(sorted(kept))}"
    )
    raise ReplayError(
        f"the batches of steps {missing[0]}..{missing[-1]} are not in the run ({why}), "
        f"so step {step} cannot be replayed from checkpoint {k}",
        path=run.path,
    )


def first_divergence(divergence: StepCheck | None) -> dict | None:
    """The report's `first_divergence`: the first replayed step before the fault that did not
    match the record, against the record."""
    if divergence is None:
        return None
    out = {
        "step": divergence.step,
        "loss": divergence.loss,
        "recorded_loss": divergence.recorded_loss,
        "grad_norm": divergence.grad_norm,
        "recorded_grad_norm": divergence.recorded_grad_norm,
        "abs_diff": absdiff(divergence.loss, divergence.recorded_loss),
    }
    if divergence.grad_scale is not None or divergence.recorded_grad_scale is not None:
        out["grad_scale"] = divergence.grad_scale
        out["recorded_grad_scale"] = divergence.recorded_grad_scale
    return out


def compare(m: Metrics, s: int, h: StepHealth, found: list[str], recorded_error: str | None) -> StepCheck:
    """Replayed step `s` (`h`, its anomalies `found`) against the record: loss, gradient norm,
    GradScaler scale and per-rank losses, bit for bit. `recorded_error`: the exception the
    record has for a step it has no health for."""
    i = m.index(s)
    rec_loss = m.loss_at(i)
    rec_grad = float(m.grad_norm[i]) if i is not None else None
    match = i is not None and same_loss(h.loss, rec_loss) and same(h.grad_norm, rec_grad)
    rec_ranks = m.scalars[i].get("rank_loss") if i is not None else None
    rec_scale = m.scalars[i].get("grad_scale") if i is not None else None
    if rec_scale is not None or h.grad_scale is not None:  # the GradScaler's state replays too
        match = match and same(h.grad_scale, rec_scale)
    if h.rank_loss is not None:
        match = match and rec_ranks is not None and all(map(same, h.rank_loss, rec_ranks))
    return StepCheck(
        s,
        h.loss,
        rec_loss,
        h.grad_norm,
        rec_grad,
        match,
        found,
        h.rank_loss,
        rec_ranks,
        h.rank_grad_norm,
        h.grad_scale,
        rec_scale,
        recorded_error=recorded_error,
    )


def recorded_weights(metrics: Metrics, step: int) -> Origin:
    """A fault that did not reproduce: the parameters whose weights the record shows
    non-finite at `step`: already before its update (recorded where the weights were bad
    then), else after it (when their norms were measured there, and only some went)."""
    i = metrics.index(step)
    for norms, when in (
        (metrics.weight_norm_before, f"already non-finite when step {step} began, before its update"),
        (metrics.weight_norm, f"going non-finite at step {step}"),
    ):
        finite = np.isfinite(norms[i]) if i is not None else np.ones(0, dtype=bool)
        if finite.any() and not finite.all():  # (all NaN: not measured at that step)
            names = [n for n, ok in zip(metrics.param_names, finite) if not ok]
            listed = ", ".join(f"`{n}`" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            return Origin(
                "none", None, None, None, names[0], None, detail=f"the record shows the weights of {listed} {when}"
            )
    return Origin("none", None, None, None, None, None)


def execution(report: ReplayReport, run: Run, compiled: bool | None) -> None:
    """How the replay ran against how the run was recorded: compiled or eager, and
    whether every replayed step (the faulty ones too) matched the record bit for bit."""
    recorded = run.manifest.get("config", {}).get("compiled")
    report.compiled = compiled
    report.recorded_compiled = recorded
    report.bit_exact = all(c.match for c in report.steps) if report.steps else None
    report.precursor = recorded_precursor(run, report.root_step, report.requested_step)
    if recorded is not None and report.compiled is not None and bool(recorded) != report.compiled:
        how = ("compiled", "eagerly") if recorded else ("eagerly", "compiled")
        report.notes.append(
            f"recorded {how[0]}, replayed {how[1]} (the model build_fn returns): "
            + ("bit-exact all the same" if report.bit_exact else "kernels differ, so the numbers may too")
        )


def recorded_precursor(run: Run, root: int | None, requested: int) -> dict | None:
    """What the Recorder saw stand out before the loss anomaly at the root step (or, with
    none, the requested one): its event's `precursor`, with `text`."""
    for step in dict.fromkeys(s for s in (root, requested) if s is not None):
        for e in run.events():
            if e["step"] == step and e.get("precursor"):
                return {**e["precursor"], "text": e.get("precursor_text", "")}
    return None
