"""The ranks' turns of a fold (fold.py): each replayed step runs every recorded rank's
`step_fn` in this process, in turn, and DDP's all-reduce becomes a sum over the turns.

    fold = Fold(replayer, W)            # procs, proc: this process's share of K processes
    replayer.fold = fold                # driver.py calls built / loaded / snapshot / step

`Fold.step` runs the others' turns (ranks proc+K, proc+2K, ...) with the optimizer's step and
the scheduler's left out and the state put back, then the lead's (rank proc), whose DDP hook
hands DDP the sum of every turn's gradient times 1/W (all-reduced over the K processes) before
the optimizer steps; `FoldedWorld` gives the probe every rank's row of health numbers.

FSDP2 (`fully_shard`) reduce-scatters each turn's gradients over the K processes itself (the
model is sharded over them: DCP reshards the checkpoint on load); its all-reduce hook, called on
each FSDP2 unit's reduced shard before it becomes the parameters' gradients, keeps the other
turns' and hands the lead's the sum of all W/K turns times K/W: the mean over the W ranks, as
the recorded reduce-scatter's.
"""

from __future__ import annotations

import copy
import functools
import math
import sys
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ckptlab.errors import ReplayError
from ckptlab.replayer.fsdp2 import fsdp_modules, loss_only, recorded_shards
from ckptlab.run.reader import Run
from ckptlab.training import fsdp1
from ckptlab.training.hand_update import is_hand_update
from ckptlab.training.norms import batched_norms
from ckptlab.training.optimizer_set import OptimizerSet
from ckptlab.training.state import capture_rng, restore_rng, snapshot, whole_snapshot
from ckptlab.training.world import World
from ckptlab.training.wrappers import torch_scheduler

_MODULE_DEPTH = 8  # wrappers around DDP: Fabric's module, torch.compile's


@dataclass
class FoldedWorld(World):
    """The recorded world as the probe sees it in a fold (rank 0 of `size`): `gather` hands
    back every rank's row of health numbers, the other ranks' as their turns left them, with
    rank 0's weight and update norms (DDP's replicas hold the same weights, and only rank 0's
    turn steps the optimizer); a sharded fold's, as `_sharded_rows` lays them out. While another
    rank's turn runs, its row is kept. It is the probe's world only (`gather`); the replayer's
    own world does the replay's collectives."""

    running: int = 0  # whose turn it is (the lead's own turn last)
    lead: int = 0  # the rank whose turn steps the optimizer in this process (its index among the processes)
    procs: int = 1  # the processes the fold runs on
    rows: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    # A sharded fold: parameter index -> {recorded rank (None: every rank): its shard's squared
    # gradient norm}, as the lead's turn measured them (Fold.grad_norms)
    shard_sq: dict[int, dict[int | None, float]] = field(default_factory=dict, repr=False)

    def gather(self, vec: np.ndarray) -> np.ndarray:
        row = np.asarray(vec, dtype=np.float64)
        if self.running != self.lead:
            self.rows[self.running] = row.copy()
            return np.tile(row, (self.size, 1))  # (read by no one: the turn's health is not kept)
        mine, self.rows = {**self.rows, self.lead: row}, {}
        if self.sharded:
            return self._sharded_rows(mine)
        every = {r: v for part in _everyones(mine, self.procs) for r, v in part.items()}
        P = _params_in(row)
        out = []
        for r in range(self.size):
            other = every[r].copy()
            other[1] = row[1]  # (has_update) the replicas' weights and update are the lead's
            other[3 + 2 * P : 3 + 5 * P] = row[3 + 2 * P : 3 + 5 * P]
            out.append(other)
        return np.stack(out)

    def _sharded_rows(self, mine: dict[int, np.ndarray]) -> np.ndarray:
        """Every recorded rank's row in a sharded fold: the leads' (ranks 0 .. K-1) hold the
        processes' non-finite counts and weight and update norms, which add up over the K
        shards; each rank's row holds its recorded shard's squared gradient norms, so the
        combined norms add the recorded ranks' shards in the recorded order; the others' rows
        hold their turn's loss."""
        parts = _everyones((mine, self.shard_sq), self.procs)
        self.shard_sq = {}
        every = {r: v for rows, _ in parts for r, v in rows.items()}
        shards: dict[int, dict[int | None, float]] = {}
        for _, sq in parts:  # (a recorded shard split over two processes: its pieces' squares add up)
            for i, by_rank in sq.items():
                mine_i = shards.setdefault(i, {})
                for r, v in by_rank.items():
                    mine_i[r] = v if r is None else mine_i.get(r, 0.0) + v
        lead = mine[self.lead]
        out = np.stack([every[r] if r < self.procs else loss_only(every[r], lead) for r in range(self.size)])
        for i, by_rank in shards.items():
            if lead[3 + i] < 0:  # (no gradient: NO_GRAD in every row)
                continue
            whole = by_rank.get(None)
            out[:, 3 + i] = [whole if whole is not None else by_rank.get(r, 0.0) for r in range(self.size)]
        return out


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
        sharded = self.run.manifest.get("layout") == "sharded"
        self.world = FoldedWorld(rank=proc, size=size, sharded=sharded, running=proc, lead=proc, procs=procs)
        self.rngs: dict[int, dict] = {}  # each rank's RNG streams as its last turn left them
        self.sum: dict[int, torch.Tensor] = {}  # id(param) -> the turns' gradients times 1/W, summed
        # (id(FSDP2 state), its n-th reduction in a turn) -> the other turns' reduced shards, summed
        self.shards: dict[tuple[int, int], torch.Tensor] = {}
        self.reductions: dict[int, int] = {}  # id(FSDP2 state) -> its reductions so far in this turn
        self.seen: set[int] = set()  # id(param): reduced in this turn
        self.reduced = False  # a DDP's reduction went through `_hook` (else no DDP ran: refused)
        self.used: dict[int, set[int]] = {}  # rank -> id(param) of those given a gradient in its turn
        self.fresh = False  # a DDP was hooked since the last turn's check (made in a turn: `step`)
        self.learns_unused = False  # a hooked DDP finds its unused parameters (find_unused_parameters, static_graph)
        self.running = proc
        self.crashed: int | None = None  # the rank whose turn raised
        self.refusal: ReplayError | None = None  # what the hook found it cannot fold (raised after the turn)
        self.hooked: weakref.WeakSet = weakref.WeakSet()  # the DDPs and FSDP2 states whose reduction goes through us
        self._recs: tuple[int, dict] | None = None  # (step, each rank's batch record)

    # --- the Replayer's calls ----------------------------------------------------------------

    def built(self, t) -> None:
        """A runner built by build_fn: its DDP's all-reduce goes through this fold (a DDP that
        step_fn makes, as Lightning's replayed step does, when its forward first runs)."""
        _check_runner(self.run, t)
        ddp = _ddp_in(t.step_model)
        if ddp is not None:
            self._hook_ddp(ddp)
        for module in fsdp_modules(t.model):
            self._hook_fsdp(module)
        t.probe.world = self.world
        if self.world.sharded:
            t.probe.grad_norms = functools.partial(self.grad_norms, t.probe.params)

    def _hook_ddp(self, ddp) -> None:
        if ddp in self.hooked:
            return
        why = _unfoldable(ddp)
        if why is not None:
            self.refusal = _cannot(self.run, why)
            return
        ddp.register_comm_hook(ddp.process_group, self._hook)
        self.hooked.add(ddp)
        self.fresh = True
        self.learns_unused |= bool(ddp.find_unused_parameters or ddp.static_graph)
        if ddp.static_graph and self.procs > 1:  # (it learns them in its first turn, which is no lead's here)
            self.refusal = _cannot(
                self.run, "DDP runs with static_graph, which a fold on several processes does not take yet"
            )

    def grad_norms(self, params, idx: list[int], grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The probe's gradient norms in a sharded fold (`grads`: this process's shards of
        params[idx]'s gradients), measured on the recorded ranks' shards it holds, whose squares
        the lead's turn keeps for `FoldedWorld.gather` to put in those ranks' rows: the combined
        norms then add the shards the recording added, in its order. A float32 norm over millions
        of elements carries its own summation's round-off (1e-4 relative at 4M elements on one
        CPU thread): a norm over other shards would leave the record by more than the gradients
        do. The probe gets the square root of each parameter's sum."""
        per = [recorded_shards(params[i], g, self.size, self.procs, self.lead) for i, g in zip(idx, grads)]
        pieces = [view for parts in per for _, view in parts]
        squares = (torch.stack(batched_norms(pieces)).double() ** 2).tolist() if pieces else []
        out, k = [], 0
        for i, parts in zip(idx, per):
            sq = squares[k : k + len(parts)]
            k += len(parts)
            if self.running == self.lead:
                self.world.shard_sq[i] = {r: v for (r, _), v in zip(parts, sq)}
            out.append(math.sqrt(sum(sq)))
        return list(torch.tensor(out, dtype=torch.float32, device=grads[0].device).unbind()) if out else []

    def _hook_fsdp(self, module) -> None:
        """FSDP2's reduction of `module`'s parameter group through `_reduced` (a group that
        `fully_shard` made of several modules, as accelerate's FSDP2 does, is hooked once)."""
        state = module._get_fsdp_state()
        if state in self.hooked:
            return
        groups = state._fsdp_param_groups
        if len(groups) > 1 or any(g._all_reduce_hook is not None for g in groups):
            self.refusal = _cannot(
                self.run, "an FSDP2 module with several parameter groups, or an all-reduce hook of its own"
            )
            return
        if any(g.gradient_divide_factor is not None for g in groups):
            # (torch divides by it in other ways on fewer processes: again in a group of one,
            # with PREMUL_SUM, which gloo lacks, where it is not the group's size)
            self.refusal = _cannot(self.run, "the model sets FSDP2's gradient divide factor")
            return
        self.hooked.add(state)
        if groups:  # (a module fully_shard left no parameters of its own has none)
            module.set_all_reduce_hook(lambda out: self._reduced(id(state), out))

    def _reduced(self, group: int, out: torch.Tensor) -> None:
        """FSDP2's reduced shard of one parameter group's gradients, before they become the
        parameters': another rank's turn adds it to the sum of its turn's reduction of that
        group at that micro-batch (a step that accumulates without
        `set_requires_gradient_sync(False)` reduces at each); the lead's gets that sum, then all
        of it times K/W. Each reduced shard is the mean over the K processes of their turns'
        gradients (their sum over the processes' pre-divide factor, in float16, which the
        post-divide after this hook completes), so this is what the recorded reduce-scatter gave
        every micro-batch (over two ranks, the same bits). A float16 sum is kept in float32: the
        W/K turns' sum may overflow where the recorded mean did not."""
        self.reduced = True
        key = (group, self.reductions.get(group, 0))
        self.reductions[group] = key[1] + 1
        scale = self.procs / self.size
        with torch.no_grad():
            total = self.shards.get(key)
            if self.running != self.lead:
                if total is None:
                    self.shards[key] = out.detach().float() if out.dtype == torch.float16 else out.detach().clone()
                else:
                    total += out
                return
            if out.dtype == torch.float16:
                out.copy_((out.float() if total is None else total + out).mul_(scale))
                return
            if total is not None:
                out += total
            out *= scale

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
        if self.world.sharded:  # FSDP2's shards: whole on the first process (collective)
            return whole_snapshot(self.replayer.world, step, t.model, t.optimizer, t.scheduler, t.scaler, rngs)
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
                    if self.fresh:  # (DDP's construction in the turn broadcast the weights: to themselves, here)
                        start.versions, self.fresh = _versions(t), False
                    else:
                        start.check(self.run, t, rank, rec.step)
                    start.restore(t)
                return self._turn(t, self.lead, rec, run_here, measure_update)
        finally:
            self.sum.clear()  # (the next step's, or gone: nothing to hold once DDP or FSDP2 has it)
            self.shards.clear()
            self._recs = None

    # --- one rank's turn ---------------------------------------------------------------------

    def _turn(self, t, rank: int, rec, run_here, measure_update: bool):
        if rec.rng is None:
            restore_rng(self._rng(rank, rec.step))
        self.running = self.world.running = rank
        self.seen.clear()
        self.reductions.clear()
        self.world.shard_sq.clear()
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
                self.run,
                f"no DistributedDataParallel or fully_shard reduced the gradients in step {rec.step} "
                f"(build_fn returns {what})",
            )
        if self.refusal is not None:  # (raised here, not in the hook: DDP's C++ would wrap it)
            raise self.refusal
        self.rngs[rank] = capture_rng()
        return h

    def _check_used(self, t) -> None:
        """With find_unused_parameters or static_graph, DDP learns which parameters went unused
        from a collective over its group, in a fold the group of the K processes, whose leads'
        turns (ranks 0 .. K-1) reduce last: a parameter no lead's batch used, which another
        rank's did, got no gradient (the recorded world averaged that rank's into it). Refused,
        naming it, by every process alike (the turns' parameters gathered from all K): the
        replay would be wrong from here."""
        index = {id(p): i for i, p in enumerate(t.probe.params)}
        others = {index[u] for r, used in self.used.items() if r != self.lead for u in used if u in index}
        lead = {index[u] for u in self.used.get(self.lead, set()) if u in index}
        every = _everyones((others, lead), self.procs)
        missed = set().union(*(o for o, _ in every)) - set().union(*(led for _, led in every))
        if missed:
            name = t.probe.names[min(missed)]  # (own names)
            leads = " or ".join(f"rank {r}'s" for r in range(self.procs))
            self.refusal = _cannot(
                self.run,
                f"`{name}` got a gradient from another rank's batch but not from {leads}, and DDP "
                "(find_unused_parameters or static_graph) learns unused parameters over its group: "
                f"on {self.procs} process{'es' if self.procs > 1 else ''} it would drop the others'",
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
    if fsdp1.units(t.model):
        raise _cannot(
            run, "the model is wrapped in FSDP1 (FullyShardedDataParallel), whose reduction a fold does not take yet"
        )
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
