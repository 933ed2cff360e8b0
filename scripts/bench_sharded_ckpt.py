"""How long a checkpoint of sharded training stalls it, and what memory it takes: FSDP2 written
on the training thread (`async_sharded=False`, mode "sync") or staged and written in the
background (the default, "async"); DeepSpeed's engine with ZeRO stage 1, 2 or 3 ("zero1",
"zero2", "zero3": each rank's partitions staged and written in the background through DCP, as
FSDP2's shards are: training/zero_parts.py; "zero2-sync" and the like: written on the training
thread, `async_sharded=False`).

    python scripts/bench_sharded_ckpt.py                  # 2 processes, gloo, ~25M parameters
    python scripts/bench_sharded_ckpt.py --hidden 1024 --steps 30
    python scripts/bench_sharded_ckpt.py --modes async,zero2,zero3
    python scripts/bench_sharded_ckpt.py --engine fsdp1   # sync/async with FSDP1 (use_orig_params=True), a unit per layer

Each mode runs in its own `torchrun` of 2 CPU processes (one torch thread each), recording an
MLP with AdamW and a checkpoint every 10 steps. It prints, per mode, the median step, the step
that starts a checkpoint and the step after it (where a background write commits), each as a
ratio to the median step, and what a checkpoint adds to each rank's memory: its peak RSS over
the checkpoint's step and the next (reset before them, /proc/self/clear_refs) above the RSS
before them, as a multiple of the whole training state (fp32 weights and AdamW's two moments of
all ranks); then one JSON line.
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
import json, os, sys, time
sys.path.insert(0, {root!r})
import torch, torch.distributed as dist, torch.nn as nn
import ckptlab

HIDDEN, LAYERS, MODE, ENGINE = {hidden}, {layers}, {mode!r}, {engine!r}

def build():
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS)])
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    if MODE.startswith("zero"):
        import deepspeed

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # (inference only; ~1 min of gcc)
        config = {{"train_micro_batch_size_per_gpu": 8, "zero_optimization": {{"stage": int(MODE[4])}}}}
        engine, opt, _, _ = deepspeed.initialize(model=m, optimizer=opt, config=config)
        return engine, opt
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

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
    if MODE.startswith("zero"):
        model.backward(loss)
        model.step()
        return loss
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
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    extra = 0  # the most a checkpoint (its step and the next, where it commits) raised RSS above its start
    with ckptlab.Recorder({run!r}, model, opt, step_fn=step, build_fn=build, ckpt_every=10, on_anomaly=None,
                          async_sharded=not MODE.endswith("sync")) as rec:
        for s in range({steps}):
            x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(s * 2 + rank))
            if s % 10 == 0 and s:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # VmHWM := VmRSS
                before = status("VmRSS")
            dist.barrier()
            t0 = time.perf_counter()
            rec.step(x)
            times.append(time.perf_counter() - t0)
            if s % 10 == 1 and s > 1:
                extra = max(extra, status("VmHWM") - before)
    extras = [None, None]
    dist.all_gather_object(extras, extra)
    if rank == 0:
        print("TIMES " + json.dumps({{"times": times, "ckpt_rss": extras}}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # (gloo can abort at the interpreter's exit)
"""


def run_mode(args, mode: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="ckptlab-bench-") as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(
            WORKER.format(
                root=str(ROOT),
                hidden=args.hidden,
                layers=args.layers,
                run=str(Path(tmp) / "run"),
                mode=mode,
                engine=args.engine,
                steps=args.steps,
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
        line = next(x for x in out.stdout.splitlines() if x.startswith("TIMES "))
        return json.loads(line[len("TIMES ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--steps", type=int, default=31)
    ap.add_argument("--modes", default="sync,async", help="of sync, async, zero1, zero2, zero3, zero1-sync, ...")
    ap.add_argument("--engine", choices=("fsdp2", "fsdp1"), default="fsdp2", help="what sync and async shard with")
    args = ap.parse_args()
    params = args.layers * (args.hidden * args.hidden + args.hidden)
    print(f"MLP, {params / 1e6:.1f}M parameters (AdamW), 2 processes, checkpoints at steps 10, 20, 30")
    result: dict = {"params": params, "date": time.strftime("%Y-%m-%d")}
    for mode in args.modes.split(","):
        got = run_mode(args, mode)
        times = got["times"]
        ckpt = [s for s in (10, 20) if s + 1 < len(times)]
        normal = [t for s, t in enumerate(times) if s > 1 and s % 10 not in (0, 1)]
        med = statistics.median(normal)
        start = statistics.median(times[s] / med for s in ckpt)
        after = statistics.median(times[s + 1] / med for s in ckpt)
        state = params * 4 * 3  # fp32 weights and AdamW's two moments, all ranks together
        extra = [x / state for x in got["ckpt_rss"]]
        line = f"{mode:10s}  median step {med * 1e3:7.1f} ms   checkpoint step {start:5.2f}x   next step {after:5.2f}x"
        line += "   checkpoint RSS, ranks 0, 1: +" + ", +".join(f"{x:.2f}" for x in extra) + " x the training state"
        result[mode] = {"median_step_s": med, "checkpoint_step_x": start, "next_step_x": after, "ckpt_rss_x": extra}
        print(line, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
