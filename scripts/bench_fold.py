"""What `replay --world-size K` costs against the replay on the recorded processes: the wall time
of each and the peak memory of all its processes together, on a W-process DDP or FSDP2 run
(gloo, CPU).

    python scripts/bench_fold.py                     # 4 processes, an MLP of ~4M parameters
    python scripts/bench_fold.py --world 2 --hidden 512
    python scripts/bench_fold.py --fsdp --sizes 1,2  # FSDP2 (each layer and the whole fully_shard-ed)

It records the run once (`torchrun`, one torch thread per process, AdamW, a checkpoint every 5
steps, a NaN in rank 1's batch at step 12), then replays step 12 both ways, each in a process of
its own, without the trace and the counterfactuals (the window's replay only: what the fold
changes; the root step's explanation runs in one process either way). Memory: the sum of the RSS
of the replay's process and its children (the ranks it spawns), sampled every 20 ms, peak. It
prints each, the ratios fold/full, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAN_STEP = 12

RECORD = r"""
import sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
import ckptlab

HIDDEN, FSDP = {hidden}, {fsdp}

def build():
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, 1))
    if FSDP:
        for layer in model[::2]:
            fully_shard(layer)
        fully_shard(model)
    else:
        model = DDP(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

def step(model, opt, batch):
    x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss

if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model, opt = build()
    with ckptlab.Recorder(sys.argv[1], model, opt, step_fn=step, build_fn=build, ckpt_every=5, on_anomaly=None) as rec:
        for s in range({nan_step} + 1):
            g = torch.Generator().manual_seed(1000 * rank + s)
            x, y = torch.randn(64, 256, generator=g), torch.randn(64, 1, generator=g)
            if (s, rank) == ({nan_step}, 1):
                x[3, 0] = float("nan")
            try:
                rec.step((x, y), sample_ids=list(range(64 * s, 64 * s + 64)))
            except ckptlab.NonFiniteLoss:
                break
    dist.barrier()
    dist.destroy_process_group()
"""

REPLAY = r"""
import json, sys, time
sys.path.insert(0, {root!r})
import ckptlab
t0 = time.perf_counter()
r = ckptlab.replay(sys.argv[1], {nan_step}, trace=False, counterfactuals=False, budget=0, world_size={size})  # (None: the recorded size)
print(json.dumps({{"s": time.perf_counter() - t0, "root": r.root_step, "rank": r.rank, "agreement": r.agreement}}))
"""


def _tree_rss(pid: int) -> int:
    """RSS bytes of `pid` and every process below it."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += int((Path(f"/proc/{p}/statm")).read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            pass
        todo += children.get(p, [])
    return total


def _measured(args: list[str], env: dict) -> tuple[dict, int]:
    """(the JSON the command printed last, the peak RSS of its process tree)."""
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{args}: exit code {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1]), peak[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--fsdp", action="store_true", help="an FSDP2 run (fully_shard) instead of DDP")
    ap.add_argument("--sizes", default="1", help="the --world-size values to fold onto, comma-separated (default 1)")
    ap.add_argument("--fold-only", action="store_true", help="replay with --world-size K only (no full replay)")
    a = ap.parse_args()
    sizes = [int(k) for k in a.sizes.split(",")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CKPTLAB_TRUST_RUN_CODE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        rec = Path(tmp) / "record.py"
        rec.write_text(RECORD.format(root=str(ROOT), hidden=a.hidden, fsdp=a.fsdp, nan_step=NAN_STEP))
        run = Path(tmp) / "run"
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.world}"]
        done = subprocess.run([*torchrun, str(rec), str(run)], cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"recording failed: {done.stderr[-3000:]}")
        sys.path.insert(0, str(ROOT))
        from ckptlab import open_run
        from ckptlab.replayer.fold import process_bytes

        estimate = process_bytes(open_run(run), NAN_STEP)  # what the fold checks before it starts
        got = {}
        runs = ([] if a.fold_only else [("full", None)]) + [(f"fold{k}", k) for k in sizes]
        for name, size in runs:
            script = REPLAY.format(root=str(ROOT), nan_step=NAN_STEP, size=size)
            got[name] = _measured([sys.executable, "-c", script, str(run)], env)
    params = 256 * a.hidden + a.hidden + a.hidden * a.hidden + a.hidden + a.hidden + 1
    kind = "FSDP2" if a.fsdp else "DDP"
    print(f"{a.world}-process {kind} run, {params / 1e6:.1f}M parameters, replay of step {NAN_STEP} from checkpoint 10")
    for name, (doc, rss) in got.items():
        print(
            f"  {name:6s} {doc['s']:6.1f} s  peak RSS {rss / 2**20:7.0f} MiB  root {doc['root']} rank {doc['rank']}  {doc['agreement']}"
        )
    print(f"  the fold's estimate of a process (fold.process_bytes): {estimate / 2**20:.0f} MiB")
    summary = {"world": a.world, "kind": kind, "params": params, "estimate_mib": estimate / 2**20}
    summary |= {f"{name}_s": doc["s"] for name, (doc, _) in got.items()}
    summary |= {f"{name}_rss_mib": rss / 2**20 for name, (_, rss) in got.items()}
    if "full" in got:
        full, full_rss = got["full"]
        for k in sizes:
            fold, fold_rss = got[f"fold{k}"]
            print(f"  fold{k}/full: time {fold['s'] / full['s']:.2f}x, memory {fold_rss / full_rss:.2f}x")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
