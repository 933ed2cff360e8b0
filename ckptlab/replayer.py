"""Replay: rebuild, restore, re-run the recorded steps bit-exactly, and explain the fault.

    report = ckptlab.replay("runs/exp1", 5432)
    report.root_step, report.origin.module, report.samples[0].sample_id, report.verdict

What happens, in order:
1. pick the start: the latest checkpoint at or before the first recorded anomaly of the fault's
   episode (a checkpoint written at or after the fault never starts its replay), in the same
   session, with every batch up to the requested step still retained;
2. rebuild with the recorded `build_fn`, restore every state that changes bits (model,
   optimizer, scheduler, RNGs, thread count, determinism flags, default dtype);
3. re-run the recorded steps through the recorded `step_fn` with the recorded batches, checking
   every loss and grad norm against the record bit for bit, and watching for the root step:
   the first non-finite loss/gradient/weight, loss or grad-norm spike, or exploding update;
4-6. blame.py: trace the root step per op (trace.py) from an in-memory snapshot of the state it
   started in; blame batch rows (non-finite or absurd values, the rows the origin op's bad
   elements map to, per-row loss and gradient norm) and parameters (non-finite or exploding
   gradients, weights, update ratios against their recorded typical values); prove it by
   counterfactual replay (the root step without the blamed rows; the same batch from an older
   model state; the recent learning rate);
7. say it in one sentence (replay_findings.verdict), or say honestly that the fault did not
   reproduce.

A distributed run is replayed on its recorded world size (replay_dist.py). The step-level
anomaly rule is analysis/anomalies.py, shared with the Recorder.
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ckptlab import userfns
from ckptlab.analysis.anomalies import EPISODE_GAP, detectors, episode_start, step_anomalies
from ckptlab.analysis.spikes import LOSS_RULE, SpikeDetector
from ckptlab.blame import Blame
from ckptlab.dist import World
from ckptlab.errors import ReplayError
from ckptlab.probe import StepHealth, StepProbe
from ckptlab.replay_dist import replay_distributed, solo_world
from ckptlab.replay_findings import (  # noqa: F401 - the report's types are part of this module's API
    Counterfactual,
    Origin,
    ParameterBlame,
    ReplayReport,
    SampleBlame,
    StepCheck,
    _absdiff,
    _same,
    verdict,
)
from ckptlab.run.reader import Run, open_run
from ckptlab.run.sharded import full_snapshot
from ckptlab.state import apply_env, capture_env, capture_train_state, restore_checkpoint, restore_rng, snapshot
from ckptlab.trace import Tracer

# --- the trainee: what build_fn returns, restored --------------------------------------------

@dataclass
class Trainee:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    scaler: Any = None
    probe: StepProbe | None = None


class Replayer:
    """Rebuilds and drives the recorded training; knows nothing about verdicts."""

    def __init__(self, run: Run, *, device: str | None = None, log: Callable[[str], None] | None = None, rank: int = 0):
        self.run = run
        self.rank = rank  # whose batches (and RNG states) to replay
        self.world: World | None = None
        self.log = log or (lambda msg: None)
        self.notes: list[str] = []
        self.metrics = run.metrics()
        manifest = run.manifest
        recorded_device = str(manifest.get("device", "cpu"))
        self.device = torch.device(device) if device else torch.device(recorded_device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ReplayError(
                f"replay on {self.device} asked for, but this machine has no GPU",
                path=run.path,
                hint="pass --device cpu (a CPU replay of a GPU run is not bit-exact)",
            )
        if self.device.type != torch.device(recorded_device).type:
            self.notes.append(f"recorded on {recorded_device}, replaying on {self.device}: losses will not match bit for bit")
        fns = manifest.get("functions", {})
        if "build_fn" not in fns or "step_fn" not in fns:
            raise ReplayError("the manifest does not name build_fn/step_fn", path=run.path)
        for role, desc in fns.items():
            if userfns.source_changed(desc, run.path):
                self.notes.append(
                    f"{role} source changed since recording ({desc.get('file')}); replay may not match"
                )
        with _user_output():
            self.build_fn = userfns.load(fns["build_fn"], "build_fn", run.path)
            self.step_fn = userfns.load(fns["step_fn"], "step_fn", run.path)
        self.has_scheduler = bool(manifest.get("config", {}).get("has_scheduler"))
        self.step_scheduler = bool(manifest.get("config", {}).get("step_scheduler", True))

    # --- building and restoring ----------------------------------------------------------------

    def build(self) -> Trainee:
        if self.device.type == "cuda":
            apply_env({}, force_deterministic=True)  # before any CUDA work: cuBLAS reads it once
        with _user_output():
            built = self.build_fn()
        if not isinstance(built, (tuple, list)) or len(built) < 2:
            raise ReplayError("build_fn must return (model, optimizer[, scheduler])", path=self.run.path)
        model, optimizer = built[0], built[1]
        scheduler = built[2] if len(built) > 2 else None
        scaler = built[3] if len(built) > 3 else None
        if self.has_scheduler and scheduler is None:
            raise ReplayError(
                "the run was recorded with an LR scheduler, but build_fn returns none",
                path=self.run.path,
                hint="return (model, optimizer, scheduler) from build_fn",
            )
        model.to(self.device)
        if self.world is None:  # once: in a distributed replay, detecting creates a group
            self.world = World.detect(model)
        t = Trainee(model, optimizer, scheduler, scaler)
        t.probe = StepProbe(model, optimizer, scaler, self.world)
        return t

    def load_checkpoint(self, t: Trainee, step: int) -> None:
        ckpt = self.run.checkpoint(step)
        ckpt.verify()
        try:
            state = restore_checkpoint(ckpt, t.model, t.optimizer, t.scheduler, t.scaler, self.world)
        except (ValueError, KeyError, RuntimeError) as e:
            raise ReplayError(
                f"checkpoint {step} does not fit the model build_fn returns: {e}",
                path=ckpt.path,
                hint="replay with the code the run was recorded with",
            ) from None
        self.notes.extend(apply_env(state.get("env", {}), force_deterministic=self.device.type == "cuda"))

    def batch(self, step: int):
        rec = self.run.batch_record(step, self.rank)
        rec.batch = _to_device(rec.batch, self.device)
        return rec

    def run_step(self, t: Trainee, rec, batch=None, *, tracer: Tracer | None = None, measure_update: bool = True) -> StepHealth:
        """One recorded step (or `batch` in its place), exactly as the Recorder ran it.
        `measure_update` costs a copy of the parameters (for update ratios, weight norms)."""
        if rec.rng is not None:
            restore_rng(rec.rng)
        t.probe.begin(measure_update=measure_update)
        try:
            with _user_output(), (tracer if tracer is not None else contextlib.nullcontext()):
                loss = self.step_fn(t.model, t.optimizer, rec.batch if batch is None else batch)
            health = t.probe.end(loss)
        finally:
            t.probe._active = False
        if t.scheduler is not None and self.step_scheduler:
            t.scheduler.step()
        return health

    def snapshot(self, t: Trainee, step: int):
        """The state `step` starts in. Sharded training: collective, whole on rank 0 only."""
        if self.world is not None and self.world.sharded and self.world.distributed:
            state = capture_train_state(None, t.scheduler, t.scaler)
            return full_snapshot(self.world, step, t.model, t.optimizer, state)
        return snapshot(step, t.model, t.optimizer, t.scheduler, t.scaler)

    def close(self, t: Trainee) -> None:
        if t.probe is not None:
            t.probe.close()


# --- the replay ------------------------------------------------------------------------------------

def replay(
    run: Run | str | Path,
    step: int,
    *,
    device: str | None = None,
    from_step: int | None = None,
    trace: bool = True,
    counterfactuals: bool = True,
    log: Callable[[str], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
    rank: int | None = None,
    nproc: int | None = None,
) -> ReplayReport:
    """Replay `step` of `run` and explain it. See the module docstring.

    A distributed run replays on as many processes as it was recorded with (`nproc`, if
    given, must say the same); `rank=R` instead replays rank R's micro-batches in this one
    process: a quick look, not bit-exact (the other ranks' gradients are missing).
    `log(message)` hears what replay is doing; `progress(done, total)` counts replayed steps."""
    run = open_run(run) if not isinstance(run, Run) else run
    saved_env = capture_env()
    try:
        if run.world_size > 1 and rank is None:
            return replay_distributed(run, step, device=device, from_step=from_step, trace=trace,
                                       counterfactuals=counterfactuals, log=log, nproc=nproc)
        if rank is not None and not 0 <= rank < run.world_size:
            raise ReplayError(f"rank {rank} is not in the run (world size {run.world_size})", path=run.path)
        with solo_world(run.world_size > 1):
            inv = Investigation(run, step, device=device, from_step=from_step, log=log, rank=rank or 0)
            inv.progress = progress or inv.progress
            if run.world_size > 1:
                inv.r.notes.append(
                    f"single-process replay of rank {rank}'s micro-batches out of {run.world_size}: "
                    "an approximation (the other ranks' gradients are missing), not bit-exact"
                )
            return inv.investigate(trace, counterfactuals)
    finally:
        apply_env(saved_env)


class Investigation:
    """One replay of one requested step: plan the window, replay it, judge it, explain it."""

    def __init__(self, run: Run, step: int, *, device, from_step, log, rank: int = 0):
        self.run, self.step, self.from_step = run, step, from_step
        self.log = log or (lambda msg: None)
        self.progress: Callable[[int, int], None] = lambda done, total: None
        self.t0 = time.perf_counter()
        self.timing: dict[str, float] = {}
        m = run.metrics()
        if m.index(step) is None and step not in run.steps:
            raise ReplayError(run._missing_step(step), path=run.path)
        self.r = Replayer(run, device=device, log=self.log, rank=rank)
        self.m = m
        self.health_every = int(run.manifest.get("config", {}).get("health_every", 10))

    # 1. where to start -----------------------------------------------------------------------

    def recorded_anomalies(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for e in self.run.events():
            out.setdefault(int(e["step"]), []).append(e["kind"])
        i = self.m.index(self.step)
        if i is not None and not math.isfinite(self.m.loss[i]):
            out.setdefault(self.step, []).append("nonfinite_loss")
        return out

    def episode_start(self, anomalies: dict[int, list[str]]) -> int:
        """The first recorded anomaly of the episode that ends at the requested step."""
        return episode_start(anomalies, self.step)

    def choose_start(self, before: int) -> int:
        run = self.run
        if self.from_step is not None:
            if self.from_step not in run.checkpoints:
                raise ReplayError(f"--from-step {self.from_step} is not a checkpoint (checkpoints: {run.checkpoints})", path=run.path)
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
            raise ReplayError(f"no checkpoint to replay step {self.step} from (checkpoints: {run.checkpoints})", path=run.path)
        k = candidates[-1]
        missing = sorted(set(range(k, self.step + 1)) - set(run.steps))
        if missing:
            raise ReplayError(
                f"the batches of steps {missing[0]}..{missing[-1]} are not in the run (pruned by retention?), "
                f"so step {self.step} cannot be replayed from checkpoint {k}",
                path=run.path,
            )
        return k

    # 2-3. replay the window ---------------------------------------------------------------------

    def detectors(self, k: int) -> dict[str, SpikeDetector]:
        """Spike detectors primed with the record of the steps before `k`."""
        dets = detectors()
        hist = self.m.window(max(0, k - LOSS_RULE.window), k - 1)
        for loss, grad in zip(self.m.loss[hist], self.m.grad_norm[hist]):
            dets["loss"].check(float(loss))
            dets["grad"].check(float(grad))
        return dets

    @staticmethod
    def anomalies(h: StepHealth, dets: dict[str, SpikeDetector]) -> list[str]:
        return [e["kind"] for e in step_anomalies(h, dets)]

    def replay_window(self, k: int, snap_from: int):
        """Replay k..step; the root is the first step of the anomaly episode ending at `step`.

        Keeps the state (and spike detectors) before each anomalous step from `snap_from` on,
        so the root can be traced without replaying the window twice."""
        r = self.r
        t = r.build()
        r.load_checkpoint(t, k)
        dets = self.detectors(k)
        checks: list[StepCheck] = []
        kept: dict[int, tuple] = {}
        for s in range(k, self.step + 1):
            self.progress(s - k, self.step - k + 1)
            rec = r.batch(s)
            suspect = s >= snap_from  # near the recorded fault: keep state, measure updates
            snap = r.snapshot(t, s) if suspect else None
            dets_before = copy.deepcopy(dets)
            h = r.run_step(t, rec, measure_update=suspect or s % self.health_every == 0)
            found = self.anomalies(h, dets)
            checks.append(self.compare(s, h, found))
            if found:
                kept[s] = (snap, dets_before)
                for old in [x for x in kept if x < s - 16 * EPISODE_GAP]:
                    del kept[old]  # bounded memory: only the recent episode matters
        r.close(t)
        replayed = {c.step: c.anomalies for c in checks if c.anomalies}
        root = episode_start(replayed, self.step) if self.step in replayed else None
        snap, dets_before = kept.get(root, (None, None))
        return checks, root, snap, dets_before

    def compare(self, s: int, h: StepHealth, found: list[str]) -> StepCheck:
        i = self.m.index(s)
        rec_loss = float(self.m.loss[i]) if i is not None else None
        rec_grad = float(self.m.grad_norm[i]) if i is not None else None
        match = i is not None and _same(h.loss, rec_loss) and _same(h.grad_norm, rec_grad)
        rec_ranks = self.m.scalars[i].get("rank_loss") if i is not None else None
        if h.rank_loss is not None:
            match = match and rec_ranks is not None and all(map(_same, h.rank_loss, rec_ranks))
        return StepCheck(s, h.loss, rec_loss, h.grad_norm, rec_grad, match, found, h.rank_loss, rec_ranks, h.rank_grad_norm)

    def state_before(self, k: int, root: int):
        """A snapshot of the state in which `root` starts, by replaying k..root-1 again."""
        r = self.r
        t = r.build()
        r.load_checkpoint(t, k)
        for s in range(k, root):
            r.run_step(t, r.batch(s), measure_update=False)
        snap = r.snapshot(t, root)
        r.close(t)
        return snap

    # the whole investigation ---------------------------------------------------------------------

    def plan(self) -> tuple[bool, int, int]:
        """(fault_recorded, first step of the recorded episode, start checkpoint)."""
        anomalies = self.recorded_anomalies()
        episode = self.episode_start(anomalies)
        return self.step in anomalies, episode, self.choose_start(episode)

    def investigate(self, do_trace: bool, do_counterfactuals: bool) -> ReplayReport:
        fault_recorded, episode, k = self.plan()
        t0 = time.perf_counter()
        checks, root, root_snap, root_dets = self.replay_window(k, snap_from=max(k, episode - 2))
        # The root at the very first replayed step may have begun earlier: look from further back.
        earlier = [c for c in self.run.checkpoints if c < k and set(range(c, k)) <= set(self.run.steps)]
        if root == k and earlier and self.from_step is None:
            self.log(f"the fault shows at the first replayed step {k}; replaying from checkpoint {earlier[-1]} to look further back")
            k = earlier[-1]
            checks, root, root_snap, root_dets = self.replay_window(k, snap_from=max(k, episode - 2))
        self.timing["replay_s"] = time.perf_counter() - t0
        if root is not None and root_snap is None:
            root_snap = self.state_before(k, root)
            root_dets = self.detectors(root)
        return self.report(k, fault_recorded, checks, root, root_snap, root_dets, do_trace, do_counterfactuals)

    def report(self, k, fault_recorded, checks, root, root_snap, root_dets, do_trace, do_counterfactuals, rank=None) -> ReplayReport:
        """Judge the replayed window (determinism, reproduction) and explain the root step."""
        pre_fault = [c for c in checks if root is None or c.step < root]
        if root is None and fault_recorded:
            pre_fault = [c for c in checks if c.step < self.step]
        divergence = next((c for c in pre_fault if not c.match), None)
        first_div = None
        if divergence is not None:
            first_div = {
                "step": divergence.step,
                "loss": divergence.loss,
                "recorded_loss": divergence.recorded_loss,
                "grad_norm": divergence.grad_norm,
                "recorded_grad_norm": divergence.recorded_grad_norm,
                "abs_diff": _absdiff(divergence.loss, divergence.recorded_loss),
            }
        report = ReplayReport(
            run=str(self.run.path),
            requested_step=self.step,
            root_step=root,
            start_checkpoint=k,
            fault_recorded=fault_recorded,
            reproduced=root is not None,
            deterministic=divergence is None,
            first_divergence=first_div,
            origin=Origin("none", None, None, None, None, None),
            samples=[],
            parameters=[],
            chain=[],
            counterfactuals=[],
            steps=checks,
            verdict="",
            notes=self.r.notes,
            rank=rank,
        )
        if root is not None:
            Blame(self, root, root_snap, root_dets, k).explain(report, do_trace, do_counterfactuals)
        report.verdict = verdict(report)
        self.timing["total_s"] = time.perf_counter() - self.t0
        report.timing = self.timing
        return report


def attribute_rows(run: Run | str | Path, step: int, *, device: str | None = None, rank: int = 0) -> list[SampleBlame]:
    """Per-row loss and gradient norm of one recorded step, replayed from the state it started
    in; rows ranked by gradient norm (the row that dominates the update first). For a
    distributed run, rank `rank`'s micro-batch, replayed in this one process (approximate)."""
    run = open_run(run) if not isinstance(run, Run) else run
    saved = capture_env()
    try:
        with solo_world(run.world_size > 1):
            return _attribute_rows(run, step, device, rank)
    finally:
        apply_env(saved)


def _attribute_rows(run: Run, step: int, device, rank: int) -> list[SampleBlame]:
    inv = Investigation(run, step, device=device, from_step=None, log=None, rank=rank)
    k = inv.choose_start(step)
    b = Blame(inv, step, inv.state_before(k, step), inv.detectors(step), k)
    rows = b.per_row()
    b.r.close(b.t)
    out = [SampleBlame(r, b.sample_id(r), "per-row replay", h.loss, h.grad_norm) for r, h in rows.items()]
    return sorted(out, key=lambda s: -(s.grad_norm if math.isfinite(s.grad_norm) else math.inf))


# --- helpers ------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _user_output():
    """The user's prints go to stderr: stdout is ours (e.g. `--json`)."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _to_device(obj, device: torch.device):
    if device.type == "cpu":
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
        return type(obj)(*[_to_device(v, device) for v in obj])
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj
