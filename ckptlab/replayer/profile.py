"""`ckptlab replay --step N --profile`: where a step's time goes, and whether its slowness is
the step's own (it comes back on replay) or came from the environment it was recorded in.

    report.profile = profile_step(inv, trace_path)   # StepProfile (findings.py), after the replay

How: the step and one neighbour (the nearest recorded step that was not slow) are replayed
from the states they started in (restored from in-memory snapshots, as the counterfactuals
do), a warm-up each, then REPEATS times each, alternately, timed around the whole step; each
step's time is the median of its repeats. The step then runs once more under torch.profiler
(record_shapes, with_stack), which writes the Chrome trace and says which ops and modules
took the time (timeline.py).

The rule (docs/replay.md, "Profiling a step") is `ckptlab report`'s for a slow step
(`slow_steps`), applied twice. The record calls the step slow when its loop turn (`wall_time`)
took `slow_step_ratio` (3) times the median of its recorded neighbours' and `slow_step_floor`
(20 ms) more. The slowness came back when the replayed step is slow by the same rule against
its replayed neighbour: its time at least 3x the neighbour's and 20 ms more. Then it is the
step's own (its batch, its code path), and the ops and modules say where it goes; else it was
the environment's (a data loader, a checkpoint, the garbage collector, another process, a
one-time cost), and the report lists what the record shows around the step. A ratio, not the
seconds: the record and the replay need not run on an equally loaded host (`recorded_excess_s`
and `replayed_excess_s` say how much came back). A step the record does not call slow has
nothing to come back: `came_back` is null. With no neighbour to replay (none kept, or all
slow), the replayed step is held against its neighbours' recorded step_time.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ckptlab.analysis.health.rules import HealthRules
from ckptlab.replayer.findings import StepProfile
from ckptlab.replayer.timeline import attribute, module_ranges, sources
from ckptlab.run.atomic import atomic_file

REPEATS = 3  # timed replays of each step after its warm-up; the median is its time
TOP = 10  # ops and modules listed
_RULES = HealthRules()  # the slow-step rule of `ckptlab report` (analysis/health/system.py)


def profile_step(inv, trace: Path) -> StepProfile:
    """Replay `inv.step` (and a neighbour) timed and profiled; the Chrome trace goes to `trace`."""
    step = inv.step
    rec = _recorded(inv.run, inv.metrics, step)
    neighbour = _neighbour(inv.run, inv.metrics, step, rec["usual_wall"], inv.from_step)
    r = inv.replayer
    t, snaps = _states(inv, [step] if neighbour is None else [step, neighbour])
    try:
        inv.log(f"profiling step {step}" + (f" against step {neighbour}" if neighbour is not None else ""))
        times = _timed(r, t, snaps)
        top_ops, top_modules = _profiled(r, t, step, snaps[step], trace)
    finally:
        r.close(t)
    replayed = statistics.median(times[step])
    theirs = statistics.median(times[neighbour]) if neighbour is not None else None
    prof = StepProfile(
        replayed_s=round(replayed, 6),
        recorded_step_time=rec["step_time"],
        ratio=round(replayed / rec["step_time"], 4) if rec["step_time"] else None,
        neighbours_median_s=rec["usual_step"],
        recorded_wall_time=rec["wall"],
        neighbours_wall_median_s=rec["usual_wall"],
        neighbour_step=neighbour,
        neighbour_replayed_s=round(theirs, 6) if theirs is not None else None,
        recorded_excess_s=round(rec["excess"], 6),
        replayed_excess_s=round(replayed - (theirs if theirs is not None else rec["usual_step"] or 0.0), 6),
        came_back=None,
        verdict="",
        top_ops=top_ops,
        top_modules=top_modules,
        record=rec["around"],
        trace=str(trace),
        repeats=REPEATS,
    )
    prof.came_back = came_back(prof, slow=rec["slow"])
    prof.verdict = profile_verdict(step, prof)
    return prof


def came_back(p: StepProfile, *, slow: bool) -> bool | None:
    """The rule: None when the record does not call the step slow; else whether the replayed
    step is slow against its replayed neighbour (or its neighbours' recorded step_time) by the
    rule that called it slow."""
    if not slow:
        return None
    theirs = p.neighbour_replayed_s if p.neighbour_replayed_s is not None else p.neighbours_median_s
    if theirs is None:
        return None
    return _is_slow(p.replayed_s, theirs)


def _is_slow(mine: float, theirs: float) -> bool:
    """`ckptlab report`'s slow step: `slow_step_ratio` times its usual and `slow_step_floor` more."""
    return mine >= _RULES.slow_step_ratio * theirs and mine - theirs >= _RULES.slow_step_floor


def _recorded(run, m, step: int) -> dict:
    """What the record says of the step's time: its step_time and wall_time, their neighbours'
    medians (`slow_step_window` steps each side), its excess, whether `report` calls it slow,
    and the parts of its loop turn against their usual values (`around`)."""
    i = m.index(step)  # None: a step with no health recorded (one that raised): its times are unknown
    at = i if i is not None else int(np.searchsorted(m.step, step))
    w = _RULES.slow_step_window
    near = [j for j in range(max(0, at - w), min(len(m.step), at + w + 1)) if j != i]

    def usual(a) -> float | None:
        values = np.asarray(a)[near] if near and len(a) else np.zeros(0)
        values = values[np.isfinite(values)]
        return round(float(np.median(values)), 6) if len(values) else None

    def value(a) -> float | None:
        return _num(a[i]) if i is not None and len(a) else None

    step_time, wall = value(m.step_time), value(m.wall_time)
    usual_step, usual_wall = usual(m.step_time), usual(m.wall_time)
    mine, theirs = (wall, usual_wall) if wall is not None and usual_wall is not None else (step_time, usual_step)
    excess = (mine or 0.0) - (theirs or 0.0)
    slow = mine is not None and theirs is not None and _is_slow(mine, theirs)
    around = {}
    for key in ("data_wait", "step_time", "ckpt_time", "gc_time", "recompiles"):
        a = getattr(m, key, None)
        if a is not None and len(a):
            around[key] = {"value": value(a), "usual": usual(a)}
    return {
        "step_time": step_time,
        "wall": wall,
        "usual_step": usual_step,
        "usual_wall": usual_wall,
        "excess": excess,
        "slow": slow,
        "around": around,
    }


def _num(x) -> float | None:
    return round(float(x), 6) if np.isfinite(x) else None


def _neighbour(run, m, step: int, usual_wall: float | None, from_step: int | None) -> int | None:
    """The nearest recorded step (before first at equal distance) whose batch is kept and
    whose loop turn was not slow: the replayed step's yardstick. Not before `--from-step`
    (the replay starts there) or the first checkpoint."""
    kept = set(run.steps)
    w = _RULES.slow_step_window
    low = from_step if from_step is not None else (run.checkpoints[0] if run.checkpoints else 0)
    for d in range(1, w + 1):
        for s in (step - d, step + d):
            i = m.index(s)
            if s not in kept or i is None or s < low:
                continue
            wall = float(m.wall_time[i]) if len(m.wall_time) else float("nan")
            if usual_wall is None or not np.isfinite(wall) or wall < _RULES.slow_step_ratio * usual_wall:
                return s
    return None


def _states(inv, steps: list[int]):
    """A runner, and the states `steps` start in: one replay from the checkpoint before them."""
    r = inv.replayer
    k = inv.choose_start(min(steps))
    t = r.build()
    r.load_checkpoint(t, k)
    snaps = {}
    for s in range(k, max(steps) + 1):
        if s in steps:
            snaps[s] = r.snapshot(t, s)
        if s < max(steps):
            r.run_step(t, r.batch(s), measure_update=False)
    return t, snaps


def _timed(r, t, snaps: dict) -> dict[int, list[float]]:
    """Each step's time over REPEATS replays from its state, after one warm-up each; the steps
    alternate, so a change in the host's load falls on both alike."""
    times: dict[int, list[float]] = {s: [] for s in snaps}
    batches = {s: r.batch(s) for s in snaps}
    sync = torch.cuda.synchronize if r.device.type == "cuda" else (lambda: None)  # (the GPU's work, not its launch)
    for n in range(REPEATS + 1):
        for s, snap in snaps.items():
            r.restore(t, snap)
            sync()
            t0 = time.perf_counter()
            r.run_step(t, batches[s], measure_update=False)
            sync()
            if n:  # (the first is the warm-up: caches, allocator, lazy inits)
                times[s].append(time.perf_counter() - t0)
    return times


def _profiled(r, t, step: int, snap, trace: Path) -> tuple[list[dict], list[dict]]:
    """The step once more under torch.profiler (after a warm-up with the same ranges): its
    Chrome trace written to `trace` (atomically, its folder made), its top ops and modules."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if r.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    batch = r.batch(step)
    r.restore(t, snap)
    with module_ranges(t.model), sources():  # a warm-up with the ranges: a compiled model recompiles for them here
        r.run_step(t, batch, measure_update=False)
    r.restore(t, snap)
    with module_ranges(t.model), profile(activities=activities, record_shapes=True, with_stack=True) as prof:
        with sources():
            r.run_step(t, batch, measure_update=False)
    trace.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(trace) as tmp:
        prof.export_chrome_trace(str(tmp))
    return attribute(prof.events(), TOP)


def profile_verdict(step: int, p: StepProfile) -> str:
    """One sentence: where the time went, and whose slowness it was."""
    where = ""
    mods = [m for m in p.top_modules if m["module"] != "(outside the model)"]
    if mods:
        op = p.top_ops[0] if p.top_ops else None
        at = f" ({op['op']} at {op['source']}: {op['self_s']:.3g} s)" if op and op.get("source") else ""
        where = (
            f"; its time goes to module `{mods[0]['module'] or '(root)'}` "
            f"({mods[0]['self_s']:.3g} s under the profiler){at}"
        )
    against = (
        f"step {p.neighbour_step}'s {p.neighbour_replayed_s:.3g} s"
        if p.neighbour_step is not None and p.neighbour_replayed_s is not None
        else "its neighbours' recorded step_time"
    )
    replayed = f"replayed, it took {p.replayed_s:.3g} s against {against} ({p.replayed_excess_s:+.3g} s)"
    if p.came_back is None:
        return f"Step {step} was not slow when recorded; {replayed}{where}."
    recorded = (
        f"Step {step} took {p.recorded_excess_s:.3g} s longer than its neighbours when recorded "
        f"({_fmt(p.recorded_wall_time)} s against {_fmt(p.neighbours_wall_median_s)} s)"
    )
    if p.came_back:
        return f"{recorded}; {replayed}: the slowness came back on replay, it is the step's own{where}."
    return (
        f"{recorded}; {replayed}: the slowness did not come back, it was the environment's ({environment(p.record)})."
    )


def environment(around: dict) -> str:
    """What the record shows around the step: the parts of its loop turn that grew most."""
    grew = []
    for key in ("data_wait", "ckpt_time", "gc_time"):
        v = around.get(key, {})
        if v.get("value") is not None and v["value"] - (v.get("usual") or 0.0) >= _RULES.slow_step_floor:
            grew.append(
                (v["value"] - (v.get("usual") or 0.0), f"{key} {v['value']:.3g} s (usual {v.get('usual') or 0:.3g} s)")
            )
    rc = around.get("recompiles", {}).get("value")
    if rc:
        grew.append((0.0, f"{int(rc)} recompilation(s)"))
    if not grew:
        return "the record shows no wait, checkpoint or collection around it: another process, or the host"
    return "the record shows " + ", ".join(text for _, text in sorted(grew, key=lambda g: -g[0]))


def _fmt(x: float | None) -> str:
    return "?" if x is None else f"{x:.3g}"


def check_profile_target(path: Path) -> None:
    """A trace path the user gave: refused before the replay when it exists (never overwritten)."""
    from ckptlab.errors import ReplayError

    if path.exists():
        raise ReplayError(f"{path} exists: --profile never overwrites a file; name another", path=path)
