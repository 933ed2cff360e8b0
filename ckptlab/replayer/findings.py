"""What a replay concludes (plain dataclasses) and how it is said in one sentence (`verdict`).

The investigation fills a ReplayReport; rendering (terminal, JSON) reads it and nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ckptlab.jsonable import NOT_IN_JSON, plain

# The keys of `ckptlab replay --json` that scripts rely on (docs/replay.md), in this order.
STABLE_KEYS = ("requested_step", "root_step", "reproduced", "deterministic", "origin", "samples", "verdict")


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
    grad_scale: float | None = None  # with a GradScaler: the scale the step began with, replayed ...
    recorded_grad_scale: float | None = None  # ... and recorded
    error: str | None = None  # the step raised on replay ("Type: message"); loss and grad norm are NaN
    recorded_error: str | None = None  # the step raised when recorded (its `exception` event)


@dataclass
class Origin:
    kind: str  # data | numeric | precision | optimizer | exception | none
    phase: str | None  # forward | backward | optimizer
    module: str | None
    op: str | None
    parameter: str | None
    source: str | None
    call: str | None = None
    produced: str | None = None  # "NaN" or "Inf", when an op produced it
    inputs_finite: bool | None = None  # all of that op's inputs were finite (else: NaN-free)
    detail: str | None = None
    dtype: str | None = None  # the dtype the origin op computed in ("float16" under autocast)
    state: str | None = None  # kind "optimizer": the optimizer state to blame (e.g. "exp_avg_sq")
    # kind "precision": the module that, run in float32, makes the root step healthy ("" the
    # whole model); None when neither was enough or it was not tried
    float32_module: str | None = None


@dataclass
class SampleBlame:
    row: int  # the row in the batch; in a step of several recorded micro-batches, in its micro-batch
    sample_id: Any
    reason: str
    loss: float | None = None
    grad_norm: float | None = None
    micro_batch: int | None = None  # gradient accumulation: the micro-batch the row is in
    batch_row: int | None = field(default=None, metadata=NOT_IN_JSON)  # the row counted across micro-batches

    def where(self) -> str:
        """Where the row is: `row 5`, or `micro-batch 2 row 1` in a step of recorded micro-batches."""
        return f"row {self.row}" if self.micro_batch is None else f"micro-batch {self.micro_batch} row {self.row}"


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
class Culprit:
    """The smallest part of the root step's batch that still faults, and whether it needs its
    batch and this model state (search.py)."""

    rows: list[int]  # the fewest rows that, alone through the root step, still make it fault
    sample_ids: list
    minimal: bool  # no single row (or position) can be dropped; False: the budget ran out first
    fields: list[str] = field(default_factory=list)  # the sequence fields `positions` index
    positions: list[int] | None = None  # along those fields' dimension 1: the positions whose
    # values the fault needs (the others taken from a healthy row); [] none; None: not searched
    transplant_step: int | None = None  # the healthy step whose batch the rows were put into
    transplant_fault: bool | None = None  # did they fault there (from the root step's state)?
    cause: str | None = None  # "data alone" | "data x model state" | "data x batch" (see docs)
    detail: str = ""
    micro_batches: list[int] | None = None  # recorded micro-batches: each row's (rows: within it)


@dataclass
class EarlierCause:
    """The earliest step whose removal prevents the fault (search.py's `earlier_cause`); the
    report's JSON names it `rewind`."""

    searched: list[int]  # [first, last]: the steps that could be skipped (start..root-1)
    step: int | None  # the step found; None: none alone (see detail)
    rows: list[int] = field(default_factory=list)  # its rows whose removal alone prevents it
    sample_ids: list = field(default_factory=list)
    complete: bool = True  # False: the budget ran out before the search ended
    detail: str = ""
    micro_batches: list[int] | None = None  # recorded micro-batches: each row's (rows: within it)


@dataclass
class DumpInfo:
    """`--dump FILE.h5`: what the file holds (docs/replay.md, "The dump file")."""

    path: str
    select: str | None  # the --dump-select regex; None: every module
    max_bytes: int  # --dump-max-bytes
    data_bytes: int  # the tensors written, uncompressed
    file_bytes: int
    datasets: int  # tensors written
    omitted: list[dict]  # {"path", "bytes"} of each tensor left out: over max_bytes
    origin_first_nonfinite: list[dict]  # {"dataset", "index"}: the origin's first non-finite outputs
    origin_came_from: list[str]  # for those: the input elements they were computed from


@dataclass
class DivergenceCheck:
    """A fault that did not reproduce: the first step off the record, replayed twice with a
    hash of every op's output (divergence.py)."""

    step: int  # the step replayed twice: left_record_step
    replays_agree: bool  # the two replays match op for op, bit for bit
    ops_compared: int
    losses: list[float]  # the two replays' losses
    recorded_loss: float | None
    # The first op whose output (or name) differs between the replays: {"index", "op",
    # "phase", "module", "call", "source"}; None when they agree.
    first_nondeterministic_op: dict | None = None
    detail: str = ""


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
    # A fault that did not reproduce: the first replayed step that does not match the record
    # (root_step is then the first recorded anomaly of the episode).
    left_record_step: int | None = None
    # How replay ran: torch.compile'd (the model build_fn returns) or eagerly, against the
    # record; whether every replayed step, the faulty ones too, matched it bit for bit; and
    # whether the per-op trace had to run eagerly (its dispatch modes cannot see inside
    # compiled graphs).
    compiled: bool | None = None
    recorded_compiled: bool | None = None
    bit_exact: bool | None = None
    trace_eager: bool = False
    # The deeper searches (search.py), each within `budget` extra replays of the root step or
    # of the window: None when not run.
    culprit: Culprit | None = None
    rewind: EarlierCause | None = None
    budget: dict | None = None  # {"replays": limit, "used": n, "ran_out": [searches cut short]}
    dump: DumpInfo | None = None  # --dump: the full-tensor dump of the root step
    divergence: DivergenceCheck | None = None  # not reproduced: why the replay left the record
    recorded_error: str | None = None  # the requested step raised when recorded ("Type: message")

    def to_json(self) -> dict:
        """The `ckptlab replay --json` document: the stable keys first (docs/replay.md)."""
        d = plain(self)
        return {**{k: d[k] for k in STABLE_KEYS}, **{k: v for k, v in d.items() if k not in STABLE_KEYS}}


def verdict(r: ReplayReport) -> str:
    """One line a person can act on, for any combination of the report's fields (a property
    test, tests/test_verdict.py, holds it to that): user text in it (sample ids, reasons) has
    its line breaks folded into spaces."""
    return " ".join(_verdict(r).split())


def _verdict(r: ReplayReport) -> str:
    div = _divergence_step(r)
    if not r.fault_recorded and r.root_step is None:
        return f"Step {r.requested_step} was healthy when recorded and when replayed from checkpoint {r.start_checkpoint}: nothing to explain."
    if not r.reproduced and r.recorded_error:
        last = r.steps[-1] if r.steps else None
        ran = f" (loss {_fmt(last.loss)})" if last is not None and last.error is None else ""
        det = (
            "every replayed step before it matched the record bit for bit"
            if r.deterministic
            else f"replay left the record at step {div}"
            if div is not None
            else "replay did not match the record"
        )
        return (
            f"The crash did not reproduce: step {r.requested_step} raised {r.recorded_error} when recorded, but "
            f"replayed from checkpoint {r.start_checkpoint} it runs{ran}; {det}. Suspect a transient failure "
            "(out of memory, a hardware, I/O or network error, a signal) or code outside step_fn."
        )
    if not r.reproduced:
        rec = r.steps[-1].recorded_loss if r.steps else None
        got = r.steps[-1].loss if r.steps else None
        where = (
            f"replay matched the record bit for bit until step {div - 1} and diverged at step {div}"
            if div is not None and div > r.start_checkpoint
            else f"replay diverged from the record at its first step, {div}"
            if div is not None
            else "every replayed step before it matched the record bit for bit"
        )
        began = (
            f" (the record shows the fault from step {r.root_step})"
            if r.root_step is not None and r.root_step != r.requested_step
            else ""
        )
        left = f", and first leaves the record at step {r.left_record_step}" if r.left_record_step is not None else ""
        if r.origin.parameter and r.origin.detail:  # what the record itself shows
            left += f"; {r.origin.detail}"
        head = (
            f"The fault did not reproduce{began}: replaying step {r.requested_step} from checkpoint {r.start_checkpoint} "
            f"gives loss {_fmt(got)} (recorded {_fmt(rec)}); {where}{left}."
        )
        return head + " " + _why_not_reproduced(r.divergence)
    o = r.origin
    root = r.root_step if r.root_step is not None else r.requested_step
    lead = (
        f"Step {root}"
        + (f" on rank {r.rank}" if r.rank is not None else "")
        + (f" (the symptom shows at step {r.requested_step})" if root != r.requested_step else "")
    )
    who = ", ".join(f"{s.where()} (sample {s.sample_id})" for s in r.samples[:3])
    more = f" and {len(r.samples) - 3} more" if len(r.samples) > 3 else ""
    produced = o.produced or "a non-finite value"
    at = ""
    if o.module is not None:
        at = f" in `{o.module or '<root>'}`" + (f" ({o.source})" if o.source else "")
    if o.kind == "exception":
        s = _crash_verdict(r, lead, who, more)
    elif o.kind == "data" and o.module is None and o.op is None and r.samples and "non-finite" in r.samples[0].reason:
        s = f"{lead}: the batch itself carries non-finite values: {who}{more}."
    elif o.kind == "data" and o.op is not None and r.samples:
        s = f"{lead}: {who}{more} carries absurd values that make {o.op}{at} overflow."
    elif o.kind == "data" and r.samples and "alone through the step" in r.samples[0].reason:
        s = f"{lead}: {who}{more} alone makes the step non-finite ({r.samples[0].reason.split('; ')[0]})."
    elif o.kind == "data" and r.samples:
        why = r.samples[0].reason
        what = "carries an absurd value" if "typical" in why else "dominates the update"
        s = (
            f"{lead}: {who}{more} {what}"
            + (f" ({why.split(';')[0]})" if why.split(";")[0].strip() else "")
            + ", so the gradients explode"
            + (f" (worst: `{o.parameter}`)" if o.parameter else "")
            + (f" and the weights go non-finite at step {r.requested_step}" if root != r.requested_step else "")
            + "."
        )
    elif o.kind == "data":
        s = f"{lead}: the batch is to blame" + (f" ({o.detail})" if o.detail else "") + ", but no row was named."
    elif o.kind == "numeric" and o.op is not None:
        inputs = "finite inputs" if o.inputs_finite else "NaN-free inputs"
        first_reason = r.samples[0].reason.split("; ")[0] if r.samples else ""
        fact = first_reason if ("is empty" in first_reason or "outside [" in first_reason) else None
        if fact:
            s0 = r.samples[0]
            s = f"{lead}: {s0.where()} (sample {s0.sample_id}) {fact.split(' ', 1)[-1]}; {o.op}{at} produced {produced} from {inputs} on it."
        else:
            rows = f" for {who}{more}" if r.samples else ""
            s = f"{lead}: {o.op}{at} produced {produced} from {inputs}{rows}."
        why = next(
            (part for part in (o.detail or "").split("; ") if o.parameter and part.startswith(f"`{o.parameter}` ")),
            None,
        )
        if o.phase == "forward" and why:  # the op's own weights are out of scale: a bad init or load
            s += f" Its weight {why} (a bad initialization or load?)."
    elif o.kind == "precision" and o.op is not None:
        rows = f" for {who}{more}" if r.samples else ""
        s = (
            f"{lead}: {o.op}{at} overflowed {o.dtype or 'reduced precision'} ({produced} from finite inputs){rows}; "
            "in float32 the same op is finite, so the fault exists only in reduced precision"
            + (
                f": with `{o.float32_module}` in float32 the step stays finite, so keep it in float32."
                if o.float32_module
                else ": with the whole model in float32 the step stays finite."
                if o.float32_module == ""
                else " (keep that module in float32, or train in bfloat16)."
            )
        )
    elif o.kind == "optimizer" and o.state:
        proven = any("second moment" in c.question and c.fault is False for c in r.counterfactuals)
        s = (
            f"{lead}: the optimizer's own state blew the weights up"
            + (f": {o.detail}" if o.detail else f" ({o.state} of `{o.parameter}`)")
            + "; no sample is to blame"
            + (", and with that second moment in tune with its gradient the fault vanishes" if proven else "")
            + " (remedies: warm the learning rate up again, clip updates, a larger eps)."
        )
    elif o.kind == "optimizer":
        s = (
            f"{lead}: the optimizer update blew the weights up"
            + (f" ({o.detail})" if o.detail else "")
            + (f", worst in `{o.parameter}`" if o.parameter else "")
            + "; no sample is to blame."
        )
    elif o.kind == "numeric":
        s = (
            f"{lead}: gradients exploded"
            + (f" (worst: `{o.parameter}`)" if o.parameter else "")
            + " with no single sample to blame."
        )
    elif o.op is not None:  # a kind this sentence does not know yet: say what the trace found
        rows = f" for {who}{more}" if r.samples else ""
        s = f"{lead}: {o.op}{at} produced {produced} ({o.kind} fault){rows}."
    else:
        s = f"{lead}: the fault reproduced but no cause was found" + (f" ({who}{more} suspected)" if who else "") + "."
    if r.samples and r.counterfactuals and r.counterfactuals[0].fault is False and o.kind != "exception":
        # (a crash's verdict says it its own way: "Without those rows the step runs")
        s += " Without those rows the step is healthy: skip them and resume from a checkpoint before it."
    s += _searches(r)
    if not r.deterministic:
        s += (
            f" Note: replay diverged from the record at step {div}."
            if div is not None
            else " Note: replay did not match the record bit for bit."
        )
    return s


def _crash_verdict(r: ReplayReport, lead: str, who: str, more: str) -> str:
    o = r.origin
    error = f"{o.op}: {o.detail}" if o.detail else str(o.op)
    where = ""
    if o.module is not None:
        where += f" in `{o.module or '<root>'}`"
    if o.phase:
        where += f" ({o.phase})"
    if o.source:
        where += f" at {o.source}" + (f" in {o.call}" if o.call else "")
    again = (
        " on replay, as when recorded"
        if r.recorded_error == error
        else f" on replay (recorded: {r.recorded_error})"
        if r.recorded_error
        else " on replay"
    )
    s = f"{lead}: step_fn raised {error}{where}{again}."
    if r.samples:
        why = r.samples[0].reason.split("; ")[0]
        why = why.split(" ", 1)[-1] if why.startswith("batch") else why  # "batch['ids'] has ..." -> "has ..."
        s += f" {who}{more}: {why}."
        cf = next((c for c in r.counterfactuals if "still raise" in c.question), None)
        if cf is not None and cf.fault is False:
            s += " Without those rows the step runs: skip them and resume from a checkpoint before it."
    return s


CAUSES = {
    "data alone": "it faults in another batch and from an older model state too: the data alone",
    "data x model state": "it faults in another batch but not from an older model state: data x this model state",
    "data x batch": "it does not fault without the rest of its batch",
}


def _searches(r: ReplayReport) -> str:
    """The deeper searches' sentences (search.py), empty when none ran."""
    out = ""
    c = r.culprit
    same_rows = c is not None and sorted(map(str, c.sample_ids)) == sorted(str(s.sample_id) for s in r.samples)
    if c is not None and c.rows and not (same_rows and not c.positions and c.cause is None and c.minimal):
        mb = c.micro_batches if c.micro_batches and len(c.micro_batches) == len(c.rows) else None
        where = [f"micro-batch {m} row {x}" for m, x in zip(mb, c.rows)] if mb else [f"row {x}" for x in c.rows]
        who = ", ".join(f"{w} (sample {i})" for w, i in zip(where[:3], c.sample_ids[:3]))
        who += f" and {len(c.rows) - 3} more" if len(c.rows) > 3 else ""
        if c.positions:
            plural = "s" if len(c.positions) > 1 else ""
            who += f", position{plural} {ranges(c.positions)} of {', '.join(f'batch{f}' for f in c.fields[:3])}"
        cause = f"; {CAUSES[c.cause]}" if c.cause in CAUSES else ""
        out += f" Minimal culprit: {who}{'' if c.minimal else ' (not minimal: out of budget)'}{cause}."
    w = r.rewind
    if w is not None and w.detail:
        out += f" {'Doomed earlier' if w.step is not None else 'Searching back'}: {w.detail}."
    if r.budget and r.budget.get("ran_out"):
        out += f" The {' and '.join(r.budget['ran_out'])} search ran out of its budget ({r.budget['used']} replays)."
    return out


def ranges(xs: list[int]) -> str:
    """[2, 3, 4, 7] -> "2-4, 7"."""
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out)


def _why_not_reproduced(d: DivergenceCheck | None) -> str:
    if d is not None and d.first_nondeterministic_op is not None:
        op = d.first_nondeterministic_op
        mod = op.get("module")
        at = (f" in `{mod or '<root>'}`" if mod is not None else "") + (
            f" ({op['source']})" if op.get("source") else ""
        )
        return (
            f"The fault is transient: replaying step {d.step} twice from the same state gives different results; "
            f"the first nondeterministic op is {op.get('op')}{at} ({op.get('phase')}, op {op.get('index')}): "
            "a nondeterministic kernel, or an input the recording does not hold."
        )
    if d is not None and d.replays_agree:
        return (
            f"The fault is transient: two replays of step {d.step} agree op for op, bit for bit, but not with the "
            "record, so the state changed outside the recorded computation (hardware or memory error, or code "
            "outside step_fn)."
        )
    return (
        "Suspect a transient fault: state changed outside the recorded computation (hardware/memory error, "
        "non-determinism, or code outside step_fn)."
    )


def _divergence_step(r: ReplayReport) -> int | None:
    d = r.first_divergence
    step = d.get("step") if isinstance(d, dict) else None
    return step if isinstance(step, int) else None


def same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return False
    if math.isnan(a) and math.isnan(b):
        return True
    return a == b


def absdiff(a, b) -> float | None:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return None
    return abs(a - b)


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.6g}"
