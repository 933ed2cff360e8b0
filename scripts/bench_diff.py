"""Benchmark `ckptlab diff` against the raw read and a naive torch baseline.

    python scripts/bench_diff.py                 # two ~1 GB checkpoints per scenario, in /tmp
    python scripts/bench_diff.py --gb 0.25 --repeat 1 --scenario fp32-safetensors
    python scripts/bench_diff.py --scenario fp32-safetensors --repeat 7 --no-naive --against /tmp/old

For each scenario (fp32 safetensors, bf16 .pt) it writes checkpoints A and B of a GPT-like
model (B = A after a small update, with one exploded, one NaN, one frozen parameter), then
measures, each in a fresh process, with a warm page cache:
  raw     `cat A B > /dev/null`: what reading the bytes costs
  naive   torch.load / load_file both, then a Python loop of per-tensor torch ops
  ckptlab ckptlab.diff(A, B), after the imports (start-up excluded)
and prints GB/s of checkpoint bytes (A + B), the ratios to raw, peak RSS above the interpreter
(after imports; the proportional set size of it and its worker processes, polled every 10 ms)
and CPU use (user+sys / wall, worker processes included: ~2.0 means both cores).

Start-up is measured apart, once: the wall time of `python -m ckptlab diff a.safetensors
b.safetensors` on two 4x4 float32 files, each a fresh process (interpreter, imports, reading,
rendering; a safetensors diff never imports torch). Then per scenario, `ckptlab diff` end to
end is start-up + compute. Files are deleted at the end. Timings on a shared machine are noisy:
the best and the median of --repeat are shown.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MEASURE = r"""
import glob, json, os, resource, sys, threading, time
sys.path.insert(0, {root!r})
kind, a, b = sys.argv[1:4]
# What `ckptlab diff` itself imports: a safetensors diff never imports torch (and ckptlab's
# pass counts with torch only where it is loaded anyway); the naive loop needs it.
if kind != "ckptlab" or not a.endswith(".safetensors"):
    import torch, safetensors.torch
import ckptlab, ckptlab.analysis.diff
def pss_kb():
    # This process and its worker processes, pages they share counted once (split among them).
    pids = [os.getpid()]
    for f in glob.glob("/proc/self/task/*/children"):
        try:
            pids += open(f).read().split()
        except OSError:  # (a thread that ended)
            pass
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{{pid}}/smaps_rollup") as f:
                total += next(int(l.split()[1]) for l in f if l.startswith("Pss:"))
        except (OSError, StopIteration):
            pass
    return total
peak = [pss_kb()]
base = peak[0]
done = threading.Event()
def poll():
    while not done.wait(0.01):
        peak[0] = max(peak[0], pss_kb())
threading.Thread(target=poll, daemon=True).start()
r0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
if kind == "ckptlab":
    findings = ckptlab.diff(a, b)
    extra = {{"verdict": findings.verdict.parameter if findings.verdict else None, "flagged": findings.summary["flagged"]}}
else:  # naive: load both whole, then one torch pass per statistic per tensor
    load = safetensors.torch.load_file if a.endswith(".safetensors") else (lambda p: torch.load(p, weights_only=True)["model"])
    sa, sb = load(a), load(b)
    worst = None
    for name, x in sa.items():
        y = sb[name].float(); x = x.float(); d = y - x
        row = dict(nan=int(torch.isnan(y).sum()), inf=int(torch.isinf(y).sum()), mean=float(y.mean()), std=float(y.std()),
                   absmax=float(y.abs().max()), na=float(x.norm()), nb=float(y.norm()), nd=float(d.norm()),
                   same=float((d == 0).float().mean()), dmax=int(d.abs().argmax()), q=torch.quantile(y.reshape(-1)[:1 << 20], 0.5).item())
        worst = max(worst or (0, name), (row["nd"] / max(row["na"], 1e-30), name))
    extra = {{"verdict": worst[1]}}
wall = time.perf_counter() - t0
done.set()
r1, c1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
cpu = sum(getattr(x1, f) - getattr(x0, f) for x0, x1 in ((r0, r1), (c0, c1)) for f in ("ru_utime", "ru_stime"))
# Peak memory: the proportional set size (Pss) of this process and its worker processes,
# polled every 10 ms, above this process's after the imports (pages the workers share with
# it counted once). For one process it is its RSS; the polling misses peaks under 10 ms.
extra["torch"] = "torch" in sys.modules
extra["worker_processes"] = c1.ru_utime > 0
print(json.dumps({{"wall": wall, "cpu": cpu, "peak_kb_above": peak[0] - base, **extra}}))
"""


def make_checkpoints(folder: Path, scenario: str, gb: float) -> tuple[Path, Path]:
    import safetensors.torch
    import torch

    dtype = torch.float32 if scenario.startswith("fp32") else torch.bfloat16
    target = int(gb * 1e9 / dtype.itemsize)  # elements per checkpoint
    d = 2048
    per_block = 12 * d * d + 13 * d
    vocab = 32000
    blocks = max(1, (target - vocab * d) // per_block)
    g = torch.Generator().manual_seed(0)
    a, b = {}, {}

    def add(name, *shape, scale=0.02):
        x = torch.randn(*shape, generator=g) * scale
        a[name] = x.to(dtype)
        b[name] = (x + 1e-3 * scale * torch.randn(*shape, generator=g)).to(dtype)

    add("wte.weight", vocab, d)
    for i in range(blocks):
        p = f"blocks.{i}."
        add(p + "ln1.weight", d, scale=1.0)
        add(p + "attn.qkv.weight", 3 * d, d)
        add(p + "attn.qkv.bias", 3 * d)
        add(p + "attn.proj.weight", d, d)
        add(p + "ln2.weight", d, scale=1.0)
        add(p + "mlp.fc.weight", 4 * d, d)
        add(p + "mlp.fc.bias", 4 * d)
        add(p + "mlp.proj.weight", d, 4 * d)
    b[f"blocks.{blocks // 2}.mlp.fc.weight"] = a[f"blocks.{blocks // 2}.mlp.fc.weight"] * 1e4  # exploded
    b["blocks.0.attn.proj.weight"][7, 7] = float("nan")
    b[f"blocks.{blocks - 1}.ln2.weight"] = a[f"blocks.{blocks - 1}.ln2.weight"].clone()  # frozen
    if scenario.endswith("safetensors"):
        pa, pb = folder / "a.safetensors", folder / "b.safetensors"
        safetensors.torch.save_file(a, pa)
        safetensors.torch.save_file(b, pb)
    else:
        pa, pb = folder / "a.pt", folder / "b.pt"
        torch.save({"model": a, "step": 1000}, pa)
        torch.save({"model": b, "step": 1100}, pb)
    return pa, pb


def run_measure(kind: str, a: Path, b: Path, root: Path = ROOT) -> dict:
    script = MEASURE.format(root=str(root))
    out = subprocess.run([sys.executable, "-c", script, kind, str(a), str(b)], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{kind} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def raw_read(a: Path, b: Path) -> float:
    t = time.perf_counter()
    subprocess.run(f"cat {a} {b} > /dev/null", shell=True, check=True)
    return time.perf_counter() - t


def startup(folder: Path, repeat: int) -> dict:
    """Wall time of `ckptlab diff` of two tiny safetensors files, each run a fresh process."""
    import numpy as np
    import safetensors.numpy

    a, b = folder / "tiny-a.safetensors", folder / "tiny-b.safetensors"
    safetensors.numpy.save_file({"w": np.ones((4, 4), np.float32)}, a)
    safetensors.numpy.save_file({"w": np.full((4, 4), 2.0, np.float32)}, b)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "ckptlab", "diff", str(a), str(b)]
    subprocess.run(command, env=env, capture_output=True, check=True)  # warm the file cache (.pyc, libraries)
    walls = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(command, env=env, capture_output=True, check=True)
        walls.append(time.perf_counter() - t)
    best, median = min(walls), statistics.median(walls)
    print(
        f"\n== start-up: `ckptlab diff` of two 4x4 safetensors files, fresh process: best {best:.2f} s, median {median:.2f} s"
    )
    return {"best_s": best, "median_s": median}


def bench(
    scenario: str, gb: float, repeat: int, folder: Path, start: dict, against: Path | None = None, naive: bool = True
) -> dict:
    t = time.perf_counter()
    # In a child process: a parent that held the tensors would stay big (and skew the machine).
    subprocess.run([sys.executable, __file__, "--make", scenario, str(gb), str(folder)], check=True)
    a, b = (folder / f"{x}.{'safetensors' if scenario.endswith('safetensors') else 'pt'}" for x in "ab")
    os.sync()  # no writeback of the fresh files during the measurements
    nbytes = a.stat().st_size + b.stat().st_size
    print(f"\n== {scenario}: A + B = {nbytes / 1e9:.2f} GB (written in {time.perf_counter() - t:.0f} s)", flush=True)
    raw_read(a, b)  # warm the page cache
    results: dict[str, list[dict]] = {"raw": [], "naive": [], "ckptlab": [], "against": []}
    for _ in range(repeat):  # interleaved: a slow minute slows every method alike
        results["raw"].append({"wall": raw_read(a, b), "cpu": None, "peak_kb_above": None})
        if naive:
            results["naive"].append(run_measure("naive", a, b))
        results["ckptlab"].append(run_measure("ckptlab", a, b))
        if against is not None:
            results["against"].append(run_measure("ckptlab", a, b, root=against))
    results = {k: v for k, v in results.items() if v}
    best_raw = min(r["wall"] for r in results["raw"])
    print(
        f"{'':8} {'best s':>7} {'median s':>8} {'GB/s':>6} {'x raw':>6} {'peak RSS':>9} {'CPU':>5} {'GB/cpu-s':>8}  verdict"
    )
    summary = {}
    for kind, rows in results.items():
        walls = [r["wall"] for r in rows]
        best = min(rows, key=lambda r: r["wall"])
        rss = f"{best['peak_kb_above'] / 1024:.0f} MB" if best["peak_kb_above"] is not None else ""
        cpu = f"{best['cpu'] / best['wall']:.2f}" if best["cpu"] is not None else ""
        # GB per CPU-second: what one core does, whatever else the machine was running
        per_cpu = f"{nbytes / min(r['cpu'] for r in rows) / 1e9:.2f}" if best["cpu"] is not None else ""
        print(
            f"{kind:8} {min(walls):7.2f} {statistics.median(walls):8.2f} {nbytes / min(walls) / 1e9:6.2f} "
            f"{min(walls) / best_raw:6.1f} {rss:>9} {cpu:>5} {per_cpu:>8}  {best.get('verdict', '')}"
            + (" (torch imported)" if kind in ("ckptlab", "against") and best.get("torch") else "")
        )
        summary[kind] = {
            "best_s": min(walls),
            "median_s": statistics.median(walls),
            "gb_per_s": nbytes / min(walls) / 1e9,
            "x_raw": min(walls) / best_raw,
            **{k: v for k, v in best.items() if k != "wall"},
        }
    # What a user waits for: the process start-up plus the compute, both against the raw read.
    compute = summary["ckptlab"]["best_s"]
    summary["ckptlab"]["end_to_end_s"] = start["best_s"] + compute
    print(
        f"ckptlab diff: compute {compute:.2f} s = {compute / best_raw:.1f}x raw (start-up excluded); "
        f"start-up {start['best_s']:.2f} s + compute = {start['best_s'] + compute:.2f} s end to end "
        f"= {(start['best_s'] + compute) / best_raw:.1f}x raw"
    )
    for p in (a, b):
        p.unlink()
    return summary


def main() -> None:
    if sys.argv[1:2] == ["--make"]:  # the child that writes one scenario's checkpoints
        make_checkpoints(Path(sys.argv[4]), sys.argv[2], float(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0, help="size of each checkpoint in GB (default 1)")
    ap.add_argument("--repeat", type=int, default=3, help="measurements per method (default 3)")
    ap.add_argument("--scenario", action="append", choices=["fp32-safetensors", "bf16-pt"], help="default: both")
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: a new folder in /tmp)")
    ap.add_argument("--json", action="store_true", help="also print the results as JSON")
    ap.add_argument(
        "--against",
        type=Path,
        help="another checkout of ckptlab (e.g. `git worktree add /tmp/old COMMIT`): its diff is measured "
        "too, taking turns with this one (row 'against')",
    )
    ap.add_argument("--no-naive", action="store_true", help="skip the naive torch loop (the slowest part)")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="ckptlab-bench-", dir=args.dir))
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (other work on this machine skews timings)")
    try:
        start = startup(folder, args.repeat)
        results = {"startup": start}
        for s in args.scenario or ["fp32-safetensors", "bf16-pt"]:
            results[s] = bench(s, args.gb, args.repeat, folder, start, args.against, not args.no_naive)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
