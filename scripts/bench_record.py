"""Benchmark the Recorder's overhead on a small transformer LM trained on the CPU (the LM of
scripts/bench_replay.py: GPT-style, tied embeddings, vocabulary 4096).

Identical runs train side by side in one process, alternating step by step (in rotating
order): bare, recorded with health every step, recorded with the default health_every, and
recorded with the default health_every plus live trackers (`--trackers`, default: MLflow on a
local file store and an offline W&B run, those installed; `--trackers none` leaves the case
out): the cost of live logging is the last two rows' difference. Machines
here are shared and noisy, so each mode sees the same slow and fast moments: compare the
ratios, not the seconds. Each recorded run keeps every batch and the health of every step and
checkpoints every 100 steps. Prints the median step-time ratio to bare, where the remaining
cost goes (the Recorder's phases, timed inside the recorded runs), and the bytes stored per
step against the raw batch.

    PYTHONPATH=. python scripts/bench_record.py [--steps 300] [--layers 4] [--width 256]
        [--batch 16] [--seq 128] [--ckpt-every 100] [--threads N] [--trackers mlflow,wandb|none]

With `--accumulate K` (e.g. 8) it measures gradient accumulation instead (`accumulation()`):
each step is K micro-batches of `--batch` rows, recorded as one step holding them all, the
way the Lightning and Hugging Face integrations record it (begin_step, the micro-batches
gathered, the batch written before the last one, end_step). Three copies take turns in one
process: bare; recorded with the probe told which backward is the step's last (as the
integrations do); and recorded without telling it (no ckptlab call between the micro-batches:
the probe measures the pre-clip gradient norms once a step by itself, at the clipping).

With `--case` it measures the cases docs/performance.md sets targets for, each figure a ratio
against a bare run in the same invocation (or a difference from it); the last line of output
is one JSON object with every figure:
  a  the 4-layer LM, 1 torch thread, recorded with health_every=1 and with the defaults:
     each on one model whose steps alternate bare and recorded (`alternating`: two copies
     of a model differ by more than what is measured), the median step ratio, and where
     the time goes
  b  the same with all threads and a checkpoint inside the timed window (ratio of the totals;
     a bare copy and a recorded one: a bare step would change the weights a checkpoint is
     being written from)
  c  a ~2 ms step (the LM at 1 layer x 64 wide, batch 4 x 32): host time added per step, in
     ms, measured as in a. `--c-without step-record,batch` (repeatable) adds the default mode with
     those parts left out (nothing recorded for them): what would be left if they cost nothing
The timing cases have glibc keep the memory a step frees (`steady_malloc`).
  e  peak RSS of a ~250M-parameter MLP (AdamW) recorded with health_every=1, over the steps
     after the first checkpoint, vs the same bare (one process each)
  f  in that run, the step that starts a checkpoint vs the median step
  m  a plain step_fn of 8 micro-batches (nanoGPT's loop inside it, no ckptlab call: the probe
     finds the step's last backward by itself), the LM at 2 layers x 128, 1 thread, as a
  g  a small GPT-style model (the LM at 2 layers x 64 wide, batch 4 x 64), 1 thread, as a

    PYTHONPATH=. python scripts/bench_record.py --case a,b,c,e,f,m,g [--steps N] [--params 250e6]
        [--ef-threads 1,all]     # e/f with one torch thread (a core to spare) and with all

Where the time of case c's recorded step goes, phase by phase: scripts/profile_record_step.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from functools import wraps
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab
from bench_replay import CFG, VOCAB, build, step  # the same LM (scripts/ is on sys.path)
from ckptlab.analysis.batches import MICRO_BATCHES
from ckptlab.integrations._common import MicroBatches
from ckptlab.record import Recorder
from ckptlab.record import batches as record_batches
from ckptlab.record import health as record_health
from ckptlab.run import records
from ckptlab.run.layout import dir_size
from ckptlab.run.writer import RunWriter
from ckptlab.trackers.live import LiveLog
from ckptlab.training import probe as probe_module
from ckptlab.training.pending import PendingHealth
from ckptlab.training.probe import StepProbe, accumulating


def steady_malloc() -> None:
    """Have glibc keep the memory a step frees for the next step (for the timing cases only).
    By default it hands large freed blocks back to the kernel, and this VM hands them on to
    its host (free page reporting): touching them again costs ~1.3-2.6 ms a MB, so a step of
    case c swung between 10 and 21 ms with whatever the allocator happened to do, and two
    copies of one model differed by up to 1 ms a step. PyTorch's CUDA allocator caches in the
    same way on a GPU."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: as it is
        return
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
    libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)  # (glibc's maximum)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    libc.mallopt(M_TOP_PAD, 256 << 20)


def make_batches(n: int, batch: int) -> list[tuple[dict, list[int]]]:
    """Token ids drawn from a Zipf-like law (as text is), int64 as a tokenizer returns them."""
    g = torch.Generator().manual_seed(1)
    probs = 1.0 / (torch.arange(VOCAB, dtype=torch.float64) + 10)
    out = []
    for i in range(n):
        ids = torch.multinomial(probs, batch * (CFG["seq"] + 1), replacement=True, generator=g)
        out.append(({"ids": ids.view(batch, CFG["seq"] + 1)}, [i * batch + r for r in range(batch)]))
    return out


# --- phase timers: wrap the Recorder's parts; a perf_counter pair costs ~0.1 us ---------------

PHASES = {
    "batch encode+write": [(records, "encode_batch"), (RunWriter, "append_batch")],
    "probe: grad norms, lr, queue the copy": [
        (StepProbe, "_on_backward_end"),
        (StepProbe, "_on_post_step"),
        (StepProbe, "end"),
    ],
    "probe: read the health (host arithmetic)": [(PendingHealth, "result")],
    "update-ratio sample + norms": [(StepProbe, "_on_pre_step"), (probe_module, "_update_norms")],
    "step record (health, anomalies)": [
        (records, "encode_step"),
        (RunWriter, "append_step"),
        (record_health, "step_anomalies"),
    ],
    "RNG fingerprint + capture": [(record_batches, "rng_fingerprint"), (record_batches, "capture_rng")],
    "checkpoint capture (sync part)": [(Recorder, "_checkpoint")],
    "live trackers (queue a step)": [(LiveLog, "step"), (LiveLog, "validation")],
    "micro-batch RNG checks": [(MicroBatches, "add"), (MicroBatches, "add_loss")],
}
spent: dict[tuple[str, str], float] = defaultdict(float)  # (mode, phase) -> seconds
current = {"mode": ""}


def instrument() -> None:
    """Time each phase; a nested phase (end -> _update_norms) is charged to the inner one only."""
    stack: list[str] = []
    for phase, targets in PHASES.items():
        for owner, name in targets:
            fn = getattr(owner, name)

            def timed(*a, _fn=fn, _phase=phase, **kw):
                stack.append(_phase)
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **kw)
                finally:
                    dt = time.perf_counter() - t0
                    stack.pop()
                    spent[current["mode"], _phase] += dt
                    if stack:
                        spent[current["mode"], stack[-1]] -= dt

            setattr(owner, name, wraps(fn)(timed))


# --- gradient accumulation: K micro-batches a step, as nanoGPT's train.py runs them ----------------


def step_accumulating(model, opt, batch):
    """The recorded step function: one optimizer step over the step's micro-batches."""
    return accumulation_step(model, opt, [(part, None) for part in batch[MICRO_BATCHES]])


def accumulation_step(model, opt, parts, rec=None, *, tell_probe: bool = True):
    """One optimizer step of nanoGPT's loop over `parts` ((micro-batch, sample ids) pairs).
    With `rec`, recorded as the framework integrations record it: begin_step, each micro-batch
    joining the step's batch (with its RNG check), the batch written before the last one runs,
    the probe told which backward is the last (`tell_probe`), end_step with the summed loss."""
    micro = None
    if rec is not None:
        rec.begin_step()
        micro = MicroBatches()
    total = None
    for i, (part, ids) in enumerate(parts):
        last = i == len(parts) - 1
        if micro is not None:
            micro.add(part, ids)
            if tell_probe:
                accumulating(opt, not last)
            if last:
                micro.record(rec, {})
        tokens = part["ids"]  # (B, T + 1)
        logits = model(tokens[:, :-1])  # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)) / len(parts)
        loss.backward()
        if micro is not None:
            micro.add_loss(loss)
        total = loss.detach() if total is None else total + loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if rec is not None:
        rec.end_step(total)
    return total


def accumulation(args) -> None:
    """Bare vs recorded steps of `args.accumulate` micro-batches each, taking turns; prints the
    median step-time ratios to bare and the Recorder's phases."""
    batches = make_batches(args.steps * args.accumulate, args.batch)
    steps = [batches[i : i + args.accumulate] for i in range(0, len(batches), args.accumulate)]
    instrument()
    times: dict[str, list[float]] = defaultdict(list)
    tell = {"recorded (probe told the last backward)": True, "recorded (not told)": False}
    with tempfile.TemporaryDirectory() as tmp:
        trained = {mode: build() for mode in ["bare", *tell]}
        recorders = {
            mode: ckptlab.Recorder(
                Path(tmp) / f"told{told}",
                *trained[mode],
                step_fn=step_accumulating,
                build_fn=build,
                ckpt_every=args.ckpt_every,
            )
            for mode, told in tell.items()
        }
        modes = list(trained)
        for i, parts in enumerate(steps):
            for mode in modes[i % 3 :] + modes[: i % 3]:  # rotate: no mode always runs first
                current["mode"] = mode
                t0 = time.perf_counter()
                accumulation_step(*trained[mode], parts, recorders.get(mode), tell_probe=tell.get(mode, True))
                if i:  # the first step warms caches up
                    times[mode].append(time.perf_counter() - t0)
        for rec in recorders.values():
            rec.close()
    bare = statistics.median(times["bare"])
    print(
        f"gradient accumulation: {args.accumulate} micro-batches of {args.batch} x {args.seq} tokens a step; "
        f"{args.layers} layers x {args.width} wide; {torch.get_num_threads()} threads; {len(steps)} steps per mode"
    )
    print(f"{'mode':<38}{'median ms':>10}{'median ratio':>14}")
    for mode, t in times.items():
        print(f"{mode:<38}{statistics.median(t) * 1e3:>10.1f}{statistics.median(t) / bare:>13.3f}x")
    for mode in recorders:
        print_phases(mode, len(steps), bare)


TARGETS = {"a": 1.02, "b": 1.04, "c": 0.35, "e": 1.10, "f": 1.5, "m": 1.03, "g": 1.08}  # docs/performance.md


# --- cases a, b, c: bare and recorded runs of the LM, interleaved step by step ------------------


def recorded_copy(mode: str, tmp: Path, ckpt_every: int, health_every: int, step_fn=step):
    """(model, optimizer, Recorder) of a fresh model recorded into a folder named after `mode`."""
    model, opt = build()
    rec = ckptlab.Recorder(
        tmp / mode.replace(" ", "_").replace(",", "").replace("=", ""),
        model,
        opt,
        step_fn=step_fn,
        build_fn=build,
        ckpt_every=ckpt_every,
        health_every=health_every,
        on_anomaly=None,
    )
    return model, opt, rec


def interleaved(steps: int, batch: int, ckpt_every: int, health: dict[str, int], tmp: Path) -> dict[str, list[float]]:
    """Step times per mode ("bare" and each recorded mode), alternating step by step in
    rotating order, so each mode meets the same slow and fast moments of the machine."""
    batches = make_batches(steps, batch)
    times: dict[str, list[float]] = defaultdict(list)
    bare_model, bare_opt = build()
    recorders = {mode: recorded_copy(mode, tmp, ckpt_every, health_every)[2] for mode, health_every in health.items()}
    modes = ["bare", *recorders]
    for i, (b, ids) in enumerate(batches):
        k = i % len(modes)
        for mode in modes[k:] + modes[:k]:  # rotate: no mode always runs first
            current["mode"] = mode
            t0 = time.perf_counter()
            if mode == "bare":
                step(bare_model, bare_opt, b)
            else:
                recorders[mode].step(b, sample_ids=ids)
            if i:  # the first step warms caches up (and checkpoints at step 0)
                times[mode].append(time.perf_counter() - t0)
    for rec in recorders.values():
        rec.close()
    times["_run_dir"] = [str(next(iter(recorders.values())).run_dir)]  # type: ignore[list-item]
    return times


def table(times: dict[str, list[float]], steps: int) -> None:
    bare = statistics.median(times["bare"])
    print(f"{'mode':<38}{'median ms':>10}{'mean ms':>10}{'median ratio':>14}{'mean ratio':>12}")
    for mode, t in times.items():
        if not mode.startswith("_"):
            print(
                f"{mode:<38}{statistics.median(t) * 1e3:>10.2f}{statistics.mean(t) * 1e3:>10.2f}"
                f"{statistics.median(t) / bare:>13.3f}x{statistics.mean(t) / statistics.mean(times['bare']):>11.3f}x"
            )


def case_a(args, tmp: Path) -> dict:
    torch.set_num_threads(1)
    CFG.update(layers=4, width=256, seq=128)
    steps = args.steps or 200
    health = {"recorded, health_every=1": 1, "recorded, default": 10}
    res = alternating(steps, 16, 100, health, tmp / "a")
    print(f"\n(a) 4-layer LM, 1 thread, batch 16 x 128, checkpoint every 100 steps; {steps - 1} rounds")
    out = {}
    for mode, key in (("recorded, default", "default"), ("recorded, health_every=1", "health_every_1")):
        print(added(mode, res[mode]))
        bare = statistics.median(res[mode]["bare"])
        out[f"a_ratio_{key}"] = 1 + statistics.median(res[mode]["wall"]) / bare
    for mode in health:
        print(f"\n  where the time goes, {mode} (mean per step; % of the bare median step):")
        bare = statistics.median(res[mode]["bare"])
        phases = {p: v for (m, p), v in spent.items() if m == mode}
        n = steps
        for phase, total in sorted(phases.items(), key=lambda kv: -kv[1]):
            print(f"    {phase:<42}{total / n * 1e3:>8.3f} ms {total / n / bare * 100:>6.2f}%")
        print(f"    {'sum':<42}{sum(phases.values()) / n * 1e3:>8.3f} ms")
    run_dir = res["recorded, health_every=1"]["run_dir"]
    stored = {p: dir_size(run_dir / p) for p in ("batches", "journal", "checkpoints")}
    print(
        f"\n  stored per step (health_every=1): batch log {stored['batches'] / steps:,.0f} B, journal {stored['journal'] / steps:,.0f} B"
    )
    return out


def case_b(args, tmp: Path) -> dict:
    torch.set_num_threads(os.cpu_count() or 1)
    CFG.update(layers=4, width=256, seq=128)
    steps = args.steps or 200
    times = interleaved(steps, 16, steps // 2, {"recorded, default": 10}, tmp / "b")
    print(f"\n(b) 4-layer LM, {torch.get_num_threads()} threads, a checkpoint at step {steps // 2} (inside the window)")
    table(times, steps)
    return {"b_ratio_total": sum(times["recorded, default"]) / sum(times["bare"])}


def alternating(
    steps: int,
    batch: int,
    ckpt_every: int,
    health: dict[str, int],
    tmp: Path,
    without: dict[str, str] | None = None,
    step_fn=step,
    eager: set[str] = frozenset(),  # type: ignore[assignment]
) -> dict:
    """Cases a and c: each recorded mode on its own model, whose steps alternate between bare
    (`step_fn` called directly, the probe's hooks taken off) and recorded (`Recorder.step`),
    in alternating order, on the same batch. Two copies of one model differ by up to ~1 ms a
    step here (where their tensors landed in memory), as much as the figure measured; one model
    cannot. Returns, per recorded mode, its bare steps' times, its rounds' differences (recorded
    minus bare, wall clock and the training thread's CPU time), and its run directory."""
    batches = make_batches(steps, batch)
    runs = {mode: recorded_copy(mode, tmp, ckpt_every, health_every, step_fn) for mode, health_every in health.items()}
    for mode, parts in (without or {}).items():
        leave_out(runs[mode][2], parts)
    for mode in eager:  # the probe as before #30: the norms of every backward pass
        runs[mode][2].runner.probe.grad_mode = "eager"
    out = {mode: {"bare": [], "wall": [], "cpu": [], "run_dir": rec.run_dir} for mode, (_, _, rec) in runs.items()}
    for i, (b, ids) in enumerate(batches):
        for mode, (model, opt, rec) in runs.items():
            spent = {}
            for kind in ("bare", "recorded") if i % 2 else ("recorded", "bare"):
                probe = rec.runner.probe
                if kind == "bare":
                    probe.close()  # the bare step pays for no hook of ours
                current["mode"] = mode if kind == "recorded" else "bare"
                c0, t0 = time.thread_time(), time.perf_counter()
                if kind == "bare":
                    step_fn(model, opt, b)
                else:
                    rec.step(b, sample_ids=ids)
                spent[kind] = (time.perf_counter() - t0, time.thread_time() - c0)
                probe.attach()
            if i:  # the first step warms caches up (and checkpoints at step 0)
                out[mode]["bare"].append(spent["bare"][0])
                out[mode]["wall"].append(spent["recorded"][0] - spent["bare"][0])
                out[mode]["cpu"].append(spent["recorded"][1] - spent["bare"][1])
    for _, _, rec in runs.values():
        rec.close()
    for mode in out:
        # The step that runs second in a round is faster (warmer): average each two rounds
        # (one of each order); the figures are medians of those.
        out[mode]["wall"], out[mode]["cpu"] = pairs(out[mode]["wall"]), pairs(out[mode]["cpu"])
    return out


def added(mode: str, result: dict) -> str:
    """One line: the bare step, and what recording added to it (median, quartiles)."""
    wall = result["wall"]
    q1, med, q3 = statistics.quantiles(wall, n=4)
    return (
        f"  {mode:<28} bare step {statistics.median(result['bare']) * 1e3:.2f} ms; added: "
        f"{statistics.median(wall) * 1e3:+.3f} ms wall (quartiles {q1 * 1e3:+.3f}, {q3 * 1e3:+.3f}), "
        f"{statistics.median(result['cpu']) * 1e3:+.3f} ms of the training thread's CPU"
    )


def case_c(args, tmp: Path) -> dict:
    torch.set_num_threads(1)
    CFG.update(layers=1, width=64, seq=32)
    steps = args.steps * 5 if args.steps else 1000
    health = {"recorded, default": 10, "recorded, health_every=1": 1}
    modes = [("recorded, default", "default"), ("recorded, health_every=1", "health_every_1")]
    without = {}
    for parts in args.c_without:  # the floor experiment (--c-without): the same mode, parts left out
        mode = f"default, without {parts}"
        health[mode], without[mode] = 10, parts
        modes.append((mode, "without_" + parts.replace(",", "_").replace("-", "_")))
    res = alternating(steps, 4, 10**9, health, tmp / "c", without)
    print(f"\n(c) a fast step: the LM at 1 layer x 64 wide, batch 4 x 32, 1 thread; {steps - 1} rounds")
    out = {"c_bare_ms": statistics.median(res["recorded, default"]["bare"]) * 1e3}
    for mode, key in modes:
        print(added(mode, res[mode]))
        out[f"c_added_ms_{key}"] = statistics.median(res[mode]["wall"]) * 1e3
        out[f"c_added_cpu_ms_{key}"] = statistics.median(res[mode]["cpu"]) * 1e3
    return out


MICRO = 8  # case m: micro-batches a step


def step_micro(model, opt, batch):
    """nanoGPT's micro-batch loop written inside one step_fn, with no ckptlab call in it:
    MICRO forward/backward passes over slices of the batch, clipping, one optimizer step."""
    ids = batch["ids"]
    total = None
    for part in ids.chunk(MICRO):
        logits = model(part[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), part[:, 1:].reshape(-1)) / MICRO
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def case_m(args, tmp: Path) -> dict:
    """A plain MICRO-micro-batch step_fn (no ckptlab call), 1 thread, measured as a and c; beside
    it the probe as it was before it found the last backward itself (every backward measured)."""
    torch.set_num_threads(1)
    CFG.update(layers=2, width=64, seq=32)
    steps = args.steps or 100
    health = {"recorded, default": 10, "every backward measured (before)": 10}
    res = alternating(
        steps, 2 * MICRO, 10**9, health, tmp / "m", step_fn=step_micro, eager={"every backward measured (before)"}
    )
    print(
        f"\n(m) {MICRO} micro-batches of 2 x 32 a step, plain step_fn; LM 2 layers x 64 wide, 1 thread; {steps - 1} rounds"
    )
    out = {}
    for mode, key in (("recorded, default", "m_ratio"), ("every backward measured (before)", "m_ratio_every_backward")):
        print(added(mode, res[mode]))
        bare = statistics.median(res[mode]["bare"])
        out[key] = 1 + statistics.median(res[mode]["wall"]) / bare
    out["m_bare_ms"] = statistics.median(res["recorded, default"]["bare"]) * 1e3
    return out


def case_g(args, tmp: Path) -> dict:
    """A small GPT-style model (the LM at 2 layers x 64 wide, batch 4 x 64), 1 thread, as a and c."""
    torch.set_num_threads(1)
    CFG.update(layers=2, width=64, seq=64)
    steps = args.steps or 400
    res = alternating(steps, 4, 10**9, {"recorded, default": 10}, tmp / "g")
    print(f"\n(g) a small GPT: the LM at 2 layers x 64 wide, batch 4 x 64, 1 thread; {steps - 1} rounds")
    print(added("recorded, default", res["recorded, default"]))
    bare = statistics.median(res["recorded, default"]["bare"])
    return {"g_bare_ms": bare * 1e3, "g_ratio": 1 + statistics.median(res["recorded, default"]["wall"]) / bare}


WITHOUT = ("step-record", "batch", "encoding")


def leave_out(rec, parts: str) -> None:
    """An experiment, not a mode of the Recorder: `rec` skips these parts of its step, recording
    nothing for them, to measure what is left (what any design that moved them off the
    training thread could at best reach). "step-record": the health read, the anomaly rules
    and the step record; "batch": the batch record; "encoding": both, but each still makes its
    one write(2) a step, of a record's usual size, at the same moment (what the crash-safety
    promise keeps on the training thread in any design that writes with write(2))."""
    for part in filter(None, parts.split(",")):
        if part == "step-record":
            rec._health.settle = lambda keep=0, *, raise_nonfinite=True, _q=rec._health._queue: _q.clear()
        elif part == "batch":
            rec._batches.append = lambda n, batch, sample_ids, _log=rec._batches: _log.drop()
        elif part == "encoding":
            fd = os.open(rec.run_dir / "scratch-writes", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            q, log, step_bytes, batch_bytes = rec._health._queue, rec._batches, bytes(768), bytes(512)
            rec._health.settle = lambda keep=0, *, raise_nonfinite=True, _q=q, _fd=fd, _b=step_bytes: (
                _q.clear() or os.write(_fd, _b) and None
            )
            rec._batches.append = lambda n, batch, sample_ids, _log=log, _fd=fd, _b=batch_bytes: (
                _log.drop() or os.write(_fd, _b) and None
            )
        else:
            raise SystemExit(f"--c-without: unknown part {part!r} (known: {', '.join(WITHOUT)})")


def pairs(values: list[float]) -> list[float]:
    """The mean of each two consecutive values."""
    return [(a + b) / 2 for a, b in zip(values[::2], values[1::2])]


# --- cases e, f: a large model, one process per mode (peak RSS is per process) -----------------


def build_big():
    """An MLP of ~`CKPTLAB_BENCH_PARAMS` parameters (default 250M): layers of 4096 x 4096."""
    n = float(os.environ.get("CKPTLAB_BENCH_PARAMS", "250e6"))
    width = 4096 if n >= 50e6 else 1024
    layers = max(1, round(n / (width * width + width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.GELU())])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step_big(model, optimizer, batch):
    x, y = batch
    loss = F.mse_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def peak_rss_kib() -> int:
    return int(next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM")).split()[1])


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset VmHWM to the current RSS
        f.write("5")


AFTER_CKPT = 4  # steps timed after the one that starts a checkpoint, while it is committed


def worker(mode: str, steps: int, run_dir: str) -> None:
    """One process: `steps` steps; the peak RSS over steps 2.. (after the first checkpoint is
    committed); then one more step that starts a checkpoint (recorded), timed, and the
    AFTER_CKPT steps after it (the checkpoint's commit, hashing and fsync, runs in the
    background meanwhile: which of them ends with it committed is reported too)."""
    torch.set_num_threads(int(os.environ.get("CKPTLAB_BENCH_THREADS", "0")) or os.cpu_count() or 1)
    model, opt = build_big()
    width = model[0].in_features
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(32, width, generator=g), torch.randn(32, width, generator=g))
        for _ in range(steps + 1 + AFTER_CKPT)
    ]
    rec = None
    if mode == "recorded":
        rec = ckptlab.Recorder(
            run_dir,
            model,
            opt,
            step_fn=step_big,
            build_fn=build_big,
            ckpt_every=steps,
            health_every=1,
            on_anomaly=None,
            ckpt_snapshot=os.environ.get("CKPTLAB_BENCH_SNAPSHOT", "live"),
        )
    run = rec.step if rec is not None else (lambda b: step_big(model, opt, b))
    times = []
    for i in range(steps):
        if i == 2:
            if rec is not None:
                rec.flush()  # the first checkpoint (step 0) is committed
            reset_peak()
        t0 = time.perf_counter()
        run(batches[i])
        times.append(time.perf_counter() - t0)
    peak = peak_rss_kib()
    t0 = time.perf_counter()
    run(batches[steps])  # step `steps`: a checkpoint step when recorded
    ckpt_step = time.perf_counter() - t0
    after, committed_after = [], None  # committed_after: how many steps after it until committed
    committed = Path(run_dir) / "checkpoints" / f"step-{steps:09d}" / "COMMIT.json"
    for i in range(AFTER_CKPT):
        t = time.perf_counter()
        run(batches[steps + 1 + i])
        after.append(time.perf_counter() - t)
        if committed_after is None and committed.exists():
            committed_after = i + 1
    t = time.perf_counter()
    if rec is not None:
        rec.close()
    close_s = time.perf_counter() - t
    n_params = sum(p.numel() for p in model.parameters())
    print(
        json.dumps(
            {
                "peak_kib": peak,
                "median_step": statistics.median(times[2:]),
                "ckpt_step": ckpt_step,
                "after": after,
                "committed_after": committed_after,
                "close_s": close_s,
                "params": n_params,
            }
        )
    )


def case_ef(args, tmp: Path) -> dict:
    """(e, f) once per `--ef-threads` setting: "all" gives the figures e_*, f_*; a number N
    gives them as e{N}_*, f{N}_* (N=1: a core left for the checkpoint's writing and hashing,
    as on a GPU host, where the training thread mostly waits on the device)."""
    figures = {}
    for setting in args.ef_threads.split(","):
        threads = 0 if setting == "all" else int(setting)
        prefix = "" if setting == "all" else setting
        for key, value in _case_ef(args, tmp, threads).items():
            figures[key[0] + prefix + key[1:]] = value
    return figures


def _case_ef(args, tmp: Path, threads: int) -> dict:
    env = {
        **os.environ,
        "CKPTLAB_BENCH_PARAMS": str(args.params),
        "CKPTLAB_BENCH_SNAPSHOT": args.ckpt_snapshot,
        "CKPTLAB_BENCH_THREADS": str(threads),
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    steps = max(args.steps or 8, 4)

    def run(mode: str) -> dict:
        done = subprocess.run(
            [sys.executable, __file__, "--worker", mode, "--steps", str(steps), "--run-dir", str(tmp / f"ef{threads}")],
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise SystemExit(f"the {mode} worker failed:\n{done.stderr[-3000:]}")
        shutil.rmtree(tmp / f"ef{threads}", ignore_errors=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    # One checkpoint step per process, and this VM's step times swing by +-20% from one
    # process to the next: (f) is the median over --ef-repeat recorded processes.
    bare, recs = run("bare"), [run("recorded") for _ in range(max(args.ef_repeat, 1))]
    print(
        f"\n(e, f) MLP of {recs[0]['params'] / 1e6:.0f}M parameters, AdamW, health_every=1, {steps} steps per "
        f"process, {threads or os.cpu_count()} torch threads"
    )
    print(
        f"  peak RSS after the first checkpoint: bare {bare['peak_kib'] / 2**20:.2f} GiB, "
        f"recorded {recs[0]['peak_kib'] / 2**20:.2f} GiB (bare median step {bare['median_step']:.3f} s)"
    )
    for rec in recs:
        after = ", ".join(f"{t:.3f}" for t in rec["after"])
        landed = (
            f"committed by the end of step +{rec['committed_after']}"
            if rec["committed_after"]
            else f"not committed after {AFTER_CKPT} steps (close() then waited {rec['close_s']:.1f} s)"
        )
        print(
            f"  median step {rec['median_step']:.3f} s; the step that starts a checkpoint {rec['ckpt_step']:.3f} s "
            f"({rec['ckpt_step'] / rec['median_step']:.2f}x), the {AFTER_CKPT} after it {after} s; {landed}"
        )

    def median_of(ratio) -> float:
        return statistics.median(ratio(rec) for rec in recs)

    return {
        "e_peak_rss_ratio": recs[0]["peak_kib"] / bare["peak_kib"],
        "f_ckpt_step_ratio": median_of(lambda r: r["ckpt_step"] / r["median_step"]),
        "f_next_step_ratio": median_of(lambda r: r["after"][0] / r["median_step"]),
        "f_after_max_ratio": median_of(lambda r: max(r["after"]) / r["median_step"]),
        "f_after_mean_ratio": median_of(lambda r: statistics.mean(r["after"]) / r["median_step"]),
    }


def run_cases(args) -> None:
    """The cases of `--case` (see the module docstring); one JSON line of figures last."""
    cases = set(args.case.split(","))
    figures: dict[str, float] = {}
    instrument()
    with tempfile.TemporaryDirectory(prefix="ckptlab-bench-record-") as tmp:
        for name, fn in (("a", case_a), ("b", case_b), ("c", case_c), ("m", case_m), ("g", case_g)):
            if name in cases:
                figures.update(fn(args, Path(tmp)))
        if cases & {"e", "f"}:
            figures.update(case_ef(args, Path(tmp)))
    print("\nfigure                          value    target")
    checks = {
        "a_ratio_default": "a",
        "b_ratio_total": "b",
        "c_added_ms_default": "c",
        "e_peak_rss_ratio": "e",
        "m_ratio": "m",
        "g_ratio": "g",
    }
    for setting in args.ef_threads.split(","):
        prefix = "" if setting == "all" else setting
        checks[f"e{prefix}_peak_rss_ratio"] = "e"
        checks[f"f{prefix}_ckpt_step_ratio"] = "f"
    for key, value in figures.items():
        target = TARGETS.get(checks.get(key, ""))
        mark = "" if target is None else ("  ok" if value <= target else "  OVER")
        print(f"  {key:<30}{value:>8.3f}" + (f"  <= {target}{mark}" if target is not None else ""))
    print(json.dumps({k: round(v, 4) for k, v in figures.items()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--steps", type=int, default=None, help="steps per mode (default 300; --case: a, b 200, c 1000, e/f 8)"
    )
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument(
        "--ckpt-snapshot", default="live", choices=["live", "copy"], help="(e, f): the Recorder's ckpt_snapshot"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument(
        "--trackers",
        default="mlflow,wandb",
        help="live trackers of the last case: mlflow, wandb (offline), both (default; those installed), or none",
    )
    ap.add_argument("--accumulate", type=int, default=0, help="measure steps of this many micro-batches instead")
    ap.add_argument("--case", help="measure these cases instead (comma-separated: a,b,c,e,f,m,g)")
    ap.add_argument("--params", type=float, default=250e6, help="parameters of the e/f model (default 250e6)")
    ap.add_argument(
        "--ef-threads",
        default="all",
        help='torch threads for e/f, comma-separated: "all" (default), a number, or both ("1,all")',
    )
    ap.add_argument(
        "--ef-repeat",
        type=int,
        default=3,
        help="(f) recorded processes, one checkpoint step each; the figures are their medians (default 3)",
    )
    ap.add_argument(
        "--c-without",
        action="append",
        default=[],
        metavar="PARTS",
        help="(c) also measure the default mode leaving out these parts (step-record, batch, both "
        '"step-record,batch", or "encoding": both but their two writes; repeatable): an experiment '
        "measuring what is left",
    )
    ap.add_argument("--worker", choices=("bare", "recorded"), help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:  # e/f: peak RSS, with the allocator as it comes
        return worker(args.worker, args.steps, args.run_dir)
    steady_malloc()
    if args.case:
        return run_cases(args)
    args.steps = args.steps or 300
    if args.threads:
        torch.set_num_threads(args.threads)
    CFG.update(layers=args.layers, width=args.width, seq=args.seq)
    if args.accumulate:
        accumulation(args)
        return
    batches = make_batches(args.steps, args.batch)
    instrument()
    times: dict[str, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        bare_model, bare_opt = build()
        recorders = {}
        for mode, health_every in (("recorded, health_every=1", 1), ("recorded, health_every=10 (default)", 10)):
            model, opt = build()
            recorders[mode] = ckptlab.Recorder(
                Path(tmp) / f"health{health_every}",
                model,
                opt,
                step_fn=step,
                build_fn=build,
                ckpt_every=args.ckpt_every,
                health_every=health_every,
            )
        trackers = make_trackers(args.trackers, Path(tmp))
        if trackers:
            model, opt = build()
            mode = f"recorded + {'+'.join(t.kind for t in trackers)}"
            recorders[mode] = ckptlab.Recorder(
                Path(tmp) / "trackers",
                model,
                opt,
                step_fn=step,
                build_fn=build,
                ckpt_every=args.ckpt_every,
                trackers=trackers,
            )
        modes = ["bare", *recorders]
        for i, (batch, ids) in enumerate(batches):
            k = i % len(modes)
            for mode in modes[k:] + modes[:k]:  # rotate: no mode always runs first
                current["mode"] = mode
                t0 = time.perf_counter()
                if mode == "bare":
                    step(bare_model, bare_opt, batch)
                else:
                    recorders[mode].step(batch, sample_ids=ids)
                if i:  # the first step warms caches up
                    times[mode].append(time.perf_counter() - t0)
            if (i + 1) % 50 == 0:
                print(
                    f"step {i + 1}/{args.steps}: "
                    + ", ".join(f"{m} {statistics.median(t) * 1e3:.0f} ms" for m, t in times.items()),
                    flush=True,
                )
        for rec in recorders.values():
            rec.close()
        run_dir = recorders["recorded, health_every=1"].run_dir
        stored = {p: dir_size(run_dir / p) for p in ("batches", "journal", "checkpoints")}
        n_ckpt = len(ckptlab.open_run(run_dir).checkpoints)
    report(args, times, stored, n_ckpt)


def make_trackers(names: str, tmp: Path) -> list:
    """The live trackers asked for, those whose package is installed."""
    import importlib.util
    import os

    out = []
    wanted = set() if names == "none" else set(names.split(","))
    if "mlflow" in wanted and importlib.util.find_spec("mlflow"):
        from ckptlab.trackers import MLflow

        out.append(MLflow(tmp / "mlruns", experiment="bench"))
    if "wandb" in wanted and importlib.util.find_spec("wandb"):
        from ckptlab.trackers import WandB

        os.environ.setdefault("WANDB_SILENT", "true")
        out.append(WandB(project="bench", dir=tmp / "wandb", mode="offline"))
    return out


def print_phases(mode: str, steps: int, bare: float) -> None:
    """The Recorder's phases timed inside `mode`'s steps: the direct measurement of its cost,
    steadier on a noisy machine than the ratio of step times."""
    print(f"\nwhere the time goes, {mode} (mean per step; % of the bare median step):")
    phases = {p: v for (m, p), v in spent.items() if m == mode}
    for phase, total in sorted(phases.items(), key=lambda kv: -kv[1]):
        per = total / steps
        print(f"  {phase:<36}{per * 1e3:>8.2f} ms {per / bare * 100:>6.2f}%")
    total = sum(phases.values()) / steps
    print(f"  {'sum':<36}{total * 1e3:>8.2f} ms {total / bare * 100:>6.2f}%")


def report(args, times, stored, n_ckpt) -> None:
    bare = statistics.median(times["bare"])
    n_params = sum(p.numel() for p in build()[0].parameters())
    print(
        f"\nmodel: {args.layers} layers x {args.width} wide, vocab {VOCAB}, {n_params / 1e6:.2f}M parameters; "
        f"batch {args.batch} x {args.seq} tokens; {torch.get_num_threads()} threads; {args.steps} steps per mode; "
        f"checkpoint every {args.ckpt_every} steps"
    )
    print(f"{'mode':<38}{'median ms':>10}{'mean ms':>10}{'median ratio':>14}{'mean ratio':>12}")
    for mode, t in times.items():
        print(
            f"{mode:<38}{statistics.median(t) * 1e3:>10.1f}{statistics.mean(t) * 1e3:>10.1f}"
            f"{statistics.median(t) / bare:>13.3f}x{statistics.mean(t) / statistics.mean(times['bare']):>11.3f}x"
        )
    live = next((m for m in times if m.startswith("recorded + ")), None)
    if live is not None:
        base = times["recorded, health_every=10 (default)"]
        print(
            f"\nlive trackers ({live[len('recorded + ') :]}): median step {statistics.median(times[live]) / statistics.median(base):.3f}x, "
            f"mean {statistics.mean(times[live]) / statistics.mean(base):.3f}x the recorded run without them "
            "(the same health_every; the sending runs on a background thread)"
        )
    for mode in times:
        if mode != "bare":
            print_phases(mode, args.steps, bare)
    raw = args.batch * (args.seq + 1) * 8  # int64 token ids
    print(
        f"\nstored per step: batch log {stored['batches'] / args.steps:,.0f} B (raw batch {raw:,} B: "
        f"{stored['batches'] / args.steps / raw:.2f}x), journal {stored['journal'] / args.steps:,.0f} B; "
        f"{n_ckpt} checkpoints kept, {stored['checkpoints'] / 2**20:.1f} MiB"
    )


if __name__ == "__main__":
    main()
