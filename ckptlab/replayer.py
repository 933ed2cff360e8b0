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
4. trace the root step per op (trace.py) from an in-memory snapshot of the state it started in;
5. blame: batch rows (non-finite or absurd values, the rows the origin op's bad elements map
   to, per-row loss and gradient norm), parameters (non-finite or exploding gradients, weights,
   update ratios against their recorded typical values);
6. prove it by counterfactual replay: the root step without the blamed rows, and the same
   batch from an older model state;
7. say it in one sentence (`verdict`), or say honestly that the fault did not reproduce.
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ckptlab import userfns
from ckptlab.analysis.spikes import GRAD_RULE, LOSS_RULE, SpikeDetector
from ckptlab.dist import World
from ckptlab.errors import CkptlabError, ReplayError
from ckptlab.probe import NO_GRAD, StepHealth, StepProbe
from ckptlab.run.reader import Run, open_run
from ckptlab.run.checkpoint import commit_checkpoint, load_captured
from ckptlab.run.layout import checkpoint_name
from ckptlab.run.sharded import full_snapshot
from ckptlab.state import apply_env, capture_env, capture_train_state, restore_checkpoint, restore_rng, restore_snapshot, snapshot
from ckptlab.trace import OpEvent, Tracer

# A weight tensor set that moves by more than half its own norm in one step is exploding
# (healthy training moves ~1e-3..1e-2 of it per step; see report's update-ratio band).
UPDATE_EXPLOSION = 0.5
# A row is "absurd" when its largest |value| is this many times the run's typical row maximum
# for the same field (median over the retained batches).
ABSURD_RATIO = 1e3
# A row dominates a step when its own gradient norm is this many times the median row's.
DOMINANT_ROW_RATIO = 10.0
# Anomalous steps at most this far apart belong to one fault episode: after a real root the
# damage shows step after step (huge or non-finite weights), while isolated spikes that
# recovered are not the cause of a later NaN.
EPISODE_GAP = 3


# --- findings -------------------------------------------------------------------------------

@dataclass
class StepCheck:
    step: int
    loss: float
    recorded_loss: float | None
    grad_norm: float
    recorded_grad_norm: float | None
    match: bool  # loss and grad norm (and every rank's loss) equal to the record, bit for bit
    anomalies: list[str] = field(default_factory=list)
    rank_loss: list[float] | None = None  # distributed: each rank's loss, replayed ...
    recorded_rank_loss: list[float] | None = None  # ... and recorded
    rank_grad_norm: list[float] | None = None  # distributed: each rank's local gradient norm


@dataclass
class Origin:
    kind: str  # data | numeric | optimizer | none
    phase: str | None  # forward | backward | optimizer
    module: str | None
    op: str | None
    parameter: str | None
    source: str | None
    call: str | None = None
    produced: str | None = None  # "NaN" or "Inf", when an op produced it
    inputs_finite: bool | None = None  # all of that op's inputs were finite (else: NaN-free)
    detail: str | None = None


@dataclass
class SampleBlame:
    row: int
    sample_id: Any
    reason: str
    loss: float | None = None
    grad_norm: float | None = None


@dataclass
class ParameterBlame:
    name: str
    reason: str
    grad_norm: float | None
    typical_grad_norm: float | None
    nonfinite_grad: int
    update_ratio: float | None
    weight_norm: float | None


@dataclass
class Counterfactual:
    question: str
    fault: bool | None  # did the fault appear in this counterfactual run? None: not runnable
    detail: str


@dataclass
class ReplayReport:
    run: str
    requested_step: int
    root_step: int | None
    start_checkpoint: int
    fault_recorded: bool
    reproduced: bool
    deterministic: bool
    first_divergence: dict | None
    origin: Origin
    samples: list[SampleBlame]
    parameters: list[ParameterBlame]
    chain: list[dict]
    counterfactuals: list[Counterfactual]
    steps: list[StepCheck]
    verdict: str
    notes: list[str] = field(default_factory=list)
    timing: dict = field(default_factory=dict)
    rank: int | None = None  # distributed: the rank whose batch the fault came in with

    def to_json(self) -> dict:
        """The stable `ckptlab replay --json` document (DESIGN.md keys first)."""
        from ckptlab.render.jsonout import plain

        d = plain(self)
        keys = ["requested_step", "root_step", "reproduced", "deterministic", "origin", "samples", "verdict"]
        return {**{k: d[k] for k in keys}, **{k: v for k, v in d.items() if k not in keys}}


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
            return _replay_distributed(run, step, device=device, from_step=from_step, trace=trace,
                                       counterfactuals=counterfactuals, log=log, nproc=nproc)
        if rank is not None and not 0 <= rank < run.world_size:
            raise ReplayError(f"rank {rank} is not in the run (world size {run.world_size})", path=run.path)
        with _solo_world(run.world_size > 1):
            inv = _Investigation(run, step, device=device, from_step=from_step, log=log, rank=rank or 0)
            inv.progress = progress or inv.progress
            if run.world_size > 1:
                inv.r.notes.append(
                    f"single-process replay of rank {rank}'s micro-batches out of {run.world_size}: "
                    "an approximation (the other ranks' gradients are missing), not bit-exact"
                )
            return inv.investigate(trace, counterfactuals)
    finally:
        apply_env(saved_env)


# --- distributed replay ---------------------------------------------------------------------------

@contextlib.contextmanager
def _solo_world(needed: bool):
    """A process group of one, so a build_fn that wraps its model in DDP or fully_shard works
    in a single-process replay."""
    import torch.distributed as dist

    if not needed or not dist.is_available() or dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _replay_distributed(run: Run, step: int, *, device, from_step, trace, counterfactuals, log, nproc) -> ReplayReport:
    """Replay on the recorded world size (one process per rank, gloo on the CPU, NCCL on GPUs),
    then explain the root step in this process, on the rank whose batch brought the fault."""
    import json
    import socket
    import tempfile

    import torch.multiprocessing as mp

    world = run.world_size
    if nproc is not None and nproc != world:
        raise ReplayError(f"the run was recorded on {world} processes; --nproc {nproc} does not match", path=run.path)
    log = log or (lambda msg: None)
    with _solo_world(True):
        plan = _Investigation(run, step, device=device, from_step=from_step, log=log)
        fault_recorded, episode, k = plan.plan()
    for r in range(1, world):
        missing = sorted(set(range(k, step + 1)) - set(run.steps_of(r)))
        if missing:
            raise ReplayError(f"rank {r} has no batches for steps {missing[0]}..{missing[-1]} (a rank that died early?)", path=run.path)
    out = Path(tempfile.mkdtemp(prefix="ckptlab-replay-"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = "nccl" if (device or str(run.manifest.get("device", "cpu"))).startswith("cuda") else "gloo"
    log(f"replaying steps {k}..{step} on {world} processes ({backend})")
    t0 = time.perf_counter()
    try:
        mp.start_processes(
            _rank_worker,
            args=(world, port, backend, str(run.path), step, k, max(k, episode - 2), str(out), device),
            nprocs=world,
            start_method="spawn",
        )
    except mp.ProcessRaisedException as e:
        last = str(e).strip().splitlines()[-1]
        raise ReplayError(f"a replay process failed: {last}", path=run.path) from None
    result = json.loads((out / "result.json").read_text())
    checks = [StepCheck(**c) for c in result["checks"]]
    root, faulty = result["root"], result["rank"]
    with _solo_world(True):
        inv = _Investigation(run, step, device=device, from_step=k, log=log, rank=faulty or 0)
        inv.timing["replay_s"] = time.perf_counter() - t0
        inv.r.notes.extend(result["notes"])
        snap = dets = None
        if root is not None:
            snap = load_captured(out / "snapshot" / "checkpoints" / checkpoint_name(root))
            dets = inv.detectors(root)
        return inv.report(k, fault_recorded, checks, root, snap, dets, trace, counterfactuals, rank=faulty)


def _rank_worker(rank: int, world: int, port: int, backend: str, run_path: str, step: int, k: int, snap_from: int, out: str, device) -> None:
    """One rank of a distributed replay (a spawned process)."""
    import dataclasses
    import json
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    if backend == "nccl":
        torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        run = open_run(run_path)
        inv = _Investigation(run, step, device=device, from_step=k, log=None, rank=rank)
        checks, root, snap, _ = inv.replay_window(k, snap_from)
        faulty = _faulty_rank(checks, root)
        if root is not None and root < snap_from:  # (the same on every rank: sharded snapshots live on rank 0 only)
            snap = inv.state_before(k, root)  # collective: every rank replays up to the root again
        writer = 0 if inv.r.world.sharded else faulty  # sharded: whole state on rank 0, all RNGs
        if root is not None and rank == writer:
            # The state the root step started in, with the faulty rank's RNG streams.
            commit_checkpoint(Path(out) / "snapshot", snap)
        if rank == 0:
            doc = {"checks": [dataclasses.asdict(c) for c in checks], "root": root, "rank": faulty, "notes": inv.r.notes}
            (Path(out) / "result.json").write_text(json.dumps(doc))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _faulty_rank(checks: list[StepCheck], root: int | None) -> int | None:
    """The rank whose own loss or gradient went wrong first at the root step (every rank
    computes the same answer from the gathered values)."""
    if root is None:
        return None
    c = next(c for c in checks if c.step == root)
    if not c.rank_loss:
        return None
    for values in (c.rank_loss, c.rank_grad_norm or []):
        bad = [r for r, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            return bad[0]
    norms = c.rank_grad_norm or []
    return int(np.argmax(norms)) if norms else None


class _Investigation:
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
        dets = {"loss": SpikeDetector(LOSS_RULE), "grad": SpikeDetector(GRAD_RULE)}
        hist = self.m.window(max(0, k - LOSS_RULE.window), k - 1)
        for loss, grad in zip(self.m.loss[hist], self.m.grad_norm[hist]):
            dets["loss"].check(float(loss))
            dets["grad"].check(float(grad))
        return dets

    @staticmethod
    def anomalies(h: StepHealth, dets: dict[str, SpikeDetector]) -> list[str]:
        found = []
        if not math.isfinite(h.loss):
            found.append("nonfinite_loss")
        if h.nonfinite_grads or not np.isfinite(h.param_grad_norm).all():
            found.append("nonfinite_grad")
        if h.weight_norm is not None and not np.isfinite(h.weight_norm).all():
            found.append("nonfinite_weight")
        if dets["loss"].check(h.loss) is not None:
            found.append("loss_spike")
        if dets["grad"].check(h.grad_norm) is not None:
            found.append("grad_spike")
        ratio = h.update_ratio_global
        if ratio is not None and ratio > UPDATE_EXPLOSION:
            found.append("update_explosion")
        return found

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
            _Blame(self, root, root_snap, root_dets, k).explain(report, do_trace, do_counterfactuals)
        report.verdict = verdict(report)
        self.timing["total_s"] = time.perf_counter() - self.t0
        report.timing = self.timing
        return report


def episode_start(anomalies: dict[int, list[str]], step: int) -> int:
    """The first step of the run of anomalous steps (gaps <= EPISODE_GAP) ending at `step`."""
    start = step
    for s in sorted((s for s in anomalies if s < step), reverse=True):
        if start - s > EPISODE_GAP:
            break
        start = s
    return start


# --- blame ------------------------------------------------------------------------------------------

class _Blame:
    """Everything about the root step: trace, rows, parameters, counterfactuals, origin."""

    def __init__(self, inv: _Investigation, root: int, snap, dets, start: int):
        self.inv, self.root, self.snap, self.dets, self.start = inv, root, snap, dets, start
        self.r = inv.r
        self.rec = self.r.batch(root)
        self.ids = self.rec.sample_ids
        self.rows = _batch_rows(self.rec.batch, self.ids)
        self.t = self.r.build()

    def fresh(self) -> None:
        restore_snapshot(self.snap, self.t.model, self.t.optimizer, self.t.scheduler, self.t.scaler, rank=self.r.rank)

    def step(self, batch=None, tracer=None) -> StepHealth:
        self.fresh()
        return self.r.run_step(self.t, self.rec, batch, tracer=tracer)

    def fault(self, h: StepHealth) -> list[str]:
        return _Investigation.anomalies(h, copy.deepcopy(self.dets))

    def sample_id(self, row: int):
        return self.ids[row] if self.ids is not None and row < len(self.ids) else None

    def explain(self, rep: ReplayReport, do_trace: bool, do_counterfactuals: bool) -> None:
        self.report = rep
        t0 = time.perf_counter()
        tracer = None
        if do_trace:
            self.inv.log(f"tracing step {self.root} per op")
            tracer = Tracer(self.t.model, self.t.optimizer, rows=self.rows)
            traced = self.step(tracer=tracer)
            if not _same(traced.loss, rep.steps[self.root - rep.start_checkpoint].loss):
                rep.notes.append("the traced step's loss differs from the plain replay (tracing changed the kernels used)")
            rep.chain = [_event_json(e) for e in tracer.chain()]
            self.inv.timing["trace_s"] = time.perf_counter() - t0
        base = self.base = self.step()  # the root step as replayed, for parameter blame
        data_rows = self.data_rows()
        rows = self.per_row() if self.rows and self.rows > 1 else {}
        rep.parameters = self.parameters(base)
        rep.origin, rep.samples = self.origin(tracer, base, data_rows, rows)
        if do_counterfactuals:
            rep.counterfactuals = self.counterfactuals(rep.samples)
        self.r.close(self.t)
        self.inv.timing["blame_s"] = time.perf_counter() - t0

    # rows ------------------------------------------------------------------------------------------

    def data_rows(self) -> dict[str, dict[int, str]]:
        """What is wrong with each row's content, by category: "nonfinite" values, "absurd"
        values (against the run's own typical row maximum per field), "empty" rows (all
        padding, when the run's data_info names pad_id), token ids "out_of_range"."""
        found: dict[str, dict[int, str]] = {"nonfinite": {}, "absurd": {}, "empty": {}, "out_of_range": {}}
        if not self.rows:
            return found
        info = self.inv.run.manifest.get("data_info") or {}
        pad, vocab = info.get("pad_id"), info.get("vocab_size")
        typical = _typical_row_absmax(self.inv.run, self.root)
        for path, leaf in _leaves(self.rec.batch):
            if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or leaf.shape[0] != self.rows or leaf.dtype == torch.bool:
                continue
            flat = leaf.detach().reshape(self.rows, -1)
            if not flat.is_floating_point():
                for row in range(self.rows):
                    if pad is not None and flat.shape[1] and bool((flat[row] == pad).all()):
                        found["empty"].setdefault(row, f"batch{path} is empty (all padding, id {pad})")
                    if vocab is not None and flat.shape[1] and (int(flat[row].max()) >= vocab or int(flat[row].min()) < 0):
                        found["out_of_range"].setdefault(row, f"batch{path} has token ids outside [0, {vocab})")
                continue
            flat = flat.float()
            bad = (~torch.isfinite(flat)).sum(dim=1)
            finite = torch.where(torch.isfinite(flat), flat.abs(), torch.zeros_like(flat))
            absmax = finite.max(dim=1).values if flat.shape[1] else torch.zeros(self.rows)
            for row in range(self.rows):
                if int(bad[row]):
                    found["nonfinite"].setdefault(row, f"{int(bad[row])} non-finite value(s) in batch{path}")
                elif path in typical and typical[path] > 0 and float(absmax[row]) > ABSURD_RATIO * typical[path]:
                    found["absurd"].setdefault(
                        row,
                        f"batch{path} reaches |x|={float(absmax[row]):.3g}, {float(absmax[row]) / typical[path]:.3g}x the run's typical {typical[path]:.3g}",
                    )
        return found

    def per_row(self) -> dict[int, StepHealth]:
        """Each row alone through the step: its own loss and gradient norm."""
        out = {}
        for row in range(self.rows):
            try:
                out[row] = self.step(_select_rows(self.rec.batch, [row], self.rows))
            except Exception:  # noqa: BLE001 - a model that cannot take one row (BatchNorm...)
                return {}
        return out

    # parameters -------------------------------------------------------------------------------------

    def parameters(self, h: StepHealth) -> list[ParameterBlame]:
        m = self.inv.m
        names = m.param_names
        hist = m.window(max(0, self.root - 128), self.root - 1)
        typical = np.nanmedian(np.where(m.param_grad_norm[hist] >= 0, m.param_grad_norm[hist], np.nan), axis=0) if hist.stop > hist.start else np.full(len(names), np.nan)
        out = []
        for i, name in enumerate(names):
            g = float(h.param_grad_norm[i])
            nf = int(h.param_nonfinite[i]) if h.param_nonfinite is not None else 0
            ratio = float(h.update_ratio[i]) if h.update_ratio is not None else None
            w = float(h.weight_norm[i]) if h.weight_norm is not None else None
            typ = float(typical[i]) if i < len(typical) and math.isfinite(typical[i]) else None
            reasons = []
            if nf or (g != NO_GRAD and not math.isfinite(g)):
                reasons.append(f"{nf} non-finite gradient elements" if nf > 0 else "non-finite gradient")
            if w is not None and not math.isfinite(w):
                reasons.append("weights went non-finite")
            if typ and math.isfinite(g) and g > GRAD_RULE.min_ratio * 5 * typ:
                reasons.append(f"gradient norm {g:.3g} is {g / typ:.0f}x its typical {typ:.3g}")
            if ratio is not None and math.isfinite(ratio) and ratio > UPDATE_EXPLOSION:
                reasons.append(f"update moved the weights by {ratio:.3g}x their norm")
            elif ratio is not None and not math.isfinite(ratio) and w is not None and math.isfinite(w):
                pass  # a zero-initialized tensor's first move: not an explosion
            if reasons:
                out.append(ParameterBlame(name, "; ".join(reasons), g if g != NO_GRAD else None, typ, nf, ratio, w))
        out.sort(key=lambda p: (-p.nonfinite_grad, -(p.grad_norm / p.typical_grad_norm if p.grad_norm and p.typical_grad_norm and math.isfinite(p.grad_norm) else (math.inf if p.grad_norm is not None and not math.isfinite(p.grad_norm) else 0)), -(p.update_ratio or 0)))
        return out

    # the origin ----------------------------------------------------------------------------------------

    def origin(self, tracer: Tracer | None, h: StepHealth, data_rows: dict[str, dict[int, str]], rows: dict[int, StepHealth]):
        samples: dict[int, SampleBlame] = {}

        def blame(row: int, reason: str) -> None:
            if row in samples:
                samples[row].reason += "; " + reason
            else:
                samples[row] = SampleBlame(row, self.sample_id(row), reason)

        ev: OpEvent | None = tracer.origin if tracer is not None else None
        nonfinite_in_batch, absurd = data_rows["nonfinite"], data_rows["absurd"]
        dominant = _dominant_rows(rows)
        param = self.report.parameters[0].name if self.report.parameters else None

        if nonfinite_in_batch:
            for r, why in nonfinite_in_batch.items():
                blame(r, why)
            enters = next((e for e in (tracer.events if tracer else []) if e.phase == "forward" and any(not s.finite for s in e.inputs)), None)
            where = f"; it enters the model at `{enters.module or '<root>'}` ({enters.op})" if enters is not None and enters.module is not None else ""
            o = Origin("data", "forward", None, None, None, None, detail="the batch carries non-finite values" + where)
        elif ev is not None:
            for r, n in sorted((ev.bad_rows or {}).items(), key=lambda kv: -kv[1]):
                blame(r, f"{n} non-finite value(s) first appear in this row at {ev.op}")
            for r, why in absurd.items():
                blame(r, why)
            kind = "numeric"
            if absurd and (not ev.bad_rows or set(ev.bad_rows) <= set(absurd)):
                kind = "data"
            elif ev.phase == "optimizer":
                kind = "optimizer"
            o = Origin(
                kind,
                ev.phase,
                ev.module,
                ev.op,
                param if ev.phase != "forward" else None,
                ev.source,
                call=ev.call,
                produced="NaN" if ev.new_nan else "Inf",
                inputs_finite=all(x.finite for x in ev.inputs) and not ev.scalar_nonfinite,
                detail=f"{ev.op} produced {'NaN' if ev.new_nan else 'Inf'} from {'finite' if ev.new_inf else 'NaN-free'} inputs "
                f"({', '.join(s.describe() for s in ev.inputs[:3])})",
            )
        else:
            # Nothing went non-finite in the root step itself: an explosion (finite) that breaks later.
            lr_jump = _lr_jump(self.inv.m, self.root, h)
            for r, why in absurd.items():
                blame(r, why)
            for r, ratio in dominant.items():
                blame(r, f"its gradient norm is {ratio:.3g}x the median row's")
            if absurd or dominant:
                o = Origin("data", "backward", None, None, param, None,
                           detail="an absurd value in the batch makes the gradients explode" if absurd else "one row dominates the update")
            elif lr_jump is not None or "update_explosion" in self.fault(h):
                detail = f"learning rate {lr_jump[1]:.3g} is {lr_jump[0]:.0f}x its recent value" if lr_jump else "the update exploded without a gradient explosion"
                o = Origin("optimizer", "optimizer", None, None, param, None, detail=detail)
            elif self.report.parameters:
                o = Origin("numeric", "backward", None, None, param, None, detail="gradients exploded with no single row to blame")
            else:
                o = Origin("none", None, None, None, None, None)
        for category in ("empty", "out_of_range"):
            for r, why in data_rows[category].items():
                if r in samples:
                    samples[r].reason = why + "; " + samples[r].reason
        for r, row_h in rows.items():
            if r in samples:
                samples[r].loss, samples[r].grad_norm = row_h.loss, row_h.grad_norm
        ranked = sorted(samples.values(), key=lambda s: (-(s.grad_norm if s.grad_norm is not None and math.isfinite(s.grad_norm) else math.inf if s.grad_norm is not None else 0)))
        return o, ranked

    # counterfactuals ------------------------------------------------------------------------------------

    def counterfactuals(self, samples: list[SampleBlame]) -> list[Counterfactual]:
        out = []
        if samples and self.rows:
            keep = [r for r in range(self.rows) if r not in {s.row for s in samples}]
            ids = ", ".join(str(s.sample_id) for s in samples[:5])
            if keep:
                h = self.step(_select_rows(self.rec.batch, keep, self.rows))
                found = self.fault(h)
                out.append(
                    Counterfactual(
                        f"does step {self.root} still fail without the blamed rows ({ids})?",
                        bool(found),
                        f"without them: loss {h.loss:.6g}, grad norm {h.grad_norm:.4g}" + (f" -> still {', '.join(found)}" if found else " -> the fault vanishes"),
                    )
                )
            else:
                out.append(Counterfactual(f"does step {self.root} still fail without the blamed rows?", None, "every row is blamed; nothing left to run"))
        lr = _lr_jump(self.inv.m, self.root, self.base) if self.report.origin.kind == "optimizer" else None
        if lr is not None:
            typical = lr[1] / lr[0]
            self.fresh()
            for g in self.t.optimizer.param_groups:
                g["lr"] = typical
            h = self.r.run_step(self.t, self.rec)
            found = self.fault(h)
            out.append(
                Counterfactual(
                    f"does step {self.root} still fail with its recent learning rate {typical:.3g} instead of {lr[1]:.3g}?",
                    bool(found),
                    f"with lr {typical:.3g}: loss {h.loss:.6g}, update ratio {h.update_ratio_global or 0:.3g}"
                    + (f" -> still {', '.join(found)}" if found else " -> no fault: the learning rate is the cause"),
                )
            )
        older = [c for c in self.inv.run.checkpoints if c < self.root]
        if older and samples:
            c = older[0] if older[-1] == self.root else older[-1]
            if c == self.start and len(older) > 1:
                c = older[-2]
            t = self.r.build()
            self.r.load_checkpoint(t, c)
            h = self.r.run_step(t, self.rec)
            self.r.close(t)
            found = self.fault(h)
            out.append(
                Counterfactual(
                    f"does the same batch fail from the older model state at step {c}?",
                    bool(found),
                    f"from checkpoint {c}: loss {h.loss:.6g}, grad norm {h.grad_norm:.4g}"
                    + (" -> fails too: the data alone triggers it" if found else " -> no fault: it needs this model state as well as this data"),
                )
            )
        return out


# --- verdict ------------------------------------------------------------------------------------------

def verdict(r: ReplayReport) -> str:
    if not r.fault_recorded and r.root_step is None:
        return f"Step {r.requested_step} was healthy when recorded and when replayed from checkpoint {r.start_checkpoint}: nothing to explain."
    if not r.reproduced:
        rec = r.steps[-1].recorded_loss if r.steps else None
        got = r.steps[-1].loss if r.steps else None
        where = (
            f"replay matched the record bit for bit until step {r.first_divergence['step'] - 1} and diverged at step {r.first_divergence['step']}"
            if r.first_divergence
            else f"every replayed step before it matched the record bit for bit"
        )
        return (
            f"The fault did not reproduce: replaying step {r.requested_step} from checkpoint {r.start_checkpoint} gives loss "
            f"{_fmt(got)} (recorded {_fmt(rec)}); {where}. Suspect a transient fault: state changed outside the recorded "
            "computation (hardware/memory error, non-determinism, or code outside step_fn)."
        )
    o = r.origin
    root = r.root_step
    lead = f"Step {root}" + (f" on rank {r.rank}" if r.rank is not None else "") + (f" (the symptom shows at step {r.requested_step})" if root != r.requested_step else "")
    who = ", ".join(f"row {s.row} (sample {s.sample_id})" for s in r.samples[:3])
    more = f" and {len(r.samples) - 3} more" if len(r.samples) > 3 else ""
    at = ""
    if o.module is not None:
        at = f" in `{o.module or '<root>'}`" + (f" ({o.source})" if o.source else "")
    if o.kind == "data" and o.module is None and o.op is None and r.samples and "non-finite" in r.samples[0].reason:
        s = f"{lead}: the batch itself carries non-finite values: {who}{more}."
    elif o.kind == "data" and o.op is not None:
        s = f"{lead}: {who}{more} carries absurd values that make {o.op}{at} overflow."
    elif o.kind == "data":
        why = r.samples[0].reason if r.samples else ""
        what = "carries an absurd value" if "typical" in why else "dominates the update"
        s = (f"{lead}: {who}{more} {what} ({why.split(';')[0]}), so the gradients explode"
             + (f" (worst: `{o.parameter}`)" if o.parameter else "")
             + (f" and the weights go non-finite at step {r.requested_step}" if root != r.requested_step else "") + ".")
    elif o.kind == "numeric" and o.op is not None:
        inputs = "finite inputs" if o.inputs_finite else "NaN-free inputs"
        fact = next((x for x in (r.samples[0].reason.split("; ")[0],) if r.samples and ("is empty" in x or "outside [" in x)), None)
        if fact:
            s0 = r.samples[0]
            s = f"{lead}: row {s0.row} (sample {s0.sample_id}) {fact.split(' ', 1)[1]}; {o.op}{at} produced {o.produced} from {inputs} on it."
        else:
            rows = f" for {who}{more}" if r.samples else ""
            s = f"{lead}: {o.op}{at} produced {o.produced} from {inputs}{rows}."
    elif o.kind == "optimizer":
        s = f"{lead}: the optimizer update blew the weights up ({o.detail})" + (f", worst in `{o.parameter}`" if o.parameter else "") + "; no sample is to blame."
    elif o.kind == "numeric":
        s = f"{lead}: gradients exploded" + (f" (worst: `{o.parameter}`)" if o.parameter else "") + " with no single sample to blame."
    else:
        s = f"{lead}: the fault reproduced but no cause was found."
    if r.samples and r.counterfactuals and r.counterfactuals[0].fault is False:
        s += " Without those rows the step is healthy: skip them and resume from a checkpoint before it."
    if not r.deterministic:
        s += f" Note: replay diverged from the record at step {r.first_divergence['step']}."
    return s


# --- attribution for other commands (dirty) ------------------------------------------------------------

def attribute_rows(run: Run | str | Path, step: int, *, device: str | None = None, rank: int = 0) -> list[SampleBlame]:
    """Per-row loss and gradient norm of one recorded step, replayed from the state it started
    in; rows ranked by gradient norm (the row that dominates the update first). For a
    distributed run, rank `rank`'s micro-batch, replayed in this one process (approximate)."""
    run = open_run(run) if not isinstance(run, Run) else run
    saved = capture_env()
    try:
        with _solo_world(run.world_size > 1):
            return _attribute_rows(run, step, device, rank)
    finally:
        apply_env(saved)


def _attribute_rows(run: Run, step: int, device, rank: int) -> list[SampleBlame]:
    inv = _Investigation(run, step, device=device, from_step=None, log=None, rank=rank)
    k = inv.choose_start(step)
    b = _Blame(inv, step, inv.state_before(k, step), inv.detectors(step), k)
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


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return False
    if math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _absdiff(a, b) -> float | None:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return None
    return abs(a - b)


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.6g}"


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


def _leaves(obj, path: str = ""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        fields = getattr(type(obj), "_fields", None)
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{path}.{fields[i]}" if fields else f"{path}[{i}]")
    else:
        yield path, obj


def _batch_rows(batch, ids) -> int | None:
    if ids is not None:
        return len(ids)
    dims = [leaf.shape[0] for _, leaf in _leaves(batch) if isinstance(leaf, (torch.Tensor, np.ndarray)) and leaf.ndim]
    return max(set(dims), key=dims.count) if dims else None


def _select_rows(obj, rows: list[int], n: int):
    """The batch restricted to `rows` (every leaf whose first dimension is the batch's)."""
    if isinstance(obj, torch.Tensor):
        return obj[rows] if obj.dim() and obj.shape[0] == n else obj
    if isinstance(obj, np.ndarray):
        return obj[rows] if obj.ndim and obj.shape[0] == n else obj
    if isinstance(obj, dict):
        return {k: _select_rows(v, rows, n) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
        return type(obj)(*[_select_rows(v, rows, n) for v in obj])
    if isinstance(obj, (list, tuple)):
        if len(obj) == n and not any(isinstance(v, (torch.Tensor, np.ndarray, dict, list, tuple)) for v in obj):
            return type(obj)(obj[i] for i in rows)  # a per-row list (e.g. texts)
        return type(obj)(_select_rows(v, rows, n) for v in obj)
    return obj


def _typical_row_absmax(run: Run, step: int, max_batches: int = 32) -> dict[str, float]:
    """Median per-row max |value| per float field, over retained batches near `step`."""
    steps = [s for s in run.steps if s != step]
    steps = sorted(steps, key=lambda s: abs(s - step))[:max_batches]
    per_field: dict[str, list[float]] = {}
    for s in steps:
        try:
            batch, _ = run.batch(s)
        except CkptlabError:
            continue
        for path, leaf in _leaves(batch):
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dim() and leaf.numel():
                flat = leaf.detach().reshape(leaf.shape[0], -1).float()
                finite = torch.where(torch.isfinite(flat), flat.abs(), torch.zeros_like(flat))
                per_field.setdefault(path, []).extend(finite.max(dim=1).values.tolist())
    return {k: float(np.median(v)) for k, v in per_field.items() if v}


def _dominant_rows(rows: dict[int, StepHealth]) -> dict[int, float]:
    if len(rows) < 2:
        return {}
    norms = {r: h.grad_norm for r, h in rows.items()}
    finite = [v for v in norms.values() if math.isfinite(v)]
    med = float(np.median(finite)) if finite else 0.0
    out = {}
    for r, v in norms.items():
        if not math.isfinite(v) or (med > 0 and v > DOMINANT_ROW_RATIO * med):
            out[r] = v / med if med > 0 and math.isfinite(v) else math.inf
    return out if len(out) < len(rows) / 2 else {}


def _lr_jump(m, root: int, h: StepHealth) -> tuple[float, float] | None:
    hist = m.window(max(0, root - 32), root - 1)
    if hist.stop <= hist.start or not h.lr:
        return None
    typical = float(np.nanmedian(m.lr[hist, 0]))
    lr = float(h.lr[0])
    if typical > 0 and lr > 10 * typical:
        return lr / typical, lr
    return None


def _event_json(e: OpEvent) -> dict:
    return {
        "phase": e.phase,
        "module": e.module,
        "op": e.op,
        "call": e.call,
        "source": e.source,
        "inputs": [s.describe() for s in e.inputs[:4]],
        "outputs": [s.describe() for s in e.outputs[:2]],
        "rows": sorted((e.bad_rows or {}).keys())[:16],
    }
