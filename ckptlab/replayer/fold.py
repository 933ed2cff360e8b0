"""A data-parallel step replayed on fewer processes than it trained on: `replay --world-size 1`.

A DDP run of W processes replayed in this one process: each replayed step runs every recorded
rank's micro-batches in turn, through the recorded `step_fn`, with that rank's batch and RNG
streams, from the state the step started in; DDP's gradient all-reduce becomes a running sum,
before rank 0's optimizer step:

    ranks 1 .. W-1   step_fn on the rank's batch; the optimizer's step, the scheduler's and
                     every change to the state undone; DDP's communication hook adds the
                     gradient each bucket would have sent (the rank's own, accumulated over its
                     micro-batches) times 1/W to the sum, and the probe's row of health numbers
                     (what it gathers) is kept
    rank 0           step_fn on rank 0's batch, measured as a replay measures every step; the
                     hook hands DDP the sum plus its own gradient times 1/W, what DDP's
                     all-reduce computes, and the optimizer steps on it; the health gathers
                     the W rows

One copy of the gradients (the sum) beside the model, whatever W.

FSDP2 (`fully_shard`): the model is sharded over the fold's processes and the checkpoint loaded
resharded (DCP); each turn's reduce-scatter runs over them, and FSDP2's all-reduce hook sums
the turns' reduced shards into the mean over the W ranks (turns.py).

The step's health is then what the recorded world's was: each rank's loss and own gradient
norm, their mean, the averaged gradient's norm, and it is checked against the record bit for
bit. Over two processes a sum of two is the same in either order: bit-exact. Over more, gloo's
ring all-reduce starts each chunk's sum at another rank, so the last bits may differ: the
replay judges `equivalent` and says why (`bits_differ`). An FSDP2 fold measures the gradient
norms on the recorded ranks' shards (turns.py `Fold.grad_norms`). The rank at fault and its sample are
found as a full-size replay finds them (distributed.py), and the root step is explained on its
micro-batch as there.

What cannot be folded is refused in one line: at the start, ZeRO, tensor or pipeline
parallelism; once built, FSDP1, a collective inside the model (SyncBatchNorm), a GradScaler,
a hand-written update, an FSDP2 module with several parameter groups, its own all-reduce hook
or a gradient divide factor, DDP's static_graph on several processes; in the first turn, a
step without DDP or FSDP2, DDP that keeps each rank's buffers (`broadcast_buffers=False`),
`gradient_as_bucket_view`, every-micro-batch all-reduces (accumulation without `no_sync`), a
turn that changes the weights outside the optimizer's step, and, under
`find_unused_parameters` or `static_graph` (which learn the unused parameters over the group),
a parameter that no stepping rank's batch used and another's did (turns.py).
"""

from __future__ import annotations

import math
import time

from ckptlab import dtypes
from ckptlab.errors import ReplayError
from ckptlab.io.files import read_text
from ckptlab.numbers import human_bytes
from ckptlab.replayer.distributed import (
    Explain,
    Ranks,
    _check_batches,
    _faulty_rank,
    backend_for,
    replay_distributed,
    snap_from,
)
from ckptlab.replayer.findings import ReplayReport
from ckptlab.replayer.investigation import Investigation
from ckptlab.replayer.search import DEFAULT_BUDGET
from ckptlab.replayer.turns import Fold
from ckptlab.run.layout import MODEL_FILE
from ckptlab.run.reader import Run
from ckptlab.training.world import launched, solo_world


def replay_folded(
    run: Run,
    step: int,
    world_size: int,
    *,
    device,
    from_step,
    trace: bool,
    counterfactuals: bool,
    log,
    trust_code: bool = False,
    budget: int = DEFAULT_BUDGET,
    progress=None,
) -> ReplayReport:
    """Replay `step` of a W-process data-parallel run in this process (`world_size` 1), then
    explain the root step on the rank whose batch brought the fault, as a W-process replay does."""
    refused(run, world_size)
    launch = launched()
    size = launch.size if launch is not None else 1  # (a job of one process spawns, as outside one)
    if size > 1 and world_size == 1:
        raise ReplayError(
            f"--world-size 1 replays in this one process, and this is one of {size} a launcher started",
            path=run.path,
            hint="run it without the launcher (or launch one process)",
        )
    # (under a launcher the job's processes may span machines: the estimate is said, not checked)
    need = process_bytes(run, step) if size > 1 else memory_checked(run, step, world_size, device)
    note = (
        f"replayed on {world_size} process{'es' if world_size > 1 else ''} for the recorded {run.world_size}: "
        "every rank's micro-batches in turn, their gradients averaged before the optimizer's step"
        f" (about {human_bytes(need)} a process before activations: {memory_said(run)})"
    )
    if world_size > 1:  # the ranks shared out among spawned processes, as a replay on the recorded size
        how = {"device": device, "from_step": from_step, "log": log, "trust_code": trust_code}
        report = replay_distributed(
            run, step, trace=trace, counterfactuals=counterfactuals, nproc=None, budget=budget, fold=world_size, **how
        )
        report.notes.insert(0, note)
        return report
    log = log or (lambda msg: None)
    with solo_world(True):
        inv = Investigation(run, step, device=device, from_step=from_step, log=log, trust_code=trust_code)
        if progress is not None:
            inv.progress = progress
        plan = inv.plan()
        _check_batches(run, plan.start, step)
        t0 = time.perf_counter()
        log(f"replaying steps {plan.start}..{step} of {run.world_size} ranks in this process")
        fold = inv.replayer.fold = Fold(inv.replayer, run.world_size)
        inv.replayer.notes.append(note)
        window = inv.replay_window(plan.start, snap_from(plan))
        root = window.root
        faulty = fold.crashed if window.crash is not None else _faulty_rank(window.checks, root)
        if root is not None and window.root_state is None:  # a root before the kept steps: again
            window.root_state = inv.state_before(plan.start, root)
        ranks = Ranks(window.checks, root, faulty, inv.replayer.notes, window.root_state, crash=window.crash)
        del inv, fold, window  # (the replayed runners: explaining builds its own)
    explain = Explain(run, step, plan, t0, device, log, trust_code, budget, trace, counterfactuals)
    explain.folded = (world_size, run.world_size)
    return explain(ranks)


def refused(run: Run, world_size: int) -> None:
    """ReplayError, before anything runs, unless `run` can be replayed on `world_size` processes."""
    world = run.world_size
    hint = f"replay on the recorded {world} processes: leave --world-size out"
    if not 1 <= world_size <= world:
        raise ReplayError(
            f"--world-size {world_size}: the run was recorded on {world} process{'es' if world > 1 else ''}; "
            f"a replay runs on {world} or fewer",
            path=run.path,
            hint=hint if world > 1 else "leave --world-size out",
        )
    if world % world_size:
        raise ReplayError(
            f"--world-size {world_size}: {world} ranks do not fold evenly onto {world_size} processes (each must run "
            "as many ranks' turns, in step with the others' collectives)",
            path=run.path,
            hint=f"give a divisor of {world}: " + ", ".join(str(k) for k in range(1, world) if world % k == 0),
        )
    engine = _engine(run.manifest)
    if engine is not None:
        raise ReplayError(
            f"--world-size {world_size}: the run was recorded with {engine}, whose state is split across the "
            "processes; folding it onto fewer is built for DDP and FSDP2 so far",
            path=run.path,
            hint=hint,
        )


# What a fold's process holds, besides activations: the checkpoint's state as loaded (the model
# and its optimizer state), the state the window started in (kept to explain the root step),
# four copies of the parameters' size (the gradients, DDP's buckets, the fold's running sum, and
# one for the copies a replay makes on the way), and the process itself (torch and ckptlab
# imported, ~0.4 GB on the CPU). Measured against the peak RSS of `scripts/bench_fold.py
# --fold-only` (docs/performance.md): 4.7M and 17.8M parameters with AdamW, 5% over and 6% under.
# FSDP2 holds ten more copies of the parameters' size (the window's start gathered whole through
# DCP's state-dict API, DCP's load, FSDP2's unsharded parameters and its reduce-scatter buffers)
# and ~0.2 GB more (DTensor, DCP): fitted to `bench_fold.py --fsdp --fold-only` at the same sizes.
PARAM_COPIES, PROCESS_BYTES = 4, 400 << 20
SHARDED_COPIES, SHARDED_BYTES = 10, 220 << 20


def memory_said(run: Run) -> str:
    """What `process_bytes` counts, in words."""
    if _sharded(run):
        return f"the checkpoint's state twice, the parameters' size {PARAM_COPIES + SHARDED_COPIES} times, under FSDP2"
    return f"the checkpoint's state twice, the parameters' size {PARAM_COPIES} times"


def _sharded(run: Run) -> bool:
    return run.manifest.get("layout") == "sharded"


def process_bytes(run: Run, step: int) -> int:
    """About how many bytes a process of a fold of `run` holds to replay `step`, activations
    aside (`memory_said`): an estimate from the run's largest checkpoint up to `step` (the replay may
    start from an earlier one than the last; the first may hold no optimizer state yet) and
    the parameters' shapes (the checkpoint's model file where the manifest has none), to
    refuse before anything is loaded rather than be killed for memory midway."""
    steps = [s for s in run.checkpoints if s <= step] or run.checkpoints
    ckpts = [run.checkpoint(s) for s in steps]
    state = max((c.nbytes for c in ckpts), default=0)
    listed = run.manifest.get("parameters", [])
    if all(isinstance(p.get("shape"), list) and str(p.get("dtype")) in dtypes.STORAGE for p in listed):
        params = sum(math.prod(p["shape"]) * dtypes.itemsize(str(p["dtype"])) for p in listed)
    else:  # (the model's bytes as the checkpoint holds them)
        params = max((int(c.commit["files"].get(MODEL_FILE, {}).get("bytes", 0)) for c in ckpts), default=0)
    sharded = SHARDED_COPIES * params + SHARDED_BYTES if _sharded(run) else 0
    return 2 * state + PARAM_COPIES * params + PROCESS_BYTES + sharded


def available_bytes() -> int | None:
    """The host's available memory (MemAvailable), None when not known."""
    try:
        for line in read_text("/proc/meminfo").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_checked(run: Run, step: int, world_size: int, device) -> int:
    """The bytes a fold's process needs (`process_bytes`); ReplayError, before anything is
    loaded, when the `world_size` processes need more host memory than this machine has
    available, naming the largest number of processes that fits. A replay on a GPU (the
    recorded device when `device` is None) is said, not checked: its processes share the
    machine's GPUs as the spawned ranks pick them, and asking a GPU for its free memory
    would hold a CUDA context there for the whole replay."""
    need = process_bytes(run, step)
    if backend_for(run, device) == "nccl":  # (on GPUs)
        return need
    have = available_bytes()

    def total(k: int) -> int:  # (one process: this one, whose own share is no longer available)
        return k * need if k > 1 else need - PROCESS_BYTES

    if have is None or total(world_size) <= have:
        return need
    fits = [k for k in range(world_size - 1, 0, -1) if run.world_size % k == 0 and total(k) <= have]
    raise ReplayError(
        f"--world-size {world_size}: each process needs about {human_bytes(need)} before activations "
        f"({memory_said(run)}), "
        f"{human_bytes(total(world_size))} in all; this machine has {human_bytes(have)} available",
        path=run.path,
        hint=f"--world-size {fits[0]} fits" if fits else "replay on a machine with more memory",
    )


def _engine(manifest: dict) -> str | None:
    """What the run's world splits that a fold cannot rebuild yet, in words; None for DDP and
    FSDP (FSDP1 is refused once built: turns.py)."""
    layout = manifest.get("layout", "replicated")
    if manifest.get("pipeline") is not None or layout == "pipeline":
        return "pipeline stages"
    if manifest.get("data_ranks"):
        return "tensor parallelism"
    if layout == "zero":
        return "DeepSpeed ZeRO"
    return None
