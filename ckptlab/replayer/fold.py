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

The step's health is then what the recorded world's was: each rank's loss and own gradient
norm, their mean, the averaged gradient's norm, and it is checked against the record bit for
bit. Over two processes a sum of two is the same in either order: bit-exact. Over more, gloo's
ring all-reduce starts each chunk's sum at another rank, so the last bits may differ: the
replay judges `equivalent` and says why (`bits_differ`). The rank at fault and its sample are
found as a full-size replay finds them (distributed.py), and the root step is explained on its
micro-batch as there.

What cannot be folded is refused in one line: at the start, a sharded state (FSDP2, ZeRO), tensor
or pipeline parallelism; once built, a collective inside the model (SyncBatchNorm), a GradScaler,
a hand-written update; in the first turn, a step without DDP, DDP that keeps each rank's buffers
(`broadcast_buffers=False`) or learns its unused parameters over the group
(`find_unused_parameters`, `static_graph`), `gradient_as_bucket_view`, every-micro-batch
all-reduces (accumulation without `no_sync`), and a turn that changes the weights outside the
optimizer's step.
"""

from __future__ import annotations

import copy
import sys
import time
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ckptlab.errors import ReplayError
from ckptlab.replayer.distributed import Explain, Ranks, _check_batches, _faulty_rank, replay_distributed, snap_from
from ckptlab.replayer.findings import ReplayReport
from ckptlab.replayer.investigation import Investigation
from ckptlab.replayer.search import DEFAULT_BUDGET
from ckptlab.run.reader import Run
from ckptlab.training.hand_update import is_hand_update
from ckptlab.training.optimizer_set import OptimizerSet
from ckptlab.training.state import capture_rng, restore_rng, snapshot
from ckptlab.training.world import World, solo_world
from ckptlab.training.wrappers import torch_scheduler

_MODULE_DEPTH = 8  # wrappers around DDP: Fabric's module, torch.compile's


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
    note = (
        f"replayed on {world_size} process{'es' if world_size > 1 else ''} for the recorded {run.world_size}: "
        "every rank's micro-batches in turn, their gradients averaged before the optimizer's step"
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
            "processes; folding it onto fewer is built for DDP only so far",
            path=run.path,
            hint=hint,
        )


def _engine(manifest: dict) -> str | None:
    """What the run's world splits that a fold cannot rebuild yet, in words; None for DDP."""
    layout = manifest.get("layout", "replicated")
    if manifest.get("pipeline") is not None or layout == "pipeline":
        return "pipeline stages"
    if manifest.get("data_ranks"):
        return "tensor parallelism"
    if layout == "zero":
        return "DeepSpeed ZeRO"
    if layout == "sharded":
        return "a sharded model (FSDP)"
    return None


@dataclass
class FoldedWorld(World):
    """The recorded world as the probe sees it in a fold (rank 0 of `size`): `gather` hands
    back every rank's row of health numbers, the other ranks' as their turns left them, with
    rank 0's weight and update norms (DDP's replicas hold the same weights, and only rank 0's
    turn steps the optimizer). While another rank's turn runs, its row is kept."""

    running: int = 0  # whose turn it is
    lead: int = 0  # the rank whose turn steps the optimizer in this process (its index among the processes)
    procs: int = 1  # the processes the fold runs on
    rows: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def gather(self, vec: np.ndarray) -> np.ndarray:
        row = np.asarray(vec, dtype=np.float64)
        if self.running != self.lead:
            self.rows[self.running] = row.copy()
            return np.tile(row, (self.size, 1))  # (read by no one: the turn's health is not kept)
        mine, self.rows = {**self.rows, self.lead: row}, {}
        every = {r: v for part in _everyones(mine, self.procs) for r, v in part.items()}
        P = _params_in(row)
        out = []
        for r in range(self.size):
            other = every[r].copy()
            other[1] = row[1]  # (has_update) the replicas' weights and update are the lead's
            other[3 + 2 * P : 3 + 5 * P] = row[3 + 2 * P : 3 + 5 * P]
            out.append(other)
        return np.stack(out)

    def barrier(self) -> None:
        return None

    def broadcast(self, obj: Any) -> Any:
        return obj

    def gather_objects(self, obj: Any) -> list[Any]:
        return [obj] * self.size


def _everyones(mine: Any, procs: int) -> list[Any]:
    """`mine` from every process of the fold (our own in-memory values), in process order."""
    if procs == 1:
        return [mine]
    import torch.distributed as dist

    out: list[Any] = [None] * procs
    dist.all_gather_object(out, mine)
    return out


def _params_in(row: np.ndarray) -> int:
    """P, from a row laid out as training/health.py `_combine_ranks` lays it: [loss, has_update,
    has_loss, 5 x P numbers] (no tail: a replicated world's rows have none)."""
    return (len(row) - 3) // 5


class Fold:
    """The other ranks' turns around rank 0's step, for one Replayer (driver.py `Replayer.fold`)."""

    def __init__(self, replayer, size: int, procs: int = 1, proc: int = 0):
        self.replayer, self.run, self.size, self.procs = replayer, replayer.run, size, procs
        # This process's ranks: proc, proc + procs, ...; the first (its lead) steps the optimizer.
        self.mine = list(range(proc, size, procs))
        self.lead = proc
        self.world = FoldedWorld(rank=proc, size=size, running=proc, lead=proc, procs=procs)
        self.rngs: dict[int, dict] = {}  # each rank's RNG streams as its last turn left them
        self.sum: dict[int, torch.Tensor] = {}  # id(param) -> the turns' gradients times 1/W, summed
        self.seen: set[int] = set()  # id(param): reduced in this turn
        self.reduced = False  # a DDP's reduction went through `_hook` (else no DDP ran: refused)
        self.used: dict[int, set[int]] = {}  # rank -> id(param) of those given a gradient in its turn
        self.learns_unused = False  # a hooked DDP finds its unused parameters (find_unused_parameters, static_graph)
        self.running = proc
        self.crashed: int | None = None  # the rank whose turn raised
        self.refusal: ReplayError | None = None  # what the hook found it cannot fold (raised after the turn)
        self.hooked: weakref.WeakSet = weakref.WeakSet()  # the DDPs whose all-reduce goes through `_hook`
        self._recs: tuple[int, dict] | None = None  # (step, each rank's batch record)

    # --- the Replayer's calls ----------------------------------------------------------------

    def built(self, t) -> None:
        """A runner built by build_fn: its DDP's all-reduce goes through this fold (a DDP that
        step_fn makes, as Lightning's replayed step does, when its forward first runs)."""
        _check_runner(self.run, t)
        ddp = _ddp_in(t.step_model)
        if ddp is not None:
            self._hook_ddp(ddp)
        t.probe.world = self.world

    def _hook_ddp(self, ddp) -> None:
        if ddp in self.hooked:
            return
        why = _unfoldable(ddp)
        if why is not None:
            self.refusal = _cannot(self.run, why)
            return
        ddp.register_comm_hook(ddp.process_group, self._hook)
        self.hooked.add(ddp)
        self.learns_unused |= bool(ddp.find_unused_parameters or ddp.static_graph)
        if self.learns_unused and self.procs > 1:  # (`_check_used` sees this process's ranks only)
            self.refusal = _cannot(
                self.run,
                "DDP runs with find_unused_parameters or static_graph, which a fold on several processes does not take yet",
            )

    def _before_forward(self, module, args) -> None:
        """A forward pre-hook on every module during a turn: a DDP not hooked yet is, now."""
        if isinstance(module, torch.nn.parallel.DistributedDataParallel) and module not in self.hooked:
            self._hook_ddp(module)

    def loaded(self) -> None:
        """A checkpoint was loaded: every rank starts from its recorded RNG streams."""
        self.rngs.clear()

    def snapshot(self, t, step: int):
        """The state `step` starts in, with every rank's RNG streams (`rng_by_rank`): the root
        step is explained on the faulty rank's."""
        recs = self._records(step)
        mine = {r: recs[r].rng if recs[r].rng is not None else self._rng(r, step) for r in self.mine}
        every = {r: v for part in _everyones(mine, self.procs) for r, v in part.items()}
        rngs = [every[r] for r in range(self.size)]
        return snapshot(step, t.model, t.optimizer, t.scheduler, t.scaler, rngs=rngs)

    def step(self, t, rec, run_here, measure_update: bool):
        """Recorded step `rec.step` of every rank: the others' turns, then rank 0's, which steps."""
        recs = self._records(rec.step, rec)
        start = _StepStart.of(t)
        try:
            with _accelerate_syncs_as_recorded():
                for rank in self.mine[1:]:
                    with _no_update(t):
                        self._turn(t, rank, recs[rank], run_here, False)
                    start.check(self.run, t, rank, rec.step)
                    start.restore(t)
                return self._turn(t, self.lead, rec, run_here, measure_update)
        finally:
            self.sum.clear()  # (the next step's, or gone: nothing to hold once DDP has it)
            self._recs = None

    # --- one rank's turn ---------------------------------------------------------------------

    def _turn(self, t, rank: int, rec, run_here, measure_update: bool):
        if rec.rng is None:
            restore_rng(self._rng(rank, rec.step))
        self.running = self.world.running = rank
        self.seen.clear()
        watch = torch.nn.modules.module.register_module_forward_pre_hook(self._before_forward)
        used = self.used[rank] = set()
        marks = [
            p.register_post_accumulate_grad_hook(lambda p: used.add(id(p)))
            for p in t.model.parameters()
            if p.requires_grad
        ]
        try:
            h = run_here(t, rec, None, None, measure_update)
        except BaseException:
            if self.refusal is not None:
                raise self.refusal from None
            self.crashed = rank
            raise
        finally:
            watch.remove()
            for m in marks:
                m.remove()
            self.running = self.world.running = self.lead
        if rank == self.lead and self.learns_unused:
            self._check_used(t)
        if self.refusal is None and not self.reduced:
            what = type(t.step_model).__name__
            self.refusal = _cannot(
                self.run, f"no DistributedDataParallel ran in step {rec.step} (build_fn returns {what})"
            )
        if self.refusal is not None:  # (raised here, not in the hook: DDP's C++ would wrap it)
            raise self.refusal
        self.rngs[rank] = capture_rng()
        return h

    def _check_used(self, t) -> None:
        """With find_unused_parameters or static_graph, DDP learns which parameters went unused
        from a collective over its group, in a fold the group of one: a parameter rank 0's batch
        left unused, which another rank's used, got no gradient (the recorded world averaged the
        other ranks' into it). Refused, naming it: the replay would be wrong from here."""
        others = set().union(*(u for r, u in self.used.items() if r != self.lead))
        missed = others - self.used.get(self.lead, set())
        if missed:
            name = next((n for n, p in zip(t.probe.names, t.probe.params) if id(p) in missed), "?")  # (own names)
            self.refusal = _cannot(
                self.run,
                f"`{name}` got a gradient from another rank's batch but not from rank {self.lead}'s, and DDP "
                "(find_unused_parameters or static_graph) learns unused parameters over its group: in one process "
                "it would drop the others'",
            )

    def _records(self, step: int, mine=None) -> dict:
        """Every rank's batch record of `step` (rank 0's: `mine`, when given), each batch rebuilt
        and on the replay's device as the replayer gives rank 0's."""
        if self._recs is None or self._recs[0] != step:
            self._recs = (step, {r: self.replayer.batch(step, r) for r in self.mine[1:]})
        recs = self._recs[1]
        if mine is not None:
            recs[self.lead] = mine
        elif self.lead not in recs:
            recs[self.lead] = self.replayer.batch(step, self.lead)
        return recs

    def _rng(self, rank: int, step: int) -> dict:
        if rank not in self.rngs:
            raise ReplayError(
                f"rank {rank}'s RNG streams at step {step} are not in the run: its batch record holds none, and no "
                "earlier step of this replay left them",
                path=self.run.path,
            )
        return self.rngs[rank]

    def _hook(self, state, bucket):  # (no annotations: DDP compares them with its own types, not strings)
        """DDP's all-reduce of one bucket: another rank's turn adds its gradients times 1/W to
        the sum; rank 0's gets the sum plus its own times 1/W (ranks 1, .., W-1, then 0). A
        second reduction of a gradient in one turn is refused."""
        params = bucket.parameters()
        if any(id(p) in self.seen for p in params):
            self.refusal = ReplayError(
                "--world-size: DDP all-reduced the same gradients twice in one step (every micro-batch's "
                "backward synchronised: accumulation without no_sync, or accelerate's, which skips no_sync in a "
                "process group of one), which a fold cannot reproduce yet",
                path=self.run.path,
                hint=f"replay on the recorded {self.size} processes: leave --world-size out",
            )
        self.seen.update(map(id, params))
        self.reduced = True
        scale = 1.0 / self.size  # (DDP's own: its gradient times the reciprocal, then the sum)
        with torch.no_grad():
            for p, g in zip(params, bucket.gradients()):  # (views into the bucket's buffer)
                part, total = g.mul(scale), self.sum.get(id(p))
                if self.running == self.lead:  # the last turn: what the all-reduce hands every rank
                    g.copy_(part if total is None else total + part)
                elif total is None:
                    self.sum[id(p)] = part
                else:
                    total += part
            if self.running == self.lead and self.procs > 1:  # the processes' sums, summed
                import torch.distributed as dist

                dist.all_reduce(bucket.buffer(), group=state)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut


@dataclass
class _StepStart:
    """What a rank's turn may change that the next turn must find as the step found it: the
    buffers (DDP broadcasts rank 0's at each forward), leftover gradients, the schedulers'
    state and the parameter groups' settings (a step_fn that steps its scheduler)."""

    buffers: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    groups: list[dict]
    scheduler: Any
    versions: list[int]  # the parameters' and the optimizer state's: a turn must leave them be

    @staticmethod
    def of(t) -> _StepStart:
        model = t.model
        sched = torch_scheduler(t.scheduler)
        return _StepStart(
            [b.detach().clone() for b in model.buffers()],
            [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()],
            [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in t.optimizer.param_groups],
            copy.deepcopy(sched.state_dict()) if hasattr(sched, "state_dict") else None,
            _versions(t),
        )

    def check(self, run: Run, t, rank: int, step: int) -> None:
        """ReplayError when rank `rank`'s turn changed the weights or the optimizer's state (a
        wrapper whose own step updates them, a step_fn that changes the weights after the step):
        rank 0's turn must start from the step's state."""
        if _versions(t) != self.versions:
            raise _cannot(
                run,
                f"rank {rank}'s turn at step {step} changed the weights or the optimizer's state outside the "
                "optimizer's step (an optimizer wrapper's own step, or step_fn changing the weights)",
            )

    def restore(self, t) -> None:
        with torch.no_grad():
            for b, saved in zip(t.model.buffers(), self.buffers):
                b.copy_(saved)
            for p, g in zip(t.model.parameters(), self.grads):
                p.grad = None if g is None else g.clone()
        for group, settings in zip(t.optimizer.param_groups, self.groups):
            group.update(copy.deepcopy(settings))
        if self.scheduler is not None:
            torch_scheduler(t.scheduler).load_state_dict(copy.deepcopy(self.scheduler))


def _versions(t) -> list[int]:
    state = getattr(t.optimizer, "state", {})
    tensors = [v for per in state.values() for v in per.values() if isinstance(v, torch.Tensor)]
    return [x._version for x in (*t.model.parameters(), *tensors)]


def _unfoldable(ddp) -> str | None:
    """Why DDP `ddp`'s reduction cannot be folded (None: it can)."""
    if not getattr(ddp, "forward_sync_buffers", ddp.broadcast_buffers) and any(True for _ in ddp.module.buffers()):
        return "DDP keeps each rank's own buffers (broadcast_buffers=False), and only rank 0's are checkpointed"
    if ddp.gradient_as_bucket_view:
        return "DDP runs with gradient_as_bucket_view=True, whose gradients the fold's reduction would overwrite"
    return None


@contextmanager
def _no_update(t) -> Iterator[None]:
    """Another rank's turn: the optimizer's step runs only the closure it is given (the weights
    stay as the step found them), and the runner does not step the scheduler."""
    members = t.optimizer.members if isinstance(t.optimizer, OptimizerSet) else [t.optimizer]
    saved = [opt.__dict__.get("step") for opt in members]

    def closure_only(closure=None, *args, **kwargs):
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    for opt in members:
        opt.step = closure_only
    was, t.step_scheduler = t.step_scheduler, False
    try:
        with warnings.catch_warnings():  # (a scheduler step_fn steps sees the step replaced: put back after)
            warnings.filterwarnings("ignore", message=r"Seems like `optimizer\.step\(\)` has been overridden")
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            yield
    finally:
        t.step_scheduler = was
        for opt, step in zip(members, saved):
            if step is None:
                del opt.step
            else:
                opt.step = step


@contextmanager
def _accelerate_syncs_as_recorded() -> Iterator[None]:
    """accelerate's `no_sync(model)` (its `accumulate`, the HF Trainer's micro-batches) runs
    DDP's `no_sync` only on more than one process; the recorded world had several, so in a fold
    it runs DDP's too: each turn all-reduces its micro-batches' accumulated gradients once."""
    accelerate = sys.modules.get("accelerate")
    if accelerate is None:
        yield
        return
    cls = accelerate.Accelerator
    plain = cls.no_sync

    @contextmanager
    def no_sync(self, model):
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            with model.no_sync():
                yield
        else:
            with plain(self, model):
                yield

    cls.no_sync = no_sync
    try:
        yield
    finally:
        cls.no_sync = plain


def _ddp_in(model) -> Any:
    """The DistributedDataParallel in `model`'s wrappers (Fabric's, torch.compile's), or None."""
    for _ in range(_MODULE_DEPTH):
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return model
        model = next((getattr(model, a) for a in ("_forward_module", "_orig_mod", "module") if hasattr(model, a)), None)
        if model is None:
            return None
    return None


def _check_runner(run: Run, t) -> None:
    """ReplayError for a runner whose step a fold cannot replay (the module docstring)."""
    if is_hand_update(t.optimizer):
        raise _cannot(run, "the weights are updated by hand in step_fn: the other ranks' turns cannot leave them be")
    if t.scaler is not None:
        raise _cannot(run, "a GradScaler steps the optimizer, which the other ranks' turns cannot yet leave out")
    if any(isinstance(m, torch.nn.SyncBatchNorm) for m in t.model.modules()):
        raise _cannot(
            run, "the model holds SyncBatchNorm, a collective inside the forward pass: each rank's needs the others'"
        )


def _cannot(run: Run, why: str) -> ReplayError:
    return ReplayError(
        f"--world-size: {why}",
        path=run.path,
        hint=f"replay on the recorded {run.world_size} processes: leave --world-size out",
    )
