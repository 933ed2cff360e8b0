"""What starting a distributed replay's ranks costs: forked from ckptlab's fork server (the
default where the platform has one: ckptlab/replayer/workers.py) against spawned (each rank a
fresh interpreter that imports torch), on a small W-process DDP run (gloo, CPU), the replay
repeated R times in one Python process (the API in a notebook, a test suite).

    python scripts/bench_rank_start.py                 # 2 processes, 5 replays each way
    python scripts/bench_rank_start.py --world 4 --repeat 3

It records the run once (scripts/bench_fold.py's recording, an MLP of 0.1M parameters: start-up
dominates), then, in a process of its own for each way, replays step 12 R times without the trace
and the counterfactuals. It prints the first replay's wall time (the fork server starts there),
the median of the others, the CPU time of the whole process tree (the replaying process, the
server and every rank, all waited for), the ratios forked/spawned, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fold import NAN_STEP, RECORD  # noqa: E402  (one recording script for both benchmarks)

REPLAYS = r"""
import json, multiprocessing.forkserver, resource, statistics, sys, time
sys.path.insert(0, {root!r})
import ckptlab
from ckptlab.replayer import workers

def main():
    if {method!r} == "spawn":
        workers.start_method = lambda: "spawn"  # the baseline: what replay did before the server
    times = []
    for _ in range({repeat}):
        t0 = time.perf_counter()
        r = ckptlab.replay(sys.argv[1], {nan_step}, trace=False, counterfactuals=False, budget=0)
        times.append(time.perf_counter() - t0)
        assert r.root_step == {nan_step} and r.rank == 1, r.verdict
    multiprocessing.forkserver._forkserver._stop()  # (waited for: its CPU, and its ranks', counted below)
    cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    print(json.dumps({{"first_s": times[0], "rest_s": statistics.median(times[1:] or times), "cpu_s": cpu}}))

if __name__ == "__main__":
    main()
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    a = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CKPTLAB_TRUST_RUN_CODE": "1"}
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        rec = Path(tmp) / "record.py"
        rec.write_text(RECORD.format(root=str(ROOT), hidden=a.hidden, fsdp=False, nan_step=NAN_STEP))
        run = Path(tmp) / "run"
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.world}"]
        done = subprocess.run([*torchrun, str(rec), str(run)], cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"recording failed: {done.stderr[-3000:]}")
        for method in ("spawn", "forkserver"):
            script = REPLAYS.format(root=str(ROOT), method=method, repeat=a.repeat, nan_step=NAN_STEP)
            done = subprocess.run(
                [sys.executable, "-c", script, str(run)], cwd=ROOT, env=env, capture_output=True, text=True
            )
            if done.returncode != 0:
                raise SystemExit(f"replay ({method}) failed: {done.stderr[-3000:]}")
            got[method] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{a.world}-process DDP run, step {NAN_STEP} replayed {a.repeat} times in one process")
    for method, doc in got.items():
        print(
            f"  {method:10s} first {doc['first_s']:5.2f} s  then {doc['rest_s']:5.2f} s each  CPU {doc['cpu_s']:6.1f} s"
        )
    s, f = got["spawn"], got["forkserver"]
    ratios = {k: f[k] / s[k] for k in ("first_s", "rest_s", "cpu_s")}
    print("  forked/spawned: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    print(json.dumps({"world": a.world, "repeat": a.repeat, "spawn": s, "forkserver": f, "ratios": ratios}))


if __name__ == "__main__":
    main()
