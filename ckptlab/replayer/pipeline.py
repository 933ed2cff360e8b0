"""A pipeline's root step, explained on its stages (torch.distributed.pipelining, one stage per rank).

    report = explain_on_stages(inv, window, world, blame)   # every rank; rank 0's report, else None

The ranks replay the window together, as for any distributed run (distributed.py). Then, unlike
DDP's and FSDP2's replay, the root step is explained on the ranks themselves: no process can
build the whole model (each rank's build_fn builds its own stage), so every replay of the root
step that the blame asks for is a step of the whole pipeline, on every rank at once.

Rank 0 leads: it runs blame.py's stages as one process does, and whatever its replayer builds,
loads, restores, sets or replays (driver.py: build, load_checkpoint, restore, set_lr, run_step,
close), it first tells the other ranks (`Mirror`), which do the same on their own stages with
their own records (`follow`). A step's batch goes with the order when it is not the recorded
one (every stage records the whole batch: rank 0's with some rows left out is every stage's);
one whose rows differ in number from the recorded batch's cannot go through the schedule, whose
shapes were inferred from the first step (training/pipeline.py `split_fits`): every rank refuses
it alike (`StageRefused`), and the experiment that asked for it fails. A stage's own exception
in a step comes back to rank 0 and fails the experiment there too.

A traced step brings every stage's trace back to rank 0 (`StageTrace`): the origin is the first
non-finite value in the pipeline's order (forward: the earliest stage first; then backward: the
latest first; then the update), named by its stage and by the micro-batch whose forward or
backward it ran in (`StagesTracer`). The report then says the stage and micro-batch of the
origin (a learning-rate or optimizer fault: the stage holding the blamed parameter), names the
rank of that stage as the one at fault, and places each blamed row in its micro-batch.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

from ckptlab.analysis.batches import batch_rows
from ckptlab.replayer.findings import ReplayReport
from ckptlab.replayer.investigation import Investigation, Plan, Window
from ckptlab.replayer.lineage import Lineage
from ckptlab.replayer.search import Budget
from ckptlab.replayer.trace import OpEvent, Tracer
from ckptlab.replayer.verdict import verdict
from ckptlab.run.records import batch_digest
from ckptlab.training.crash import StageRefused, describe, is_step_error
from ckptlab.training.pipeline import micro_row, split_fits, stage_of


@dataclass(frozen=True)
class StageBlame:
    """What the ranks need to explain a pipeline's root step (sent to spawned workers)."""

    plan: tuple[bool, int, int]  # investigation.Plan's fields
    trace: bool
    counterfactuals: bool
    budget: int


def explain_on_stages(inv: Investigation, window: Window, world, blame: StageBlame) -> ReplayReport | None:
    """Rank 0: the report of the root step, explained with every stage (None on the others,
    which follow rank 0's orders until it is done)."""
    if not world.is_main:
        _same_batches(inv, window, world)
        follow(inv, window, world)
        return None
    mirror = Mirror(world, inv.run)
    mirror.same_batches = _same_batches(inv, window, world)
    inv.replayer.mirror = mirror
    inv.budget = Budget(blame.budget)
    if window.root is not None and window.root_detectors is None:
        window.root_detectors = inv.detectors(window.root)
    try:
        report = inv.report(Plan(*blame.plan), window, trace=blame.trace, counterfactuals=blame.counterfactuals)
    finally:  # (failed: this process ends, and the launcher, or replay's parent, stops the others)
        inv.replayer.mirror = None
    mirror.order("done")
    if window.root is not None:
        name_stages(report, mirror, inv)
    return report


def _same_batches(inv: Investigation, window: Window, world) -> bool:
    """Whether every stage recorded the root step's batch alike (collective): only then can rank
    0 hand the others a batch of its own making (some rows left out, a row moved in)."""
    if window.root is None:
        return True
    return len(set(world.gather_objects(batch_digest(inv.run.batch(window.root, world.rank)[0])))) == 1


# --- the stages' trace -------------------------------------------------------------------------


@dataclass
class StageTrace:
    """One stage's traced step, as rank 0 needs it: its origin, the first forward op that took
    a non-finite input, the origin's chain, and the micro-batch of each of them."""

    stage: int
    origin: OpEvent | None
    enters: OpEvent | None
    chain: list[OpEvent]
    saw_nonfinite: bool
    micro: dict[int, int | None] = field(default_factory=dict)  # event index -> micro-batch

    @staticmethod
    def of(stage: int, tracer: Tracer, marks: list[tuple[int, int]]) -> StageTrace:
        events = tracer.events
        enters = next(
            (
                e
                for e in events
                if e.phase == "forward" and e.module is not None and any(not s.finite for s in e.inputs)
            ),
            None,
        )
        seen = any(not x.finite for e in events for x in (*e.inputs, *e.outputs))
        st = StageTrace(stage, tracer.origin, enters, tracer.chain(), seen)
        for e in (st.origin, st.enters, *st.chain):
            if e is not None:
                st.micro[e.index] = _micro_batch(e, marks)
        return st


def _micro_batch(e: OpEvent, marks: list[tuple[int, int]]) -> int | None:
    """The micro-batch whose forward or backward chunk ran event `e` (marks: (first event,
    micro-batch) of each chunk, in order); None for the update."""
    if e.phase == "optimizer":
        return None
    found = [m for first, m in marks if first <= e.index]
    return found[-1] if found else None


class StagesTracer(Tracer):
    """A traced pipeline step on rank 0: its own Tracer, turned into every stage's trace at
    once when the step is done (`merge`); blame.py reads its origin, events and chain."""

    traces: list[StageTrace]
    chosen: StageTrace | None

    @staticmethod
    def merge(tracer: Tracer, traces: list[StageTrace]) -> StagesTracer:
        merged = tracer
        merged.__class__ = StagesTracer  # (the blame holds this very object)
        assert isinstance(merged, StagesTracer)
        merged.traces = traces
        merged.chosen = _first_origin(traces)
        # What blame.py reads of the events: the op where non-finite values enter the model
        # (the earliest stage's), and whether any op met one.
        merged.events = [t.enters for t in traces if t.enters is not None]
        if any(t.saw_nonfinite for t in traces) and not merged.events:
            merged.events = [e for t in traces for e in t.chain[:1]]
        return merged

    @property
    def origin(self) -> OpEvent | None:
        return self.chosen.origin if self.chosen is not None else None

    def chain(self, limit: int = 12) -> list[OpEvent]:
        return self.chosen.chain[:limit] if self.chosen is not None else []

    def where(self, e: OpEvent | None) -> tuple[int, int | None] | None:
        """(stage, micro-batch) of one of the events it holds."""
        for t in self.traces:
            if e is not None and any(e is x for x in (t.origin, t.enters, *t.chain)):
                return t.stage, t.micro.get(e.index)
        return None


def _first_origin(traces: list[StageTrace]) -> StageTrace | None:
    """The stage whose origin comes first in the pipeline's order: a forward op at the
    earliest stage, then a backward op at the latest, then the update."""
    found = [t for t in traces if t.origin is not None]

    def order(t: StageTrace) -> tuple[int, int]:
        phase = t.origin.phase if t.origin is not None else "optimizer"
        return {"forward": (0, t.stage), "backward": (1, -t.stage)}.get(phase, (2, t.stage))

    return min(found, key=order) if found else None


@contextlib.contextmanager
def chunk_marks(t, tracer: Tracer | None):
    """While a traced step runs: (first event, micro-batch) of each forward and backward chunk
    the stage runs (its methods wrapped on the instance for the step)."""
    marks: list[tuple[int, int]] = []
    stage = stage_of(t.step_model) if tracer is not None else None
    if stage is None:
        yield marks
        return
    assert tracer is not None, "a stage is looked for only when the step is traced"
    saved = {}
    for name in ("forward_one_chunk", "backward_one_chunk"):
        saved[name] = getattr(stage, name)
        setattr(stage, name, _marking(saved[name], tracer, marks))
    try:
        yield marks
    finally:
        for name in saved:
            delattr(stage, name)  # (the class's method again)


def _marking(method, tracer: Tracer, marks: list[tuple[int, int]]):
    @functools.wraps(method)
    def chunk(chunk_id, *args, **kwargs):
        if not marks:  # the step's computation begins: not the schedule's set-up before it
            _restart(tracer)
        marks.append((len(tracer.events), int(chunk_id)))
        # The tracer knows a tensor it has seen by its version counter, which the stage's
        # receive buffers keep while gloo writes each micro-batch's values into them: forget.
        tracer._seen.clear()
        return method(chunk_id, *args, **kwargs)

    return chunk


def _restart(tracer: Tracer) -> None:
    """Forget what the tracer saw before the first micro-batch: the schedule's set-up on a
    fresh stage (splitting the batch, and on the last stage a loss over a placeholder output
    to learn the shapes of what goes back), which is not the step's computation."""
    tracer.events, tracer.candidates, tracer.nan_events = [], [], []
    tracer.lineage = Lineage()


# --- rank 0 leads ------------------------------------------------------------------------------


class Mirror:
    """Rank 0's replayer (driver.py `Replayer.mirror`): each order goes to every other stage
    before rank 0 carries it out. Runners are named by the order in which they were built."""

    def __init__(self, world, run):
        self.world, self.run = world, run
        self.runners: dict[int, int] = {}  # id(runner) -> its number
        self.traced: StagesTracer | None = None  # the last traced step's
        self.same_batches = True  # every stage recorded the root step's batch alike

    def order(self, verb: str, t=None, *args) -> None:
        self.world.broadcast((verb, self.runners.get(id(t)) if t is not None else None, *args))

    def built(self, t) -> None:
        self.runners[id(t)] = len(self.runners)

    def step(self, t, rec, batch, tracer: Tracer | None, measure_update: bool, run_here):
        """The step on every stage: refused alike when its batch cannot go through the
        schedule; another stage's exception raised here (StageRefused)."""
        recorded = batch_rows(rec.batch, rec.sample_ids)
        rows = batch_rows(batch, None) if batch is not None else recorded
        if not split_fits(rows, recorded):
            raise StageRefused(
                f"a batch of {rows} row{'s' if rows != 1 else ''} cannot go through the pipeline's schedule, whose "
                f"micro-batches were shaped by batches of {recorded}"
            )
        if batch is not None and not self.same_batches:
            raise StageRefused("the stages recorded different batches: rank 0's, changed, is not the others'")
        self.order("step", t, rec.step, batch, measure_update, tracer is not None)
        error: Exception | None = None
        mine = None
        with chunk_marks(t, tracer) as marks:
            try:
                h = run_here(t, rec, batch, tracer, measure_update)
            except Exception as e:
                if not is_step_error(e):
                    raise
                error = e
        if tracer is not None:
            mine = StageTrace.of(self.world.stages.stage, tracer, marks)
        outcomes = self.world.gather_objects((None, mine))
        if tracer is not None:
            self.traced = StagesTracer.merge(tracer, [trace for _, trace in outcomes if trace is not None])
        if error is not None:
            raise error
        failed = next(((s, said) for s, (said, _) in enumerate(outcomes) if said is not None), None)
        if failed is not None:
            stage, said = failed
            at = f" at {said['source']}" if said.get("source") else ""
            raise StageRefused(f"{said['error']} on stage {stage}{at}")
        return h


# --- the other ranks follow --------------------------------------------------------------------


def follow(inv: Investigation, window: Window, world) -> None:
    """Carry out rank 0's orders on this stage until it is done."""
    r = inv.replayer
    runners: list = []
    while True:
        verb, i, *args = world.broadcast(None)
        if verb == "done":
            return
        if verb == "build":
            runners.append(r.build())
        elif verb == "load":
            r.load_checkpoint(runners[i], *args)
        elif verb == "restore":
            r.restore(runners[i], window.root_state)
        elif verb == "lr":
            r.set_lr(runners[i], *args)
        elif verb == "close":
            r.close(runners[i])
        elif verb == "step":
            _follow_step(r, runners[i], world, *args)


def _follow_step(r, t, world, step: int, batch, measure_update: bool, traced: bool) -> None:
    """One step with the other stages: this stage's own record of `step` (its RNG states), the
    batch rank 0 sent when it is not the recorded one; what happened goes back to rank 0."""
    rec = r.batch(step)
    given = rec.batch if batch is None else batch
    tracer = Tracer(t.model, t.optimizer, rows=batch_rows(given, rec.sample_ids), batch=given) if traced else None
    error: dict | None = None
    with chunk_marks(t, tracer) as marks:
        try:
            r.run_here(t, rec, batch, tracer, measure_update)
        except Exception as e:
            if not is_step_error(e):
                raise
            error = describe(e, t.model)
    trace = StageTrace.of(world.stages.stage, tracer, marks) if tracer is not None else None
    world.gather_objects((error, trace))


# --- the report names the stages ----------------------------------------------------------------


def name_stages(report: ReplayReport, mirror: Mirror, inv: Investigation) -> None:
    """The origin's stage and micro-batch, the rank at fault (the origin's stage), each blamed
    row's micro-batch and row within it; the verdict said again with them."""
    o, stages = report.origin, mirror.world.stages
    traced = mirror.traced
    event = None
    if traced is not None:
        if (
            o.op is not None
            and traced.origin is not None
            and (o.op, o.module) == (traced.origin.op, traced.origin.module)
        ):
            event = traced.origin
        elif o.kind == "data" and traced.events:
            event = traced.events[0]  # where the batch's non-finite values enter the model
    where = traced.where(event) if traced is not None else None
    if where is not None:
        o.stage, o.micro_batch = where
    elif o.parameter is not None:
        o.stage = next((p.get("stage") for p in inv.run.manifest["parameters"] if p["name"] == o.parameter), None)
    if o.stage is not None:
        report.rank = o.stage  # (stage i runs on rank i)
    batch, ids = inv.run.batch(report.root_step if report.root_step is not None else inv.step, 0)
    rows = batch_rows(batch, ids)
    for s in report.samples:
        if s.micro_batch is None and rows:
            s.batch_row = s.row
            s.micro_batch, s.row = micro_row(s.row, rows, stages.micro_batches)
    report.verdict = verdict(report)
