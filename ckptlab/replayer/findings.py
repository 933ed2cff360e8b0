"""What a replay concludes, as plain dataclasses of kinds and numbers, and their JSON order.

The investigation fills a ReplayReport (its sentence, `verdict`, comes from verdict.py);
rendering (terminal, JSON) reads it and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptlab.jsonable import NOT_IN_JSON, plain

# The keys of `ckptlab replay --json` that scripts rely on (docs/replay.md), in this order.
STABLE_KEYS = ("requested_step", "root_step", "reproduced", "deterministic", "origin", "samples", "verdict")
# How an optimizer-state origin's detail begins when the second moment was empty (optstate.py).
FIRST_UPDATE = "first update with an empty second moment"


@dataclass
class StepCheck:
    step: int
    loss: float | None  # None: not known (the step returned no loss), replayed ...
    recorded_loss: float | None  # ... and recorded (None too where the record has no health)
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
    # The root step raised after a value went non-finite (a loss that checks its input's range,
    # `clip_grad_norm_(..., error_if_nonfinite=True)`): the origin is where that value came
    # from, and this is the exception, {"error": "Type: message", "source", "call"}.
    raised: dict | None = None
    # kind "optimizer": which optimizer (its key: its index in the list, its key in the dict the
    # Recorder was given; None for one given alone) and which of its parameter groups (index
    # into its param_groups; the group whose learning rate jumped most, else `parameter`'s)
    optimizer: int | str | None = None
    param_group: int | None = None
    # A pipeline's (torch.distributed.pipelining): the stage where the fault began (that of the
    # origin's op, of the op where the batch's non-finite values enter, or of the parameter an
    # optimizer fault names), and the micro-batch whose forward or backward ran that op
    stage: int | None = None
    micro_batch: int | None = None


def place(row: int, micro_batch: int | None = None) -> str:
    """Where a row of a step's batch is, as replay names it: `row 5`, or `micro-batch 2 row 1`
    (`row` within its micro-batch) in a step recorded as several micro-batches."""
    return f"row {row}" if micro_batch is None else f"micro-batch {micro_batch} row {row}"


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
        return place(self.row, self.micro_batch)


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
    start: int | None = None  # the checkpoint the window that found it (or was searched last) started from
    windows: list[dict] = field(default_factory=list)  # each window tried: checkpoint, result, detail
    tested: list[int] = field(default_factory=list)  # journal candidates tested alone, in order
    how: str | None = None  # "journal" (a candidate from the record) | "bisection"
    effect: dict | None = None  # what the step did: param, ratio, update_norm, norm_before[, row, row_norm_*]
    untested: list[int] | None = None  # [first, last]: steps no window could test


@dataclass
class FirstUpdate:
    """A parameter's first update with an empty second moment, whose update exploded: one of
    the report's `first_updates` (replayer/optstate.py finds them)."""

    step: int
    parameter: str
    state: str  # "exp_avg_sq all zero" | "no optimizer state"
    grad_norm: float  # the step's gradient norm of that parameter (before clipping)
    update_ratio: float  # ||update|| / ||weights||, measured exactly


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
    losses: list[float | None]  # the two replays' losses (None: not known)
    recorded_loss: float | None
    # The first op whose output (or name) differs between the replays: {"index", "op",
    # "phase", "module", "call", "source"}; None when they agree.
    first_nondeterministic_op: dict | None = None
    detail: str = ""


@dataclass
class NoiseCheck:
    """A reproduced fault in a replay that is not bit-exact: the root step replayed from the
    state it started in, as is and with every parameter moved by one unit of round-off
    (agreement.py's `noise_check`)."""

    step: int
    replays: int
    faulted: int  # how many of them faulted
    robust: bool  # all of them: the fault does not depend on the last bits
    perturbations: list[str]  # "as is: fault", "up: fault", "down: healthy", "random: fault"


@dataclass
class StepProfile:
    """`--profile`: the step replayed timed and under torch.profiler (profile.py; docs/replay.md,
    "Profiling a step"). Times in seconds."""

    replayed_s: float  # the replayed step's time: the median of its timed repeats
    recorded_step_time: float | None  # its step_time in the record
    ratio: float | None  # replayed_s / recorded_step_time
    neighbours_median_s: float | None  # the recorded step_time of the steps around it (median)
    recorded_wall_time: float | None  # its loop turn in the record (wall_time) ...
    neighbours_wall_median_s: float | None  # ... and its neighbours' (median)
    neighbour_step: int | None  # the neighbour replayed the same way (None: none was replayable)
    neighbour_replayed_s: float | None
    recorded_excess_s: float  # how much longer than its neighbours the record says it took
    replayed_excess_s: float  # ... and replay: replayed_s - neighbour_replayed_s
    came_back: bool | None  # the slowness came back on replay (None: not slow when recorded)
    verdict: str
    top_ops: list[dict]  # {"op", "self_s", "calls", "source"}, most self time first
    top_modules: list[dict]  # {"module", "self_s"}: the model's own names
    record: dict  # {"data_wait"|"step_time"|"ckpt_time"|"gc_time"|"recompiles": {"value", "usual"}}
    trace: str  # the Chrome trace written
    repeats: int  # timed replays of each step (after a warm-up)


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
    rank: int | None = None  # distributed: the (data-parallel) rank whose batch the fault came in with
    # Tensor parallelism: the processes of data-parallel rank `rank`, which trained on its batch.
    processes: list[int] | None = None
    # `--world-size K`: the processes the replay ran on, fewer than the run's (replayer/fold.py); else None.
    world_size: int | None = None
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
    # The record's precursor of the root step's loss anomaly (record/precursors.py: what stood
    # out before the loss did): {"param", "what", "step", "ratio", "text"}; None when none.
    precursor: dict | None = None
    budget: dict | None = None  # {"replays": limit, "used": n, "ran_out": [searches cut short]}
    dump: DumpInfo | None = None  # --dump: the full-tensor dump of the root step
    divergence: DivergenceCheck | None = None  # not reproduced: why the replay left the record
    recorded_error: str | None = None  # the requested step raised when recorded ("Type: message")
    # Agreement with the record (agreement.py; docs/replay.md): "bit-exact", "equivalent" (every
    # value before the fault within round-off) or "diverged"; the largest relative deviation
    # of a replayed loss or gradient norm from its record; where it is and where it starts to
    # grow beyond one rounding; the first value beyond round-off (diverged only).
    agreement: str | None = None
    max_rel_deviation: float | None = None
    deviation: dict | None = None  # {"dtype", "tolerance", "steps", "bit_exact_steps", "max_at", "grows_from"}
    diverged_at: dict | None = None  # {"step", "value", "replayed", "recorded", "rel_deviation", "tolerance"}
    # What differs from the recording machine ([{"what", "recorded", "here"}]; [] nothing;
    # "not recorded" for a run recorded without it), and why the bits differ, in words.
    environment_diff: list | str | None = None
    bits_differ: list[str] = field(default_factory=list)
    run_to_run: DivergenceCheck | None = None  # not bit-exact: the first step off the record replayed twice
    run_to_run_without_deterministic: DivergenceCheck | None = None  # --device cuda: the same, without them
    noise_check: NoiseCheck | None = None  # reproduced, not bit-exact: does the fault survive ulp noise?
    # Weights already non-finite in the start checkpoint (startstate.py): {"checkpoint", "nonfinite":
    # [{"parameter", "count", "rows"}], "first_recorded" (step), "used_by": [{"row", "sample_id",
    # "micro_batch"}]}
    start_state: dict | None = None
    # Every replayed step measures its update exactly; a parameter's first update with an empty
    # second moment (exp_avg_sq all zero, or no state yet) that moved it by more than half its
    # norm is listed here, in step order (optstate.py).
    first_updates: list[FirstUpdate] = field(default_factory=list)
    # The experiments the user's code refused (rootstep.py's `attempt`): [{"experiment", "error",
    # "source"}], e.g. the step without the blamed rows, when the loss cannot take fewer rows.
    failed_experiments: list[dict] = field(default_factory=list)
    # The buffers the root step left non-finite that were finite before it (BatchNorm's running
    # statistics): lasting damage, [{"buffer", "count"}] (parameters.py's `nonfinite_buffers`).
    nonfinite_buffers: list[dict] = field(default_factory=list)
    profile: StepProfile | None = None  # --profile: where the step's time goes (profile.py)

    def to_json(self) -> dict:
        """The `ckptlab replay --json` document: the stable keys first (docs/replay.md)."""
        d = plain(self)
        return {**{k: d[k] for k in STABLE_KEYS}, **{k: v for k, v in d.items() if k not in STABLE_KEYS}}
