"""Where a recorded step's host time goes: case c of scripts/bench_record.py (the LM of
scripts/bench_replay.py at 1 layer x 64 wide, batch 4 x 32, 1 torch thread), profiled in one
process, phase by phase.

One model takes bare steps (`step_fn` called directly, the probe's hooks off) and recorded
steps in turn, as in bench_record's case c; every part of the
Recorder that runs on the training thread is timed with `perf_counter_ns` (a nested part is
charged to the innermost one only, so the rows add up). The last rows compare the sum of the
phases with the median step-time difference, recorded minus bare: what the phases do not
explain is the cost of the hooks' presence (autograd calling into Python, the optimizer's hook
dispatch) and noise.

    PYTHONPATH=. python scripts/profile_record_step.py [--steps 400] [--health-every 10]
        [--cprofile 25]      # also cProfile the recorded steps: the top functions by own time

The machine is often shared: compare the phases with each other and against the same run's
bare step, and take the medians, not one step.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from functools import wraps
from pathlib import Path

import torch

import ckptlab
from bench_record import MICRO, make_batches, steady_malloc, step_micro  # scripts/ is on sys.path
from bench_replay import CFG, build, step
from ckptlab.analysis import anomalies
from ckptlab.record import Recorder
from ckptlab.record import batches as record_batches
from ckptlab.record import health as record_health
from ckptlab.run import batch_fast, framelog, records
from ckptlab.run.writer import RunWriter
from ckptlab.training import probe
from ckptlab.training.pending import PendingHealth
from ckptlab.training.probe import StepProbe
from ckptlab.training.step import StepRunner

# phase -> the functions whose own time it is (owner, attribute name)
PHASES = {
    "step: open (writer check, RNG capture/compare)": [(Recorder, "_open_step")],
    "RNG: fingerprint (did the loop draw?)": [(record_batches, "rng_fingerprint")],
    "RNG: capture (recorded states)": [(record_batches, "capture_rng")],
    "RNG: compare (older ckptlab: full states)": [(record_batches, "rng_equal")],
    "batch: ids, encode (codec, pack)": [
        (record_batches.BatchLog, "append"),
        (records, "encode_batch"),
        (batch_fast, "encode_batch"),
    ],
    "batch: zlib": [(RunWriter, "append_batch")],
    "probe: begin": [(StepProbe, "begin")],
    "probe: gradient hooks (per parameter)": [(StepProbe, "_on_grad")],
    "probe: end of backward (the note; per backward on a probe's first step)": [(StepProbe, "_on_backward_end")],
    "probe: the measuring point (the clip, unscale_, the step, zero_grad)": [(StepProbe, "_measure_point")],
    "probe: the norm kernels themselves (every call)": [(probe, "batched_norms")],
    "probe: optimizer pre/post hooks": [(StepProbe, "_on_pre_step"), (StepProbe, "_on_post_step")],
    "probe: end (gather, copy)": [(StepProbe, "end"), (StepRunner, "finish")],
    "probe: read the health (host arithmetic)": [(PendingHealth, "result"), (PendingHealth, "common")],
    "step record: anomaly rules": [(anomalies, "step_anomalies"), (record_health, "spike_events")],
    "step record: health dicts, encode": [
        (record_health.HealthLog, "_record"),
        (record_health.HealthLog, "_record_common"),
        (records, "encode_step"),
        (records, "encode_step_floats"),
    ],
    "step record: the writer's append": [(RunWriter, "append_step")],
    "frame writes (framing, crc, os.write: the batch's and the step record's)": [(framelog.FrameWriter, "append")],
    "step: close (after_step, settle)": [(Recorder, "_after_step"), (record_health.HealthLog, "settle")],
    "step: the Recorder's own step() and run_step": [(Recorder, "step"), (StepRunner, "run_step")],
}
USER = "the user's step_fn (its own work, not the Recorder's)"

spent: dict[str, int] = defaultdict(int)  # phase -> ns, own time
calls: dict[str, int] = defaultdict(int)
_stack: list[str] = []
_on = [False]
# What is timed: the training thread's CPU time (default; a busy machine's preemption is not
# counted), or the wall clock.
CLOCK = [time.thread_time_ns]


def instrument() -> None:
    """Wrap each phase's functions; a nested call's time is taken off its caller's phase.
    Functions imported by name into another module are wrapped there too (record_batches.capture_rng)."""
    for phase, targets in PHASES.items():
        for owner, name in targets:
            fn = getattr(owner, name, None)
            if fn is None:  # (an older ckptlab: profile it all the same)
                continue

            def timed(*a, _fn=fn, _phase=phase, **kw):
                if not _on[0]:
                    return _fn(*a, **kw)
                _stack.append(_phase)
                t0 = CLOCK[0]()
                try:
                    return _fn(*a, **kw)
                finally:
                    dt = CLOCK[0]() - t0
                    _stack.pop()
                    spent[_phase] += dt
                    calls[_phase] += 1
                    if _stack:
                        spent[_stack[-1]] -= dt

            setattr(owner, name, wraps(fn)(timed))
    PHASES[USER] = []
    # the anomaly rules are called through the name record/health.py imported
    record_health.step_anomalies = anomalies.step_anomalies


def timed_user_step(step_fn):
    """`step_fn` timed as its own phase: the rest of a recorded step is the Recorder's."""

    @wraps(step_fn)
    def user_step(*a, **kw):
        if not _on[0]:
            return step_fn(*a, **kw)
        _stack.append(USER)
        t0 = CLOCK[0]()
        try:
            return step_fn(*a, **kw)
        finally:
            dt = CLOCK[0]() - t0
            _stack.pop()
            spent[USER] += dt
            calls[USER] += 1
            if _stack:
                spent[_stack[-1]] -= dt

    return user_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--case",
        choices=("c", "m"),
        default="c",
        help="c: the fast step (default); m: bench_record's case m, MICRO micro-batches a step (2 layers)",
    )
    ap.add_argument("--steps", type=int, default=400, help="steps per copy (default 400; the first 20 warm up)")
    ap.add_argument("--health-every", type=int, default=10, help="the Recorder's health_every (default 10)")
    ap.add_argument("--cprofile", type=int, default=0, help="also cProfile the recorded steps: print this many rows")
    ap.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="time the training thread's CPU time (default: steady on a busy machine) or the wall clock",
    )
    args = ap.parse_args()
    CLOCK[0] = time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns
    steady_malloc()
    torch.set_num_threads(1)
    CFG.update(layers=1 if args.case == "c" else 2, width=64, seq=32)
    step_fn = step if args.case == "c" else step_micro
    batches = make_batches(args.steps, 4 if args.case == "c" else 2 * MICRO)
    warm = min(20, args.steps // 4)
    instrument()
    profile = cProfile.Profile() if args.cprofile else None
    times: dict[str, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="ckptlab-profile-") as tmp:
        model, opt = build()
        rec = ckptlab.Recorder(
            Path(tmp) / "run",
            model,
            opt,
            step_fn=step_fn,
            build_fn=build,
            ckpt_every=10**9,
            health_every=args.health_every,
            on_anomaly=None,
        )
        rec.step_fn = timed_user_step(rec.step_fn)
        for i, (batch, ids) in enumerate(batches):
            measured = i >= warm
            for mode in ("bare", "recorded")[:: 1 if i % 2 else -1]:  # alternate which runs first
                if mode == "bare":  # the same model, without our hooks (see bench_record.case_c)
                    rec.runner.probe.close()
                t0 = CLOCK[0]()
                if mode == "bare":
                    step_fn(model, opt, batch)
                else:
                    _on[0] = measured and profile is None
                    if measured and profile is not None:
                        profile.enable()
                    rec.step(batch, sample_ids=ids)
                    if measured and profile is not None:
                        profile.disable()
                    _on[0] = False
                if measured:
                    times[mode].append((CLOCK[0]() - t0) / 1e9)
                rec.runner.probe.attach()
        rec.close()
    n = len(times["recorded"])
    bare_ms = statistics.median(times["bare"]) * 1e3
    rec_ms = statistics.median(times["recorded"]) * 1e3
    shape = (
        "1 layer x 64 wide, batch 4 x 32"
        if args.case == "c"
        else f"2 layers x 64 wide, {MICRO} micro-batches of 2 x 32"
    )
    print(
        f"case {args.case}: {shape}, 1 thread, health_every={args.health_every}; "
        f"{n} steps per copy measured (after {warm}); clock: {args.clock}"
    )
    print(f"  bare step {bare_ms:.3f} ms, recorded {rec_ms:.3f} ms (medians): +{rec_ms - bare_ms:.3f} ms")
    if profile is not None:
        print("\n(cProfile on: the phases are not timed in this run)")
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(args.cprofile)
        return
    print(f"\n  {'phase (own time, mean per step)':<56}{'us':>9}{'calls/step':>12}")
    for phase in sorted(spent, key=lambda p: -spent[p]):
        if phase != USER:
            print(f"  {phase:<56}{spent[phase] / n / 1e3:>9.1f}{calls[phase] / n:>12.1f}")
    total = sum(v for p, v in spent.items() if p != USER) / n / 1e3
    print(f"  {'sum of the phases (the Recorder on the training thread)':<56}{total:>9.1f}")
    print(f"  {'median step difference, recorded - bare':<56}{(rec_ms - bare_ms) * 1e3:>9.1f}")
    print(f"  {USER:<56}{spent[USER] / n / 1e3:>9.1f}   (bare step: {bare_ms * 1e3:.1f})")


if __name__ == "__main__":
    main()
