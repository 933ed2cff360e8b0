"""Distributed replay: one process per recorded rank, then the blame in this process.

The run is replayed on its recorded world size (gloo on the CPU, NCCL on GPUs), every rank with
its own batches and RNG states, every rank's loss checked bit for bit. The rank at fault is the
one whose own loss, then own gradient norm, went wrong first at the root step; the state the
root step started in comes back from the workers, and the trace, row blame and counterfactuals
run here, in a process group of one, on that rank's micro-batch.
"""

from __future__ import annotations

import math
import time
from datetime import timedelta
from pathlib import Path
from typing import cast

import numpy as np
import torch

from ckptlab.errors import ReplayError
from ckptlab.replayer.findings import ReplayReport, StepCheck
from ckptlab.replayer.investigation import Investigation, Window
from ckptlab.replayer.search import DEFAULT_BUDGET, Budget
from ckptlab.run.checkpoint import commit_checkpoint, load_captured
from ckptlab.run.layout import checkpoint_dir
from ckptlab.run.reader import Run, open_run
from ckptlab.training.world import World, solo_world


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
) -> ReplayReport:
    """Replay on the recorded world size (one process per rank, gloo on the CPU, NCCL on GPUs),
    then explain the root step in this process, on the rank whose batch brought the fault."""
    import tempfile

    world = run.world_size
    if nproc is not None and nproc != world:
        raise ReplayError(f"the run was recorded on {world} processes; --nproc {nproc} does not match", path=run.path)
    log = log or (lambda msg: None)
    with solo_world(True):
        plan = Investigation(run, step, device=device, from_step=from_step, log=log, trust_code=trust_code).plan()
    k = plan.start
    for r in range(1, world):
        missing = sorted(set(range(k, step + 1)) - set(run.steps_of(r)))
        if missing:
            raise ReplayError(
                f"rank {r} has no batches for steps {missing[0]}..{missing[-1]} (a rank that died early?)",
                path=run.path,
            )
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ckptlab-replay-") as tmp:
        result, snapshot = _replay_on_ranks(run, step, plan, Path(tmp), device, log, trust_code)
    checks = [StepCheck(**c) for c in result["checks"]]
    root, faulty = result["root"], result["rank"]
    with solo_world(True):
        inv = Investigation(run, step, device=device, from_step=k, log=log, rank=faulty or 0, trust_code=trust_code)
        inv.timing["replay_s"] = time.perf_counter() - t0
        inv.replayer.notes.extend(result["notes"])
        inv.budget = Budget(budget)
        window = Window(k, checks, root)
        if root is not None:
            window.root_state = snapshot
            window.root_detectors = inv.detectors(root)
        return inv.report(plan, window, trace=trace, counterfactuals=counterfactuals, rank=faulty)


def _replay_on_ranks(run: Run, step: int, plan, out: Path, device, log, trust_code: bool) -> tuple[dict, object]:
    """Spawn one process per rank to replay plan.start..step; their result and the state the
    root step started in (read back into memory before `out` goes away)."""
    import json

    import torch.multiprocessing as mp
    from torch.distributed import TCPStore

    world, k = run.world_size, plan.start
    # The rendezvous store is served from here, on a port the OS picks and that stays bound
    # until the ranks are done: a port found free and let go before the ranks bind it can be
    # taken by another process in between (seen as a rare failed replay on a busy machine).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=5))
    backend = "nccl" if (device or str(run.manifest.get("device", "cpu"))).startswith("cuda") else "gloo"
    log(f"replaying steps {k}..{step} on {world} processes ({backend})")
    try:
        mp.start_processes(
            _rank_worker,
            args=(
                world,
                store.port,
                backend,
                str(run.path),
                step,
                k,
                max(k, plan.episode - 2),
                str(out),
                device,
                trust_code,
            ),
            nprocs=world,
            start_method="spawn",
        )
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        # A step raised on a rank: the others were stopped, not left waiting. The first to
        # raise is the cause; a rank whose collective then lost its peer raised after it.
        crashed = [json.loads(p.read_text()) for p in out.glob("crash-rank*.json")]
        if crashed:
            raise _crash_error(run, min(crashed, key=lambda c: (c["time"], c["rank"]))) from None
        last = str(e).strip().splitlines()[-1]
        if len(list(out.glob("done-rank*"))) < world:
            raise ReplayError(f"a replay process failed: {last}", path=run.path) from None
        # Every rank had finished its work and passed the last barrier: a rank that died while
        # tearing the process group down (gloo can abort there on a busy machine) lost nothing.
        log(f"a replay process ended abnormally after its work was done ({last}); its results are complete")
    finally:
        del store
    result = json.loads((out / "result.json").read_text())
    root = result["root"]
    snapshot = load_captured(checkpoint_dir(out / "snapshot", root)) if root is not None else None
    return result, snapshot


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
) -> None:
    """One rank of a distributed replay (a spawned process)."""
    import json
    import os

    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    if backend == "nccl":
        torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(minutes=5))  # served by the parent
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    try:
        run = open_run(run_path)
        inv = Investigation(run, step, device=device, from_step=k, log=None, rank=rank, trust_code=trust_code)
        window = inv.replay_window(k, snap_from)
        if window.crash is not None:
            # The step raised here: the other ranks are (or will be) waiting for this one in the
            # step's collectives, so no rank may go on. Say what happened and stop: the parent
            # stops the others and reports it.
            crash = {"rank": rank, "time": time.time(), **window.crash}
            (Path(out) / f"crash-rank{rank}.json").write_text(json.dumps(crash))
            raise ReplayError(f"step {window.crash['step']} raised on rank {rank}")
        checks, root = window.checks, window.root
        # Decided on what every rank knows alike (sharded snapshots live on rank 0 only, so
        # "no snapshot kept" differs by rank): a root before `snap_from` was not kept, and
        # every rank replays up to it again (collective).
        if root is not None and root < snap_from:
            window.root_state = inv.state_before(k, root)
        faulty = _faulty_rank(checks, root)
        writer = 0 if cast(World, inv.replayer.world).sharded else faulty  # sharded: whole state on rank 0, all RNGs
        if root is not None and rank == writer:
            # The state the root step started in, with the faulty rank's RNG streams.
            commit_checkpoint(Path(out) / "snapshot", window.root_state)
        if rank == 0:
            _write_result(Path(out), checks, root, faulty, inv.replayer.notes)
        dist.barrier()
        (Path(out) / f"done-rank{rank}").write_text("")  # every rank's work is in `out` by now
    finally:
        dist.destroy_process_group()


def _write_result(out: Path, checks, root, faulty, notes) -> None:
    import dataclasses
    import json

    doc = {"checks": [dataclasses.asdict(c) for c in checks], "root": root, "rank": faulty, "notes": notes}
    (out / "result.json").write_text(json.dumps(doc))


def _crash_error(run: Run, crash: dict) -> ReplayError:
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
