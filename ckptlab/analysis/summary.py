"""What `ckptlab info` reports: a run's steps, checkpoints (verified), anomalies, validation,
disk use per part, and whether the recorded build_fn/step_fn source changed since recording."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptlab.errors import CkptlabError, RetiredError
from ckptlab.run.layout import dir_size, parts
from ckptlab.run.lock import holder
from ckptlab.run.manifest import recorded_code
from ckptlab.run.reader import Run
from ckptlab.run.records import RECORD_WARNINGS


@dataclass
class CheckpointStatus:
    step: int
    reason: str
    session: int | None
    bytes: int
    verified: bool | None  # None: not checked (--no-verify)
    problem: str | None
    healthy: bool
    validation: dict | None


@dataclass
class RunSummary:
    run: str
    format_version: int
    created: float
    versions: dict
    device: str
    world_size: int
    layout: str
    sessions: list[dict]
    steps: dict
    checkpoints: list[CheckpointStatus]
    anomalies: list[dict]
    validation: dict
    disk: dict
    functions: dict
    # Where the run was recorded (run/environment.py): CPU, ATen CPU capability, torch build,
    # GPU, deterministic flags; None for a run recorded before ckptlab kept it.
    environment: dict | None = None
    recording: dict | None = None  # the live Recorder's lock record ({"pid", "host", "started"}), if one records now
    problems: list[str] = field(default_factory=list)  # torn tails (a crash's), and all of `damaged`
    # What the Recorder warned of about its own record (an optimizer that never stepped:
    # docs/alerts.md): events, but no anomaly of a step.
    warnings: list[dict] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)  # corrupt, truncated or tampered files


def summarize(run: Run, *, verify: bool = True) -> RunSummary:
    """`verify` hashes every checkpoint file and checks every log frame's CRC."""
    live = holder(run.path)
    recording = live if live is not None and live.get("holder") == "recorder" else None
    if verify:
        run.verify_logs()
    m = run.metrics()
    batch_steps = run.steps
    done = set(m.step.tolist())
    # While a Recorder records, the steps after the last health record read are under way, not lost.
    last_done = int(m.step[-1]) if recording is not None and len(m) else None
    steps: dict[str, Any] = {
        "recorded": len(m),
        "first": int(m.step[0]) if len(m) else None,
        "last": int(m.step[-1]) if len(m) else None,
        "batches_retained": [batch_steps[0], batch_steps[-1]] if batch_steps else None,
        "batch_ranges": _ranges(batch_steps),  # retention leaves gaps (e.g. around an anomaly)
        # batch recorded, step never returned
        "incomplete": [s for s in batch_steps if s not in done and (last_done is None or s < last_done)],
        # steps that returned no loss (recorded as not known: docs/run-format.md), as ranges
        "loss_not_known": _ranges(m.step[~m.loss_known].tolist()),
    }
    if run.world_size > 1:  # each rank's own batch log
        steps["ranks"] = {r: _ranges(run.steps_of(r)) for r in run.ranks}
    # A checkpoint retention retires while this reads it is left out: the summary of a moment later.
    checkpoints = [c for c in (_checkpoint_status(run, s, verify) for s in run.checkpoints) if c is not None]
    events = run.events()  # reads the journal, noting its problems
    anomalies = [e for e in events if e["kind"] not in RECORD_WARNINGS]
    warned = [e for e in events if e["kind"] in RECORD_WARNINGS]  # the Recorder's own (no fault of a step)
    failed = [c.problem for c in checkpoints if c.verified is False and c.problem is not None]
    return RunSummary(
        run=str(run.path),
        format_version=run.manifest["format_version"],
        created=run.manifest.get("created", 0.0),
        versions=run.manifest.get("versions", {}),
        device=run.manifest.get("device", "cpu"),
        world_size=run.world_size,
        layout=run.manifest.get("layout", "replicated"),
        sessions=run.manifest.get("sessions", []),
        steps=steps,
        checkpoints=checkpoints,
        anomalies=anomalies,
        warnings=warned,
        validation=_validation(run),
        disk=_disk(run),
        functions=_functions(run),
        environment=env if isinstance(env := run.manifest.get("environment"), dict) else None,
        recording=recording,
        problems=[*run.problems, *failed],
        damaged=[*run.damaged, *failed],
    )


def _ranges(steps: list[int]) -> list[list[int]]:
    """[[first, last], ...] runs of consecutive steps."""
    out: list[list[int]] = []
    for s in steps:
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return out


def _checkpoint_status(run: Run, step: int, verify: bool) -> CheckpointStatus | None:
    """None: retired (by retention, a rollback) since the run was listed."""
    c = run.checkpoint(step)
    problem, ok = None, None
    if verify:
        try:
            c.verify()
            ok = True
        except RetiredError:
            return None
        except CkptlabError as e:
            ok, problem = False, str(e)
    return CheckpointStatus(
        step=step,
        reason=c.reason,
        session=c.commit.get("session"),
        bytes=c.nbytes,
        verified=ok,
        problem=problem,
        healthy=bool(c.commit.get("healthy", True)),
        validation=c.commit.get("validation"),
    )


def _validation(run: Run) -> dict:
    points = run.validation()
    config = run.manifest.get("config", {})
    metric, mode = config.get("val_metric", "val_loss"), config.get("val_mode", "min")
    scored = [(p["step"], p["metrics"][metric]) for p in points if metric in p.get("metrics", {})]
    best = None
    if scored:
        pick = min if mode == "min" else max
        step, value = pick(scored, key=lambda sv: sv[1])
        best = {"step": step, "value": value}
    return {"count": len(points), "metric": metric, "mode": mode, "best": best, "points": points}


def _disk(run: Run) -> dict:
    sizes = {name: dir_size(path) for name, path in parts(run.path).items()}
    sizes["total"] = dir_size(run.path)
    return sizes


def _functions(run: Run) -> dict:
    out = {}
    for role, desc in run.manifest.get("functions", {}).items():
        code = recorded_code(desc, run.path)  # replay's answer too (training/userfns.py)
        out[role] = {
            "name": f"{desc.get('module')}.{desc.get('qualname')}",
            "file": desc.get("file"),
            "found": code.path is not None,
            "changed": code.changed,
            "runs": str(code.path) if code.path is not None else None,
            "installed": code.installed,
            "same_tokens": code.same_tokens,
        }
    return out
