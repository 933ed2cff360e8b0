"""Benchmark what the Recorder costs a training step on the CPU, each figure a ratio against a
bare run measured in the same invocation (machines here are shared and noisy: compare the
ratios, not the seconds).

Cases (docs/performance.md gives the targets):
  a  the 4-layer LM of scripts/bench_replay.py, 1 torch thread: bare, recorded with
     health_every=1 and with the defaults, interleaved step by step (median step ratio);
     plus where the remaining time goes (the Recorder's phases, timed inside the runs)
  b  the same with all threads and a checkpoint inside the timed window (ratio of the totals)
  c  a ~2 ms step (the LM at 1 layer x 64 wide): host time added per step, in ms
  e  peak RSS of a ~250M-parameter MLP (AdamW) recorded with health_every=1, over the steps
     after the first checkpoint, vs the same bare (one process each)
  f  in that run, the step that starts a checkpoint vs the median step

    PYTHONPATH=. python scripts/bench_record.py [--case a,b,c,e,f] [--steps N] [--params 250e6]

The last line of output is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
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
from ckptlab import record
from ckptlab.run import records
from ckptlab.run.layout import dir_size
from ckptlab.run.writer import RunWriter
from ckptlab.training.probe import PendingHealth, StepProbe

TARGETS = {"a": 1.02, "b": 1.04, "c": 0.25, "e": 1.10, "f": 1.5}


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
    "update-ratio sample + norms": [(StepProbe, "_on_pre_step"), (StepProbe, "_update_norms")],
    "step record (health, anomalies)": [
        (records, "encode_step"),
        (RunWriter, "append_step"),
        (record.Recorder, "_anomalies"),
    ],
    "RNG capture + compare": [(record, "capture_rng"), (record, "rng_equal")],
    "checkpoint capture (sync part)": [(record.Recorder, "_checkpoint")],
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


# --- cases a, b, c: bare and recorded runs of the LM, interleaved step by step ------------------


def interleaved(steps: int, batch: int, ckpt_every: int, health: dict[str, int], tmp: Path) -> dict[str, list[float]]:
    """Step times per mode ("bare" and each recorded mode), alternating step by step in
    rotating order, so each mode meets the same slow and fast moments of the machine."""
    batches = make_batches(steps, batch)
    times: dict[str, list[float]] = defaultdict(list)
    bare_model, bare_opt = build()
    recorders = {}
    for mode, health_every in health.items():
        model, opt = build()
        recorders[mode] = ckptlab.Recorder(
            tmp / mode.replace(" ", "_").replace(",", "").replace("=", ""),
            model,
            opt,
            step_fn=step,
            build_fn=build,
            ckpt_every=ckpt_every,
            health_every=health_every,
            on_anomaly=None,
        )
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
    instrument()
    health = {"recorded, health_every=1": 1, "recorded, default": 10}
    times = interleaved(args.steps or 200, 16, 100, health, tmp / "a")
    print("\n(a) 4-layer LM, 1 thread, batch 16 x 128, checkpoint every 100 steps")
    table(times, args.steps)
    bare = statistics.median(times["bare"])
    for mode in health:
        print(f"\n  where the time goes, {mode} (mean per step; % of the bare median step):")
        phases = {p: v for (m, p), v in spent.items() if m == mode}
        n = len(times[mode]) + 1
        for phase, total in sorted(phases.items(), key=lambda kv: -kv[1]):
            print(f"    {phase:<42}{total / n * 1e3:>8.3f} ms {total / n / bare * 100:>6.2f}%")
        print(f"    {'sum':<42}{sum(phases.values()) / n * 1e3:>8.3f} ms")
    run_dir = Path(times["_run_dir"][0])
    stored = {p: dir_size(run_dir / p) for p in ("batches", "journal", "checkpoints")}
    print(
        f"\n  stored per step (health_every=1): batch log {stored['batches'] / (args.steps or 200):,.0f} B, "
        f"journal {stored['journal'] / (args.steps or 200):,.0f} B"
    )
    return {
        "a_ratio_default": statistics.median(times["recorded, default"]) / bare,
        "a_ratio_health_every_1": statistics.median(times["recorded, health_every=1"]) / bare,
    }


def case_b(args, tmp: Path) -> dict:
    torch.set_num_threads(os.cpu_count() or 1)
    CFG.update(layers=4, width=256, seq=128)
    steps = args.steps or 200
    times = interleaved(steps, 16, steps // 2, {"recorded, default": 10}, tmp / "b")
    print(f"\n(b) 4-layer LM, {torch.get_num_threads()} threads, a checkpoint at step {steps // 2} (inside the window)")
    table(times, steps)
    return {"b_ratio_total": sum(times["recorded, default"]) / sum(times["bare"])}


def case_c(args, tmp: Path) -> dict:
    torch.set_num_threads(1)
    CFG.update(layers=1, width=64, seq=32)
    steps = args.steps * 5 if args.steps else 1000
    times = interleaved(steps, 4, 10**9, {"recorded, default": 10, "recorded, health_every=1": 1}, tmp / "c")
    print("\n(c) a fast step: the LM at 1 layer x 64 wide, batch 4 x 32, 1 thread")
    table(times, steps)
    bare = statistics.median(times["bare"])
    return {
        "c_bare_ms": bare * 1e3,
        "c_added_ms_default": (statistics.median(times["recorded, default"]) - bare) * 1e3,
        "c_added_ms_health_every_1": (statistics.median(times["recorded, health_every=1"]) - bare) * 1e3,
    }


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


def worker(mode: str, steps: int, run_dir: str) -> None:
    """One process: `steps` steps; the peak RSS over steps 2.. (after the first checkpoint is
    committed); then one more step that starts a checkpoint (recorded), timed."""
    torch.set_num_threads(os.cpu_count() or 1)
    model, opt = build_big()
    width = model[0].in_features
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, width, generator=g), torch.randn(32, width, generator=g)) for _ in range(steps + 1)]
    rec = None
    if mode == "recorded":
        rec = ckptlab.Recorder(
            run_dir, model, opt, step_fn=step_big, build_fn=build_big, ckpt_every=steps, health_every=1, on_anomaly=None
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
    if rec is not None:
        rec.close()
    n_params = sum(p.numel() for p in model.parameters())
    print(
        json.dumps(
            {"peak_kib": peak, "median_step": statistics.median(times[2:]), "ckpt_step": ckpt_step, "params": n_params}
        )
    )


def case_ef(args, tmp: Path) -> dict:
    env = {**os.environ, "CKPTLAB_BENCH_PARAMS": str(args.params), "PYTHONPATH": os.pathsep.join(sys.path)}
    steps = max(args.steps or 8, 4)
    out = {}
    for mode in ("bare", "recorded"):
        done = subprocess.run(
            [sys.executable, __file__, "--worker", mode, "--steps", str(steps), "--run-dir", str(tmp / "ef")],
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise SystemExit(f"the {mode} worker failed:\n{done.stderr[-3000:]}")
        out[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    bare, rec = out["bare"], out["recorded"]
    print(f"\n(e, f) MLP of {rec['params'] / 1e6:.0f}M parameters, AdamW, health_every=1, {steps} steps per process")
    print(
        f"  peak RSS after the first checkpoint: bare {bare['peak_kib'] / 2**20:.2f} GiB, "
        f"recorded {rec['peak_kib'] / 2**20:.2f} GiB"
    )
    print(
        f"  median step {rec['median_step']:.3f} s (bare {bare['median_step']:.3f} s); "
        f"the step that starts a checkpoint {rec['ckpt_step']:.3f} s"
    )
    return {
        "e_peak_rss_ratio": rec["peak_kib"] / bare["peak_kib"],
        "f_ckpt_step_ratio": rec["ckpt_step"] / rec["median_step"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="a,b,c,e,f", help="comma-separated cases (default: all)")
    ap.add_argument("--steps", type=int, default=0, help="steps per mode (default: a, b 200; c 1000; e/f 8)")
    ap.add_argument("--params", type=float, default=250e6, help="parameters of the e/f model (default 250e6)")
    ap.add_argument("--worker", choices=("bare", "recorded"), help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.run_dir)
    cases = set(args.case.split(","))
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="ckptlab-bench-record-") as tmp:
        for name, fn in (("a", case_a), ("b", case_b), ("c", case_c)):
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
        "f_ckpt_step_ratio": "f",
    }
    for key, value in figures.items():
        target = TARGETS.get(checks.get(key, ""))
        mark = "" if target is None else ("  ok" if value <= target else "  OVER")
        print(f"  {key:<30}{value:>8.3f}" + (f"  <= {target}{mark}" if target is not None else ""))
    print(json.dumps({k: round(v, 4) for k, v in figures.items()}))


if __name__ == "__main__":
    main()
