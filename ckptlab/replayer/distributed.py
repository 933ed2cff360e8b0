"""Distributed replay: one process per recorded rank, then the blame in this process.

The run is replayed on its recorded world size (gloo on the CPU, NCCL on GPUs), every rank with
its own batches and RNG states, every rank's loss checked bit for bit. The rank at fault is the
one whose own loss, then own gradient norm, went wrong first at the root step; the state the
root step started in comes back from the workers, and the trace, row blame and counterfactuals
run here, in a process group of one, on that rank's micro-batch.

A pipeline's stages (one per rank) cannot run in one process: its root step is explained on the
ranks themselves, rank 0 leading the others (pipeline.py), and rank 0's report comes back.

Two ways to get the ranks, one per-rank replay (`replay_rank`) for both:
- started here: this process starts one worker per rank on this machine (workers.py) and serves
  their store;
- launched: this process is itself one rank of a job a launcher started (`torchrun -m ckptlab
  replay ...` on each node, under Slurm say): each process replays its own rank in the job's
  group, rank 0 explains the root step, and the others get its report through the job's store.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from ckptlab.errors import ReplayError
from ckptlab.replayer.findings import ReplayReport, StepCheck
from ckptlab.replayer.investigation import Investigation, Window
from ckptlab.replayer.pipeline import StageBlame, explain_on_stages
from ckptlab.replayer.search import DEFAULT_BUDGET, Budget
from ckptlab.replayer.turns import Fold
from ckptlab.run.atomic import write_json_atomic
from ckptlab.run.checkpoint import CapturedState, commit_checkpoint, load_captured
from ckptlab.run.layout import checkpoint_dir
from ckptlab.run.reader import Run, open_run
from ckptlab.training.world import Launch, World, launched, solo_world


def replay_distributed(
    run: Run,
    step: int,
    *,
    device,
    from_step,
    trace,
    counterfactuals,
    log,
    nproc,
    trust_code: bool = False,
    budget: int = DEFAULT_BUDGET,
    fold: int | None = None,
) -> ReplayReport:
    """Replay on the recorded world size (one process per rank, gloo on the CPU, NCCL on GPUs),
    then explain the root step in this process, on the rank whose batch brought the fault.
    `fold`: on that many processes instead, each taking its share of the ranks' turns (fold.py).

    In a process that a launcher started (torchrun: `launched()`), the job's processes are the
    ranks: each replays its own, and rank 0 explains the root step; every rank returns its
    report."""
    import tempfile

    launch = launched()
    if launch is not None and launch.size == 1:  # a job of one process spawns the ranks, as outside one
        launch = None
    if fold is not None and launch is not None and launch.size != fold:
        raise ReplayError(
            f"--world-size {fold}: this job has {launch.size} processes (WORLD_SIZE)",
            path=run.path,
            hint=f"launch {fold} processes in all, or replay without a launcher: ckptlab spawns them",
        )
    if fold is None:
        check_world(run, nproc, launch)
    log = log or (lambda msg: None)
    with solo_world(True):
        plan = Investigation(run, step, device=device, from_step=from_step, log=log, trust_code=trust_code).plan()
    _check_batches(run, plan.start, step)
    t0 = time.perf_counter()
    explain = Explain(run, step, plan, t0, device, log, trust_code, budget, trace, counterfactuals)
    if fold is not None:
        explain.folded = (fold, run.world_size)
    if launch is not None:
        return _replay_joined(run, step, plan, launch, explain, fold)
    with tempfile.TemporaryDirectory(prefix="ckptlab-replay-") as tmp:
        ranks = _replay_on_ranks(run, step, plan, Path(tmp), device, log, trust_code, explain.on_stages(), fold)
    return ranks.report if ranks.report is not None else explain(ranks)


def check_world(run: Run, nproc: int | None, launch: Launch | None) -> None:
    """The replay's world is the recorded one: --nproc, and the launched job's size."""
    world = run.world_size
    if nproc is not None and nproc != world:
        raise ReplayError(f"the run was recorded on {world} processes; --nproc {nproc} does not match", path=run.path)
    if launch is not None and launch.size != world:
        raise ReplayError(
            f"the run was recorded on {world} processes, and this job has {launch.size} (WORLD_SIZE)",
            path=run.path,
            hint=f"launch {world} processes in all (e.g. torchrun --nnodes=N --nproc_per_node={world}/N), "
            "or replay without a launcher: ckptlab spawns them",
        )


def _check_batches(run: Run, k: int, step: int) -> None:
    for r in range(1, run.world_size):
        missing = sorted(set(range(k, step + 1)) - set(run.steps_of(r)))
        if missing:
            raise ReplayError(
                f"rank {r} has no batches for steps {missing[0]}..{missing[-1]} (a rank that died early?)",
                path=run.path,
            )


@dataclass
class Ranks:
    """What the ranks' replay found, as every rank knows it alike (the checks hold every rank's
    gathered loss and gradient norm), and the state the root step started in."""

    checks: list[StepCheck]
    root: int | None
    faulty: int | None  # the rank whose batch brought the fault
    notes: list[str]  # rank 0's
    snapshot: Any = None  # the root step's starting state: on the writer rank, then where it is explained
    writer: int = 0  # the rank that holds `snapshot` (sharded: rank 0, gathered whole; else the faulty rank)
    crash: dict | None = None  # the step raised on this rank (the replay cannot go on)
    report: ReplayReport | None = None  # a pipeline's, explained on the ranks: rank 0's (pipeline.py)


@dataclass
class Explain:
    """The root step explained in this process, in a process group of one, on the faulty
    rank's micro-batch, from the state the ranks' replay kept: the last part of both paths."""

    run: Run
    step: int
    plan: Any
    t0: float
    device: Any
    log: Any
    trust_code: bool
    budget: int
    trace: bool
    counterfactuals: bool
    folded: tuple[int, int] | None = None  # replayed on K processes of the recorded W (fold.py): (K, W)

    def on_stages(self) -> StageBlame | None:
        """What a pipeline's ranks need to explain its root step themselves (None: not a pipeline)."""
        if self.run.manifest.get("pipeline") is None:
            return None
        plan = (self.plan.fault_recorded, self.plan.episode, self.plan.start)
        return StageBlame(plan, self.trace, self.counterfactuals, self.budget)

    def __call__(self, ranks: Ranks) -> ReplayReport:
        run, k = self.run, self.plan.start
        with solo_world(True):
            inv = Investigation(
                run, self.step, device=self.device, from_step=k, log=self.log, rank=ranks.faulty or 0,
                trust_code=self.trust_code,
            )  # fmt: skip
            inv.timing["replay_s"] = time.perf_counter() - self.t0
            inv.replayer.notes.extend(ranks.notes)
            inv.folded = self.folded
            inv.budget = Budget(self.budget)
            window = Window(k, ranks.checks, ranks.root, crash=ranks.crash)  # (a crash: a fold's, explained)
            if ranks.root is not None:
                window.root_state = ranks.snapshot
                window.root_detectors = inv.detectors(ranks.root)
            report = inv.report(
                self.plan, window, trace=self.trace, counterfactuals=self.counterfactuals, rank=ranks.faulty
            )
        if self.folded is not None:
            report.world_size = self.folded[0]
        return report


def _replay_on_ranks(run: Run, step: int, plan, out: Path, device, log, trust_code: bool, blame, fold=None) -> Ranks:
    """Spawn one process per rank to replay plan.start..step; what they found, with the state
    the root step started in (read back into memory before `out` goes away), or a pipeline's
    report (`blame`: what its ranks explain it with)."""
    import json
    import pickle

    import torch.multiprocessing as mp
    from torch.distributed import TCPStore

    from ckptlab.replayer.workers import run_ranks

    world, k = fold or run.world_size, plan.start
    # The rendezvous store is served from here, on a port the OS picks and that stays bound
    # until the ranks are done: a port found free and let go before the ranks bind it can be
    # taken by another process in between (seen as a rare failed replay on a busy machine).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=5))
    backend = backend_for(run, device)
    log(f"replaying steps {k}..{step} on {world} processes ({backend})")
    args = (
        world,
        store.port,
        backend,
        str(run.path),
        step,
        k,
        snap_from(plan),
        str(out),
        device,
        trust_code,
        blame,
        fold,
    )
    try:
        try:
            run_ranks(_rank_worker, args, world)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            # A step raised on a rank: the others were stopped, not left waiting. The first to
            # raise is the cause; a rank whose collective then lost its peer raised after it.
            crashed = [json.loads(p.read_text()) for p in out.glob("crash-rank*.json")]
            if crashed:
                raise crash_error(run, min(crashed, key=lambda c: (c["time"], c["rank"]))) from None
            last = str(e).strip().splitlines()[-1]
            if len(list(out.glob("done-rank*"))) < world:
                raise ReplayError(f"a replay process failed: {last}", path=run.path) from None
            # Every rank had finished its work and passed the last barrier: a rank that died while
            # tearing the process group down (gloo can abort there on a busy machine) lost nothing.
            log(f"a replay process ended abnormally after its work was done ({last}); its results are complete")
        # (a pipeline's report: rank 0's, pickled by the replay's own worker into this process's store)
        report = pickle.loads(store.get("report")) if blame is not None else None
    finally:
        del store
    result = json.loads((out / "result.json").read_text())
    if report is not None:
        return Ranks([], result["root"], result["rank"], result["notes"], report=report)
    root = result["root"]
    snapshot = load_captured(checkpoint_dir(out / "snapshot", root)) if root is not None else None
    return Ranks([StepCheck(**c) for c in result["checks"]], root, result["rank"], result["notes"], snapshot)


def backend_for(run: Run, device) -> str:
    return "nccl" if (device or str(run.manifest.get("device", "cpu"))).startswith("cuda") else "gloo"


def snap_from(plan) -> int:
    """The first step whose starting state the ranks keep in memory (near the recorded fault)."""
    return max(plan.start, plan.episode - 2)


def replay_rank(
    rank: int, run_path: str, step: int, k: int, snap_from: int, device, trust_code: bool, blame=None, fold=None
) -> Ranks:
    """This rank's part of a distributed replay, in the ranks' process group (collective):
    replay k..step on its own batches, and keep the root step's starting state on the rank
    that writes it; a pipeline's ranks explain its root step here (`blame`: pipeline.py
    StageBlame), and rank 0 holds the report. Both paths run it: a spawned worker, and a
    launched job's process."""
    run = open_run(run_path)
    inv = Investigation(run, step, device=device, from_step=k, log=None, rank=rank, trust_code=trust_code)
    if fold is not None:  # this process runs ranks rank, rank + fold, ... (fold.py)
        inv.replayer.fold = Fold(inv.replayer, run.world_size, fold, rank)
    window = inv.replay_window(k, snap_from)
    if window.crash is not None:
        # The step raised here: the other ranks are (or will be) waiting for this one in the
        # step's collectives, so no rank may go on.
        which = inv.replayer.fold.crashed if fold is not None else rank
        return Ranks(window.checks, window.crash["step"], which, [], crash={"rank": which, **window.crash})
    checks, root = window.checks, window.root
    # Decided on what every rank knows alike (sharded snapshots live on rank 0 only, so
    # "no snapshot kept" differs by rank): a root before `snap_from` was not kept, and
    # every rank replays up to it again (collective).
    if root is not None and root < snap_from:
        window.root_state = inv.state_before(k, root)
    world = cast(World, inv.replayer.world)
    if world.stages is not None:  # a pipeline: no process holds the whole model
        report = explain_on_stages(inv, window, world, blame)
        return Ranks(checks, root, report.rank if report else None, inv.replayer.notes, report=report)
    faulty = _faulty_rank(checks, root)
    writer = 0 if world.gathers_whole or fold else (faulty or 0)  # FSDP2, ZeRO, a fold: on rank 0, all RNGs
    # The state the root step started in, with the faulty rank's RNG streams.
    mine = window.root_state if root is not None and rank == writer else None
    return Ranks(checks, root, faulty, inv.replayer.notes, mine, writer)


def _rank_worker(
    rank: int,
    world: int,
    port: int,
    backend: str,
    run_path: str,
    step: int,
    k: int,
    snap_from: int,
    out: str,
    device,
    trust_code: bool,
    blame,
    fold,
) -> None:
    """One rank of a distributed replay (a process of workers.py's); `fold`: one of that many processes
    that run the recorded ranks' turns (fold.py)."""
    import os
    import pickle

    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    if backend == "nccl":
        torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(minutes=5))  # served by the parent
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    try:
        got = replay_rank(rank, run_path, step, k, snap_from, device, trust_code, blame, fold)
        if got.crash is not None:  # say what happened and stop: the parent stops the others and reports it
            crash = {"time": time.time(), **got.crash}
            # (whole or not at all: the parent reads every crash file as soon as any rank fails,
            # and a peer whose collective lost this rank may be writing its own just then)
            write_json_atomic(Path(out) / f"crash-rank{rank}.json", crash)
            raise ReplayError(f"step {crash['step']} raised on rank {rank}")
        if got.snapshot is not None:
            commit_checkpoint(Path(out) / "snapshot", got.snapshot)
        if got.report is not None:  # (our own report, to the process that started this one)
            store.set("report", pickle.dumps(got.report))  # type: ignore[arg-type]  # (bytes: torch's stub says str)
        if rank == 0:
            _write_result(Path(out), got.checks, got.root, got.faulty, got.notes)
        dist.barrier()
        (Path(out) / f"done-rank{rank}").write_text("")  # every rank's work is in `out` by now
    finally:
        dist.destroy_process_group()


# --- a launched job: its processes are the ranks ------------------------------------------------

REPORT_WAIT = timedelta(hours=6)  # how long the other ranks wait for rank 0 to explain the root step
_REPLAYS = itertools.count()  # this process's launched replays: each its own keys in the job's store


def _replay_joined(
    run: Run, step: int, plan, launch: Launch, explain: Explain, fold: int | None = None
) -> ReplayReport:
    """This process is rank `launch.rank` of a job a launcher started (torchrun on each node):
    join the job's process group, replay this rank (`fold`: the job's processes fold the
    recorded ranks, this one running ranks launch.rank, launch.rank + fold, ...: fold.py),
    hand the root step's starting state to rank 0 (in memory: nodes share no scratch folder),
    and leave the group; rank 0 explains the root step in a group of one, and every rank
    returns its report."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise ReplayError(
            "a replay in a launched job makes its own process group, and one is already initialized",
            path=run.path,
            hint="call ckptlab.replay before init_process_group, or after destroy_process_group",
        )
    backend = backend_for(run, explain.device)
    if backend == "nccl":
        torch.cuda.set_device(launch.local_rank % max(1, torch.cuda.device_count()))
    explain.log(f"replaying steps {plan.start}..{step} as rank {launch.rank} of {launch.size} ({backend})")
    # torchrun's rendezvous store (served by its agent, or by rank 0): the report goes through
    # it once the process group is gone.
    job_store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(minutes=30)))
    store = dist.PrefixStore(f"ckptlab-replay/{next(_REPLAYS)}/", job_store)  # (every rank counts alike)
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=launch.rank, world_size=launch.size)
    try:
        group = dist.new_group(backend="gloo") if backend != "gloo" else None  # for the state's hand-over
        got = replay_rank(
            launch.rank,
            str(run.path),
            step,
            plan.start,
            snap_from(plan),
            explain.device,
            explain.trust_code,
            explain.on_stages(),
            fold,
        )
        if got.crash is not None:
            raise crash_error(run, _first_crash(store, got.crash))
        if explain.on_stages() is None:
            got.snapshot = _state_to_rank0(got, launch.rank, group)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return _shared_report(store, launch, lambda: got.report if got.report is not None else explain(got))


def _first_crash(store, mine: dict) -> dict:
    """The first crash any rank of the job posted (this one's if it was first): every rank
    that stops says the same (a peer's collective fails after the rank that raised)."""
    import json

    posted = store.compare_set("crash", "", json.dumps({"time": time.time(), **mine}))
    return json.loads(posted)


def _state_to_rank0(got: Ranks, rank: int, group) -> Any:
    """The state the root step started in, on rank 0: written and read back by the rank that
    kept it (what the spawned workers hand over), and sent to rank 0 when that is another."""
    import json
    import tempfile

    import safetensors.torch
    import torch.distributed as dist

    if got.root is None:
        return None
    state = None
    if rank == got.writer:
        with tempfile.TemporaryDirectory(prefix="ckptlab-replay-") as tmp:
            commit_checkpoint(Path(tmp), got.snapshot)
            state = load_captured(checkpoint_dir(Path(tmp), got.root))
    if got.writer == 0 or rank not in (0, got.writer):
        return state
    box: list[Any] = [None, None]
    if rank == got.writer:  # as safetensors bytes and JSON (pickled, these tensors do not load back)
        s = cast(CapturedState, state)
        tensors = {**{f"m/{k}": v for k, v in s.model.items()}, **{f"s/{k}": v for k, v in s.state_tensors.items()}}
        box = [safetensors.torch.save(tensors), json.dumps([s.step, s.aliases, s.state_spec])]
        dist.send_object_list(box, dst=0, group=group)
        return None
    dist.recv_object_list(box, src=got.writer, group=group)
    tensors = safetensors.torch.load(box[0])
    step, aliases, spec = json.loads(box[1])
    part = {p: {k[2:]: v for k, v in tensors.items() if k[:2] == p} for p in ("m/", "s/")}
    return CapturedState(step, part["m/"], aliases, spec, part["s/"], {})


def _shared_report(store, launch: Launch, explain_here) -> ReplayReport:
    """Rank 0 explains the root step; the other ranks wait for its report, through the job's
    store (pickled: our own report, from rank 0 of this job), and return it too."""
    import pickle

    if launch.is_main:
        try:
            report = explain_here()
        except BaseException as e:
            store.set("report", pickle.dumps(("error", str(e))))
            raise
        store.set("report", pickle.dumps(("report", report)))
        # The store may be served from this process: it stays up until every rank has read.
        store.wait([f"read{r}" for r in range(1, launch.size)], timedelta(minutes=10))
        return report
    store.set_timeout(REPORT_WAIT)
    kind, value = pickle.loads(store.get("report"))
    store.set(f"read{launch.rank}", b"1")
    if kind == "error":
        raise ReplayError(f"rank 0 could not explain the root step: {value}")
    return value


def _write_result(out: Path, checks, root, faulty, notes) -> None:
    import dataclasses
    import json

    doc = {"checks": [dataclasses.asdict(c) for c in checks], "root": root, "rank": faulty, "notes": notes}
    (out / "result.json").write_text(json.dumps(doc))


def crash_error(run: Run, crash: dict) -> ReplayError:
    """A step that raised on a rank during a distributed replay, as one line that says what,
    where, and how to trace it (on that rank alone, where nothing waits for the others)."""
    where = ", ".join(
        x for x in (crash.get("source"), f"in {crash['call']}" if crash.get("call") else "", _module(crash)) if x
    )
    return ReplayError(
        f"step {crash['step']} raised on rank {crash['rank']} when replayed ({crash['error']}"
        + (f"; {where}" if where else "")
        + "): it reproduces, and the other ranks would wait for it in the step's collectives",
        path=run.path,
        hint=f"trace it on that rank alone: ckptlab replay --run {run.path} --step {crash['step']} --rank {crash['rank']}",
    )


def _module(crash: dict) -> str:
    if "module" not in crash:
        return ""
    return f"module {crash['module'] or '(the model)'}" + (f", {crash['phase']}" if crash.get("phase") else "")


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
