"""How long a sharded checkpoint stalls training: written on the training thread
(`async_sharded=False`) or staged and written in the background (the default).

    python scripts/bench_sharded_ckpt.py                  # 2 processes, gloo, ~25M parameters
    python scripts/bench_sharded_ckpt.py --hidden 1024 --steps 30
    python scripts/bench_sharded_ckpt.py --engine fsdp1   # FSDP1 (use_orig_params=True), a unit per layer

Each mode runs in its own `torchrun` of 2 CPU processes (one torch thread each), recording an
FSDP2 (or FSDP1) MLP with AdamW and a checkpoint every 10 steps. It prints, per mode, the
median step, the step that starts a checkpoint and the step after it (where a background
write commits), each as a ratio to the median step, rank 0's peak resident memory, and one
JSON line.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORKER = r"""
import json, os, resource, sys, time
sys.path.insert(0, {root!r})
import torch, torch.distributed as dist, torch.nn as nn
import ckptlab
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

HIDDEN, LAYERS, ENGINE = {hidden}, {layers}, {engine!r}

def build():
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS)])
    if ENGINE == "fsdp1":
        policy = ModuleWrapPolicy({{nn.Linear}})
        m = FullyShardedDataParallel(m, device_id=torch.device("cpu"), use_orig_params=True, auto_wrap_policy=policy)
    else:
        for layer in m:
            fully_shard(layer)
        fully_shard(m)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-4)

def step(model, opt, batch):
    loss = model(batch).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss

if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model, opt = build()
    times = []
    with ckptlab.Recorder({run!r}, model, opt, step_fn=step, build_fn=build, ckpt_every=10, on_anomaly=None,
                          async_sharded={async_!r}) as rec:
        for s in range({steps}):
            x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(s * 2 + rank))
            dist.barrier()
            t0 = time.perf_counter()
            rec.step(x)
            times.append(time.perf_counter() - t0)
    if rank == 0:
        print("TIMES " + json.dumps(times), flush=True)
        print("PEAK_KB " + str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss), flush=True)
    dist.destroy_process_group()
"""


def run_mode(args, async_: bool) -> tuple[list[float], int]:
    with tempfile.TemporaryDirectory(prefix="ckptlab-bench-") as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(
            WORKER.format(
                root=str(ROOT),
                hidden=args.hidden,
                layers=args.layers,
                run=str(Path(tmp) / "run"),
                async_=async_,
                steps=args.steps,
                engine=args.engine,
            )
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        out = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
            capture_output=True,
            text=True,
            env=env,
            timeout=1200,
        )
        if out.returncode:
            sys.exit(f"worker failed:\n{out.stderr[-3000:]}")
        lines = out.stdout.splitlines()
        times = json.loads(next(x for x in lines if x.startswith("TIMES "))[len("TIMES ") :])
        return times, int(next(x for x in lines if x.startswith("PEAK_KB ")).split()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--steps", type=int, default=31)
    ap.add_argument("--engine", choices=("fsdp2", "fsdp1"), default="fsdp2")
    args = ap.parse_args()
    params = args.layers * (args.hidden * args.hidden + args.hidden)
    print(f"{args.engine.upper()} MLP, {params / 1e6:.1f}M parameters (AdamW), 2 processes, checkpoints every 10 steps")
    result = {"engine": args.engine, "params": params, "date": time.strftime("%Y-%m-%d")}
    for name, async_ in (("sync", False), ("async", True)):
        times, peak_kb = run_mode(args, async_)
        ckpt = [s for s in (10, 20) if s + 1 < len(times)]
        normal = [t for s, t in enumerate(times) if s > 1 and s % 10 not in (0, 1)]
        med = statistics.median(normal)
        start = statistics.median(times[s] / med for s in ckpt)
        after = statistics.median(times[s + 1] / med for s in ckpt)
        print(
            f"{name:5s}  median step {med * 1e3:7.1f} ms   checkpoint step {start:5.2f}x   next step {after:5.2f}x"
            f"   rank 0 peak {peak_kb / 1024:6.0f} MiB"
        )
        result[name] = {
            "median_step_s": med,
            "checkpoint_step_x": start,
            "next_step_x": after,
            "peak_mib": peak_kb / 1024,
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
