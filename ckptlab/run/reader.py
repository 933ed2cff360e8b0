"""Read a run directory. Readers never write: a torn tail is skipped and reported, not repaired.

run = open_run("runs/exp1")
run.steps                    # recorded step numbers, ascending
run.checkpoints              # steps with a complete checkpoint (sizes checked; hashes on use)
batch, ids = run.batch(5432) # exactly as recorded
m = run.metrics()            # per-step health as numpy arrays (m.loss, m.param_grad_norm...)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, cast

import numpy as np

from ckptlab.errors import CorruptFileError, ReplayError, RetiredError
from ckptlab.run import columns, framelog, records
from ckptlab.run.archive import unfinished_rollback
from ckptlab.run.checkpoint import Checkpoint, list_checkpoints
from ckptlab.run.columns import Columns
from ckptlab.run.layout import (
    archive_dir,
    batches_dir,
    batches_root,
    checkpoint_dir,
    checkpoints_dir,
    journal_dir,
    parse_checkpoint,
    parse_rank,
    parse_segment,
    segments,
)
from ckptlab.run.lock import Lease, holder, take_lease
from ckptlab.run.manifest import read_manifest


class _PerParam:
    """A per-parameter (S, P) field of Metrics, made from the journal's columns the first time
    it is read: on a run of 10^6 steps and 150 parameters each is 0.6-1.2 GB, and most
    readers need two of the five."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            raise AttributeError(self.slot)  # (to dataclass: the field has no default)
        value = obj.__dict__[self.slot]
        if callable(value):
            value = obj.__dict__[self.slot] = value()
        return value

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.slot] = value


@dataclass
class Metrics:
    """Per-step health; row i describes step `step[i]`. Per-parameter arrays are (steps, P)
    with columns named by `param_names`; NaN where a value was not measured that step."""

    param_names: list[str]
    step: np.ndarray  # int64[S]
    loss: np.ndarray  # float64[S]; NaN where not known too (`loss_known`)
    # bool[S]: False where the step returned no loss (recorded null: a Lightning step under
    # manual optimization that returns nothing), which is no NaN loss
    loss_known: np.ndarray
    grad_norm: np.ndarray  # float64[S], before clipping
    lr: np.ndarray  # float64[S, G]
    step_time: np.ndarray  # float64[S], seconds
    nonfinite_grads: np.ndarray  # int64[S]
    stepped: np.ndarray  # bool[S]
    scaler_skipped: np.ndarray  # bool[S]: a GradScaler skipped the update (overflowed gradients)
    scalars: columns.Rows = field(repr=False)  # the raw per-step records, each made when read
    # float32[S, P]; -1 = no gradient. These five: made when first read (_PerParam).
    param_grad_norm: np.ndarray = _PerParam()  # type: ignore[assignment]
    # float32[S, P]; NaN except every `health_every` steps
    update_ratio: np.ndarray = _PerParam()  # type: ignore[assignment]
    weight_norm: np.ndarray = _PerParam()  # type: ignore[assignment]  # float32[S, P]
    # float32[S, P]: the norms before the update, NaN except at steps where some were not finite
    # (recorded then, when known without a device sync: docs/run-format.md)
    weight_norm_before: np.ndarray = _PerParam()  # type: ignore[assignment]
    param_nonfinite: np.ndarray = _PerParam()  # type: ignore[assignment]  # int64[S, P]
    # Where each step's time went and the memory it used (docs/run-format.md, "step"), float64[S]:
    # seconds, NaN where not recorded (data_wait: a session's first step); counts and bytes NaN
    # where not known; ckpt_time, gc_time, recompiles and swap 0 where none.
    data_wait: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    wall_time: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    ckpt_time: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    gc_time: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    recompiles: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    samples: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    mem_peak: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)  # bytes
    mem_limit: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)  # bytes, a session's first step
    swap: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)  # bytes swapped out (sampled)

    def __len__(self) -> int:
        return len(self.step)

    def measured(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(rows, values[rows, P]): the rows whose record holds per-parameter field `key`, in
        order, and their values, without making the (S, P) field (update ratios and weight
        norms are measured every `health_every` steps: a tenth of its rows, or fewer)."""
        rows, values = self.scalars.columns.per_param(key, len(self.param_names))
        return rows, values.astype(PER_PARAM[key][0], copy=False)

    def per_param(self, key: str, rows) -> np.ndarray:
        """Per-parameter field `key` at `rows` (indices or a slice), as `getattr(self, key)[rows]`
        gives it, without making the whole field."""
        idx = np.arange(len(self))[rows]  # (a slice, indices or a mask: as numpy takes them)
        have, values = self.measured(key)
        dtype, fill = PER_PARAM[key]
        out = np.full((len(idx), len(self.param_names)), fill, dtype=dtype)
        if len(have) and len(idx):
            at = np.minimum(np.searchsorted(have, idx), len(have) - 1)
            hit = have[at] == idx
            out[hit] = values[at[hit]]
        return out

    def holds(self, key: str) -> np.ndarray:
        """bool[S]: the step's record holds field `key` (null included)."""
        return self.scalars.columns.holds(key)

    def field(self, key: str, fill: float = np.nan) -> np.ndarray:
        """float64[S]: the records' number field `key`; NaN where null, `fill` where absent."""
        return self.scalars.columns.number(key, fill)

    @property
    def samples_per_s(self) -> np.ndarray:
        """Rows a second of the loop's whole turn (its data wait included); NaN where not known."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return self.samples / self.wall_time

    @property
    def tokens_per_s(self) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return self.tokens / self.wall_time

    def loss_at(self, i: int | None) -> float | None:
        """Row i's loss; None where there is no row or its loss is not known (`loss_known`)."""
        return float(self.loss[i]) if i is not None and self.loss_known[i] else None

    def index(self, step: int) -> int | None:
        i = int(np.searchsorted(self.step, step))
        return i if i < len(self.step) and self.step[i] == step else None

    def window(self, first: int, last: int) -> slice:
        return slice(int(np.searchsorted(self.step, first)), int(np.searchsorted(self.step, last, side="right")))


class Run:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.problems: list[str] = []  # one line each: torn tails, and all of `damaged`
        self.damaged: list[str] = []  # what a crash cannot explain: corrupt or incomplete files
        self._leases: list[Lease] = []
        pending = unfinished_rollback(self.path)
        self.interrupted_rollback: Path | None = pending  # the archive of a rollback killed midway
        if pending is not None:  # the timeline is half moved: every command says so
            self._note(
                f"{pending}: a rollback was interrupted, so the run is half rewound "
                f"(its later steps are partly in the archive); `ckptlab rollback --run {self.path}` finishes it"
            )

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}, steps={len(self.steps)}, checkpoints={self.checkpoints})"

    # --- batches ---------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return int(self.manifest.get("world_size", 1))

    @property
    def needs_process_group(self) -> bool:
        """Recorded inside torch.distributed (several ranks, or one process that initialized a
        group: its build_fn may wrap the model in DDP or fully_shard): replay in one process
        then needs a process group of one."""
        return self.world_size > 1 or self.manifest.get("backend") is not None

    @property
    def ranks(self) -> list[int]:
        """Ranks that recorded batches (0 only, unless the run was distributed)."""
        root = batches_root(self.path)
        found = (
            sorted(r for r in (parse_rank(p.name) for p in root.iterdir()) if r is not None) if root.is_dir() else []
        )
        return found or [0]

    @property
    def _batch_index(self) -> dict[int, framelog.FrameRef]:
        return self.batch_index(0)

    def batch_index(self, rank: int = 0) -> dict[int, framelog.FrameRef]:
        return self._batch_log(rank)[0]

    def _batch_log(self, rank: int) -> tuple[dict[int, framelog.FrameRef], list[framelog.FrameRef]]:
        """A rank's batch log, scanned once: its batch frames by step, and its event frames
        (a rank other than 0 records its own exceptions there)."""
        cache = self.__dict__.setdefault("_batch_logs", {})
        if rank not in cache:
            index: dict[int, framelog.FrameRef] = {}
            events: list[framelog.FrameRef] = []
            for path, tail in _segments(batches_dir(self.path, rank), self._closed_sessions(rank)):
                for ref in self._scan(path, tail).frames:
                    if ref.kind == framelog.BATCH:
                        index[ref.step] = ref
                    elif ref.kind == framelog.EVENT:
                        events.append(ref)
            cache[rank] = (dict(sorted(index.items())), events)
        return cache[rank]

    def _closed_sessions(self, rank: int) -> set[int]:
        """Sessions whose Recorder closed cleanly (rank 0 marks them in the manifest after its
        own logs are complete): their last segments cannot have a torn tail."""
        if rank != 0:
            return set()
        return {int(s["session"]) for s in self.manifest.get("sessions", []) if s.get("closed")}

    def _scan(self, path: Path, tail: str, *, verify: bool = False, index: bool = True) -> framelog.ScanResult:
        """Scan one segment, noting a torn tail (a crash's) or damage (not a crash's). `tail`:
        "open" (the last segment of a session that may have been killed), else why the
        segment must be whole ("went on to later segments", "was closed cleanly")."""
        try:
            scan = framelog.scan(path, verify=verify, index=index)
        except CorruptFileError as e:
            self._damage(str(e))
            return framelog.ScanResult([], 0)
        except FileNotFoundError:
            if path.exists():
                raise
            return framelog.ScanResult([], 0)  # retired by retention after it was listed: not here
        if scan.corrupt:
            self._damage(f"{path}: {scan.corrupt}")
        elif scan.no_header and tail != "open":  # only a kill at its creation leaves a segment empty
            self._damage(f"{path}: empty or cut inside its file header, though its session {tail} (corrupt file)")
        elif scan.torn_bytes and tail != "open":
            self._damage(f"{path}: truncated or damaged in its last frame, though its session {tail} (corrupt file)")
        elif scan.torn_bytes and not self._being_written(path):
            self._note(f"{path}: {scan.torn_bytes} bytes torn at the tail (an interrupted write), ignored")
        return scan

    @property
    def recording(self) -> bool:
        """A Recorder records this run now (as of the first time this was asked)."""
        return self._live_session is not None

    def _being_written(self, path: Path) -> bool:
        """A segment of the session a live Recorder is recording now: its last frame may be
        half written as we read (a write under way, not a crash's torn tail)."""
        parsed = parse_segment(path.name)
        return parsed is not None and parsed[0] == self._live_session

    @cached_property
    def _live_session(self) -> int | None:
        """The session a Recorder is recording now (None: the run is idle)."""
        live = holder(self.path)
        sessions = self.manifest.get("sessions", [])
        if live is None or live.get("holder") != "recorder" or not sessions:
            return None
        return int(sessions[-1].get("session", len(sessions) - 1))

    def _note(self, problem: str) -> None:
        if problem not in self.problems:
            self.problems.append(problem)

    def _damage(self, problem: str) -> None:
        self._note(problem)
        if problem not in self.damaged:
            self.damaged.append(problem)

    def verify_logs(self) -> list[str]:
        """Check the CRC of every frame of every log segment (reads every recorded byte);
        returns `damaged`. Reading checks only what it reads."""
        folders = [(journal_dir(self.path), 0), *((batches_dir(self.path, r), r) for r in self.ranks)]
        for folder, rank in folders:  # (the journal is rank 0's)
            for path, tail in _segments(folder, self._closed_sessions(rank)):
                self._scan(path, tail, verify=True, index=False)
        return self.damaged

    @property
    def steps(self) -> list[int]:
        """Step numbers that have a recorded batch (a step that crashed mid-way included);
        for a distributed run, rank 0's."""
        return list(self._batch_index)

    def steps_of(self, rank: int) -> list[int]:
        return list(self.batch_index(rank))

    def batch_record(self, step: int, rank: int = 0) -> records.BatchRecord:
        ref = self.batch_index(rank).get(step)
        if ref is None:
            where = f" on rank {rank}" if rank else ""
            raise ReplayError(self.missing_step(step) + where, path=self.path)
        try:
            payload, _ = ref.read_payload()
            return records.decode_batch(payload, where=f"{ref.path}@{step}")
        except CorruptFileError as e:  # the run is damaged, whoever asked (`damaged` says so)
            self._damage(str(e))
            raise
        except FileNotFoundError:
            if ref.path.exists():
                raise
            raise RetiredError(f"the batch of step {step}", path=ref.path) from None

    def batch(self, step: int, rank: int = 0) -> tuple[Any, list | None]:
        """(batch, sample_ids) of `step`, exactly as recorded (on `rank`, if distributed)."""
        rec = self.batch_record(step, rank)
        return rec.batch, rec.sample_ids

    def missing_step(self, step: int) -> str:
        """Why `step` has no batch here, in words (pruned by retention, or never recorded)."""
        steps = self.steps
        done = self.metrics().step
        if steps and step < steps[0] and len(done) and step >= done[0]:
            return f"the batch of step {step} was pruned by retention (batches kept: {steps[0]}..{steps[-1]})"
        last = max([*steps[-1:], *done[-1:].tolist()], default=None)
        if last is None:
            return "the run has no recorded steps"
        return f"step {step} was not recorded (recorded: {min([*steps[:1], *done[:1].tolist()])}..{last})"

    # --- checkpoints -----------------------------------------------------------------------

    @cached_property
    def _checkpoints(self) -> dict[int, Checkpoint]:
        found, problems = list_checkpoints(self.path)
        for problem in problems:
            self._damage(problem)
        return {c.step: c for c in found}

    @property
    def checkpoints(self) -> list[int]:
        return list(self._checkpoints)

    @property
    def damaged_checkpoints(self) -> list[int]:
        """Steps whose checkpoint folder is there but incomplete or corrupt (`problems` says
        why); never in `checkpoints`."""
        root = checkpoints_dir(self.path)
        named = {parse_checkpoint(p.name) for p in root.iterdir()} if root.is_dir() else set()
        return sorted(s for s in named if s is not None and s not in self._checkpoints)

    def checkpoint(self, step: int) -> Checkpoint:
        try:
            return self._checkpoints[step]
        except KeyError:
            raise ReplayError(
                f"no checkpoint at step {step} (checkpoints: {self.checkpoints})", path=self.path
            ) from None

    # --- journal: health, validation, events --------------------------------------------------

    @cached_property
    def _columns(self) -> Columns:
        """The journal's records, as columns: each segment's from its summary when it has a
        current one (columns.py), else from its frames."""
        parts = []
        for path, tail in _segments(journal_dir(self.path), self._closed_sessions(0)):
            try:
                cols = columns.load_summary(path, path.stat().st_size)
            except FileNotFoundError:
                continue
            if cols is None:
                try:
                    cols = Columns.from_frames(framelog.iter_payloads(path), str(path))
                except CorruptFileError as e:  # a corrupt segment: report it, keep the others readable
                    self._damage(str(e))
                    cols = e.columns  # type: ignore[attr-defined]  # (the records before the damage)
                else:
                    self._scan(path, tail)
            parts.append(cols)
        return Columns.concat(parts)

    def metrics(self) -> Metrics:
        return self._metrics

    @cached_property
    def _metrics(self) -> Metrics:
        names = [p["name"] for p in self.manifest.get("parameters", [])]
        return _metrics(names, self._columns.by_step())

    def validation(self) -> list[dict]:
        """[{"step": k, "metrics": {...}}], in order: metrics measured on the state at step k."""
        return [{"step": s, **r} for kind, s, r in self._columns.others if kind == framelog.VALIDATION]

    def events(self) -> list[dict]:
        """Anomalies seen while recording (non-finite loss, spikes, ...), in step order; with
        the exceptions ranks other than 0 recorded in their own batch logs (`"rank": R`)."""
        found = [{"step": s, **r} for kind, s, r in self._columns.others if kind == framelog.EVENT]
        found += self._rank_events
        return sorted(found, key=lambda e: e["step"])

    @cached_property
    def _rank_events(self) -> list[dict]:
        out = []
        for rank in self.ranks:
            if rank == 0:
                continue
            for ref in self._batch_log(rank)[1]:
                try:
                    payload = ref.read_payload()[0]
                    where = f"{ref.path}@{ref.step}"
                    record = records.check_json_record("event", records.decode_json(payload, where=where), where)
                    out.append({"step": ref.step, **record})
                except CorruptFileError as e:  # reported as damage; the other events stay readable
                    self._damage(str(e))
                except FileNotFoundError:  # retired by retention after it was listed
                    if ref.path.exists():
                        raise
        return out

    # --- a live run --------------------------------------------------------------------------

    def refresh(self) -> None:
        """Forget the listing of checkpoints and batch logs: read them as they are now."""
        for name in ("_checkpoints", "_batch_logs"):
            self.__dict__.pop(name, None)

    def hold(self, checkpoints: list[int], steps: tuple[int, int]) -> bool:
        """Keep `checkpoints` and the batches of `steps` (first, last) from retention until
        `release()`, while a Recorder records this run (run/lock.py, "Leases"). False: some of
        them were retired since the run was listed (`refresh()` and choose again)."""
        lease = take_lease(self.path, checkpoints=checkpoints, steps=steps)
        if lease is None:  # nobody records the run: nothing retires them
            return True
        logs = {ref.path for r in self.ranks for s, ref in self.batch_index(r).items() if steps[0] <= s <= steps[1]}
        if all(checkpoint_dir(self.path, c).is_dir() for c in checkpoints) and all(p.exists() for p in logs):
            self._leases.append(lease)
            return True
        lease.release()
        return False

    def release(self) -> None:
        """Let retention have what `hold` kept."""
        leases, self._leases = self._leases, []
        for lease in leases:
            lease.release()

    # --- misc ------------------------------------------------------------------------------------

    @property
    def param_names(self) -> list[str]:
        return [p["name"] for p in self.manifest.get("parameters", [])]

    @property
    def archives(self) -> list[Path]:
        root = archive_dir(self.path)
        return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def _metrics(names: list[str], cols: Columns) -> Metrics:
    """Metrics from the journal's step records, one a step, in step order."""
    n, p = len(cols), len(names)
    lr = cols.lists["lr"][0] if "lr" in cols.lists else np.full((n, 0), np.nan)
    m = Metrics(
        param_names=names,
        step=cols.step,
        loss=cols.number("loss", np.nan),
        loss_known=np.isin(
            cols.kind.get("loss", np.zeros(n, dtype=np.uint8)), (columns.FLOAT, columns.INT, columns.BOOL)
        ),
        grad_norm=cols.number("grad_norm", np.nan),
        lr=lr,
        step_time=cols.number("step_time", np.nan),
        nonfinite_grads=cols.number("nonfinite_grads", 0).astype(np.int64),
        stepped=cols.number("stepped", 1).astype(bool),
        scaler_skipped=cols.number("scaler_skipped", 0).astype(bool),
        **{  # made when first read (_PerParam)
            key: cast(Any, functools.partial(_per_param, cols, key, n, p)) for key in PER_PARAM
        },
        scalars=columns.Rows(cols),
        **{k: cols.number(k, fill) for k, fill in SYSTEM_FIELDS.items()},
    )
    return m


# The per-parameter fields of Metrics: each one's dtype, and its value where a record has none.
PER_PARAM = {
    "param_grad_norm": (np.float32, np.nan),
    "update_ratio": (np.float32, np.nan),
    "weight_norm": (np.float32, np.nan),
    "weight_norm_before": (np.float32, np.nan),
    "param_nonfinite": (np.int64, 0),
}


def _per_param(cols: Columns, key: str, n: int, p: int) -> np.ndarray:
    dtype, fill = PER_PARAM[key]
    rows, values = cols.per_param(key, p)
    if len(rows) == n:  # every row (rows are increasing): the columns' own array, not a copy
        out = values.astype(dtype, copy=False).view()
        out.flags.writeable = False  # (shared with the columns and `scalars`)
        return out
    out = np.full((n, p), fill, dtype=dtype)
    out[rows] = values
    return out


# The step record's system fields (record/system.py), each with its value where a record has none.
SYSTEM_FIELDS = {
    "data_wait": np.nan,
    "wall_time": np.nan,
    "ckpt_time": 0.0,
    "gc_time": 0.0,
    "recompiles": 0.0,
    "samples": np.nan,
    "tokens": np.nan,
    "mem_peak": np.nan,
    "mem_limit": np.nan,
    "swap": 0.0,
}


def _segments(folder: Path, closed: set[int]) -> list[tuple[Path, str]]:
    """Segments in recording order, each with its `tail` (see Run._scan): only the last segment
    of a session that did not close cleanly can be torn by a crash, since the writer moves on
    to a new segment only after whole frames."""
    segs = segments(folder)
    out = []
    for i, (session, _, path) in enumerate(segs):
        if i + 1 < len(segs) and segs[i + 1][0] == session:
            out.append((path, "went on to later segments"))
        else:
            out.append((path, "was closed cleanly" if session in closed else "open"))
    return out


@dataclass
class Progress:
    """How far a run got, from frame headers (cheap on a long run): what a resumed Recorder
    needs to continue the numbering and keep retention's promises."""

    last_step: int  # the last step with a batch or health record; -1: none
    first_anomaly: int | None  # the first step with an anomaly event
    validation: list[tuple[int, dict]]  # (step, metrics), in recording order
    recent: list[tuple[float, float]]  # (loss, grad_norm) of the last `recent` steps recorded


def read_progress(run_dir: Path, recent: int = 128) -> Progress:
    last, first_anomaly, validation, steps = -1, None, [], []
    for folder in (batches_dir(run_dir, 0), journal_dir(run_dir)):
        for _, _, path in segments(folder):
            for ref in framelog.scan(path).frames:
                if ref.kind in (framelog.BATCH, framelog.STEP):
                    last = max(last, ref.step)
                    if ref.kind == framelog.STEP:
                        steps.append(ref)
                elif ref.kind == framelog.EVENT:
                    event = records.decode_json(ref.read_payload()[0], where=f"{path}@{ref.step}")
                    if event.get("kind") not in records.RECORD_WARNINGS:  # (a warning is no anomaly)
                        first_anomaly = ref.step if first_anomaly is None else min(first_anomaly, ref.step)
                elif ref.kind == framelog.VALIDATION:
                    record = records.decode_json(ref.read_payload()[0], where=f"{path}@{ref.step}")
                    validation.append((ref.step, record.get("metrics", {})))
    tail = []
    for ref in sorted(steps, key=lambda r: r.step)[-recent:] if recent else []:
        scalars, _ = records.decode_step(ref.read_payload()[0], where=f"{ref.path}@{ref.step}")
        tail.append((_f(scalars.get("loss")), _f(scalars.get("grad_norm"))))
    return Progress(last, first_anomaly, validation, tail)


def _f(x) -> float:
    return float("nan") if x is None else float(x)


def open_run(path: str | Path) -> Run:
    """Open a run directory for reading (raises NotARunError / FormatVersionError / ...)."""
    return Run(path)
