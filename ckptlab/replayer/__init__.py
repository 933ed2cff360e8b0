"""Replay: rebuild, restore, re-run the recorded steps bit-exactly, and explain the fault.

    report = ckptlab.replay("runs/exp1", 5432)
    report.root_step, report.origin.module, report.samples[0].sample_id, report.verdict

What happens, in order:
1. pick the start: the latest checkpoint at or before the first recorded anomaly of the fault's
   episode (a checkpoint written at or after the fault never starts its replay), in the same
   session, with every batch up to the requested step still retained (investigation.py);
2. rebuild with the recorded `build_fn`, restore every state that changes bits (model,
   optimizer, scheduler, RNGs, thread count, determinism flags, default dtype) (driver.py);
3. re-run the recorded steps through the recorded `step_fn` with the recorded batches, checking
   every loss and grad norm against the record bit for bit, and watching for the root step:
   the first non-finite loss/gradient/weight, loss or grad-norm spike, or exploding update
   (the rule is analysis/anomalies.py, shared with the Recorder);
4-6. blame.py, stage by stage over the root step (rootstep.py), from an in-memory snapshot of
   the state it started in: trace it per op (trace.py); blame batch rows (rows.py: non-finite
   or absurd values, per-row loss and gradient norm) and parameters (parameters.py:
   non-finite or exploding gradients, weights, update ratios against their recorded typical
   values); find the origin (origin.py: the op, the rows its bad elements map to); prove it by
   counterfactual replay (counterfactuals.py: the root step without the blamed rows; the same
   batch from an older model state; the recent learning rate); search deeper within a budget
   (search.py: the minimal culprit, the earlier cause);
7. say it in one sentence (verdict.py's `verdict`), or say honestly that the fault did not
   reproduce.

A distributed run is replayed on its recorded world size (distributed.py). The gradients of
the step that starts at a checkpoint (for `ckptlab export`) come from gradients.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from ckptlab.errors import ReplayError
from ckptlab.replayer.distributed import replay_distributed
from ckptlab.replayer.findings import (
    Counterfactual,
    Culprit,
    DivergenceCheck,
    DumpInfo,
    EarlierCause,
    Origin,
    ParameterBlame,
    ReplayReport,
    SampleBlame,
    StepCheck,
)
from ckptlab.replayer.fold import replay_folded
from ckptlab.replayer.investigation import Investigation
from ckptlab.replayer.rootstep import RootStep
from ckptlab.replayer.rows import per_row
from ckptlab.replayer.search import DEFAULT_BUDGET, Budget
from ckptlab.run.reader import Run, open_run
from ckptlab.training.state import process_kept
from ckptlab.training.world import solo_world

if TYPE_CHECKING:
    from ckptlab.replayer.dump import DumpRequest

__all__ = [
    "Counterfactual",
    "Culprit",
    "DivergenceCheck",
    "DumpInfo",
    "EarlierCause",
    "Origin",
    "ParameterBlame",
    "ReplayReport",
    "SampleBlame",
    "StepCheck",
    "attribute_rows",
    "replay",
]


class _Settings(TypedDict):
    """Both replays' settings: a replay passes them on alike to one process and to a distributed replay."""

    device: str | None
    from_step: int | None
    log: Callable[[str], None] | None
    trust_code: bool


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
    trust_code: bool = False,
    budget: int = DEFAULT_BUDGET,
    dump: DumpRequest | str | Path | None = None,
    world_size: int | None = None,
    profile: bool | str | Path = False,
) -> ReplayReport:
    """Replay `step` of `run` and explain it. See the module docstring.

    A distributed run replays on as many processes as it was recorded with (`nproc`, if
    given, must say the same); `rank=R` instead replays rank R's micro-batches in this one
    process: a quick look, not bit-exact (the other ranks' gradients are missing).
    `world_size=1` replays a DDP run of any size in this one process, every rank's
    micro-batches in turn and their gradients averaged as the recorded world's were (fold.py).
    `log(message)` hears what replay is doing; `progress(done, total)` counts replayed steps.
    `budget` caps the extra replays of the deeper searches (the minimal culprit, the
    transplant, the earlier step that doomed the root step); 0 skips them.
    The recorded build_fn/step_fn run only when they are your own code, unchanged since
    recording; `trust_code=True` (or CKPTLAB_TRUST_RUN_CODE=1) runs them anyway.
    `dump="f.h5"` (or `dump.DumpRequest(path, select=..., max_bytes=..., force=...)`) also
    writes the root step's tensors to an HDF5 file (dump.py; docs/replay.md, "The dump
    file"); `report.dump` says what it holds. `profile=True` (or the path of a new file for
    its Chrome trace) then replays the step timed and under torch.profiler: `report.profile`
    says where its time goes and whether its slowness came back (profile.py)."""
    run = open_run(run) if not isinstance(run, Run) else run
    dump = _dump_request(dump) if dump is not None else None
    how: _Settings = {"device": device, "from_step": from_step, "log": log, "trust_code": trust_code}
    trace_path = _profile_target(run, step, profile, rank, world_size) if profile else None
    try:
        with process_kept():  # (the settings, and torch's functions an engine replaced)
            folded = world_size is not None and world_size != run.world_size
            if (run.world_size > 1 or folded) and rank is None:
                return _on_processes(run, step, dump, world_size, trace, counterfactuals, nproc, budget, progress, how)
            if folded:
                raise ReplayError(f"--world-size {world_size} and --rank {rank}: give one of them", path=run.path)
            if rank is not None:
                _one_rank(run, rank)
            with solo_world(run.needs_process_group):
                inv = Investigation(run, step, rank=rank or 0, dump=dump, **how)
                inv.budget = Budget(budget)
                if progress is not None:
                    inv.progress = progress
                if run.world_size > 1:
                    inv.replayer.notes.append(_one_rank_note(run, rank or 0))
                return _profile(inv, inv.investigate(trace=trace, counterfactuals=counterfactuals), trace_path)
    finally:
        run.release()  # what the replay held against a live run's retention


def _on_processes(run: Run, step: int, dump, world_size, trace, counterfactuals, nproc, budget, progress, how):
    """A distributed run replayed on its recorded processes (distributed.py), or on fewer
    (`world_size`: fold.py)."""
    if dump is not None:
        raise ReplayError(
            "--dump is not available for a distributed replay yet",
            path=run.path,
            hint="dump one rank's micro-batches with --rank R",
        )
    if world_size is not None and world_size != run.world_size:
        if nproc is not None:
            raise ReplayError(f"--nproc {nproc} and --world-size {world_size}: give one of them", path=run.path)
        return replay_folded(
            run, step, world_size, trace=trace, counterfactuals=counterfactuals, budget=budget, progress=progress, **how
        )
    return replay_distributed(
        run, step, trace=trace, counterfactuals=counterfactuals, nproc=nproc, budget=budget, **how
    )


def _one_rank_note(run: Run, rank: int) -> str:
    """What a replay of one rank in one process is: without the other ranks' gradients, and
    under tensor parallelism with the model whole instead of in TP's shards."""
    data_ranks = run.manifest.get("data_ranks")
    if not data_ranks:
        return (
            f"single-process replay of rank {rank}'s micro-batches out of {run.world_size}: "
            "an approximation (the other ranks' gradients are missing), not bit-exact"
        )
    n = len(set(data_ranks))
    missing = " and without the other data-parallel ranks' gradients" if n > 1 else ""
    return (
        f"single-process replay of rank {rank}'s micro-batches (data-parallel rank {data_ranks[rank]} of {n}): "
        f"an approximation, with the model whole instead of in tensor-parallel shards{missing}, not bit-exact"
    )


def _profile_target(run: Run, step: int, profile: bool | str | Path, rank, world_size) -> Path:
    """Where the Chrome trace goes: the path given (refused now, before the replay, when it
    exists), else a new `profiles/step-N.json` in the run (run/layout.py). A replay on several
    processes is refused: the profile replays the step in this one."""
    from ckptlab.replayer.profile import check_profile_target
    from ckptlab.run.layout import profile_trace

    if (run.world_size > 1 or world_size not in (None, run.world_size)) and rank is None:
        raise ReplayError(
            "--profile replays the step in this one process: not a replay on several processes yet",
            path=run.path,
            hint="profile one rank's micro-batches in this process with --rank R",
        )
    if isinstance(profile, bool):
        return profile_trace(run.path, step)
    path = Path(profile)
    check_profile_target(path)
    return path


def _profile(inv: Investigation, report: ReplayReport, trace_path: Path | None) -> ReplayReport:
    """The report with its `profile` (profile.py) when asked for (`trace_path`); the user's
    step raising under it is a failed experiment."""
    from ckptlab.replayer.profile import profile_step

    if trace_path is None:
        return report
    from ckptlab.training.crash import describe, is_step_error

    t0 = time.perf_counter()
    try:
        report.profile = profile_step(inv, trace_path)
    except Exception as e:
        if not is_step_error(e):
            raise
        d = describe(e, None)
        report.failed_experiments.append({"experiment": "profile", "error": d["error"], "source": d.get("source")})
    report.timing["profile_s"] = time.perf_counter() - t0
    return report


def _dump_request(dump: DumpRequest | str | Path) -> DumpRequest:
    """The dump asked for, its target checked before minutes of replay, not after. Imported
    only when asked: the plain replay does not load h5py."""
    from ckptlab.replayer.dump import DumpRequest
    from ckptlab.run.dumpfile import check_target

    dump = dump if isinstance(dump, DumpRequest) else DumpRequest(Path(dump))
    check_target(Path(dump.path), dump.force)
    return dump


def attribute_rows(
    run: Run | str | Path, step: int, *, device: str | None = None, rank: int = 0, trust_code: bool = False
) -> list[SampleBlame]:
    """Per-row loss and gradient norm of one recorded step, replayed from the state it started
    in; rows ranked by gradient norm (the row that dominates the update first). For a
    distributed run, rank `rank`'s micro-batch, replayed in this one process (approximate).
    This is the attribution `ckptlab dirty` passes to `analysis.dirty.scan`."""
    run = open_run(run) if not isinstance(run, Run) else run
    alone_refused(run, "per-row attribution")
    try:
        with process_kept():  # (the settings, and torch's functions an engine replaced)
            with solo_world(run.needs_process_group):
                inv = Investigation(
                    run, step, device=device, from_step=None, log=None, rank=rank, trust_code=trust_code
                )
                root = RootStep(inv, inv.root_at(step))
                try:
                    rows = per_row(root)  # (the user's code refusing one row raises: dirty lists it as failed)
                finally:
                    root.close()
    finally:
        run.release()
    ranked = sorted(rows.items(), key=lambda rh: -(rh[1].grad_norm if math.isfinite(rh[1].grad_norm) else math.inf))
    return [SampleBlame(r, root.sample_id(r), "per-row replay", h.loss, h.grad_norm) for r, h in ranked]


def _one_rank(run: Run, rank: int) -> None:
    """ReplayError unless rank `rank` of `run` can be replayed alone, in this process."""
    if not 0 <= rank < run.world_size:
        raise ReplayError(f"rank {rank} is not in the run (world size {run.world_size})", path=run.path)
    alone_refused(run, f"--rank {rank}")


def alone_refused(run: Run, what: str) -> None:
    """ReplayError for replaying one rank of a pipeline in one process (`what`: the option or
    command that asks for it): a stage sends to and receives from the others at every step."""
    if run.manifest.get("pipeline") is not None:
        raise ReplayError(
            f"{what} replays one rank in this process, and a pipeline stage cannot run alone: it sends its "
            "activations to the next stage and receives its gradients from it at every step",
            path=run.path,
            hint=f"replay on the recorded {run.world_size} processes: ckptlab replay --run {run.path} --step N",
        )
