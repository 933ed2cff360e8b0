"""How much the diff's per-chunk work gains from a second thread, and from a second process.

    python scripts/bench_stream_workers.py            # 16M float32 pairs, 6 rounds per setting

The work is what `ckptlab diff` does per segment of a float32 tensor pair
(`PairAccumulator.add`), on arrays already in memory (no file reads). It is timed
three ways in one run: one worker doing it `--rounds` times; two threads each doing it
`--rounds` times at once; two forked processes each doing it `--rounds` times at once. The
printed gain is work done per second against one worker: 2.0 would be two whole cores.
Threads share the GIL, which each of the ~20 numpy calls per chunk (and `np.bincount`, the
whole time it counts) must hold; processes do not (ckptlab/io/stream.py forks them for a
large diff). Figures: docs/performance.md ("Worker processes").
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckptlab.stats.kernels import count_without_torch  # noqa: E402
from ckptlab.stats.pair import PairAccumulator  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=1 << 24, help="float32 pairs per round (default 16M)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per worker (default 6)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(args.pairs) * 0.02).astype(np.float32)
    b = a + (rng.standard_normal(args.pairs) * 2e-5).astype(np.float32)
    count_without_torch()
    piece = 1 << 23

    def work() -> None:
        for _ in range(args.rounds):
            acc = PairAccumulator("float32", "float32")
            for s in range(0, args.pairs, piece):
                acc.add(a[s : s + piece], b[s : s + piece], s)

    work()  # warm up (and build the codec tables before any fork)
    t0 = time.perf_counter()
    work()
    one = time.perf_counter() - t0

    threads = [threading.Thread(target=work) for _ in range(2)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    two_threads = time.perf_counter() - t0

    t0 = time.perf_counter()
    pids = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:
            try:
                work()
            finally:
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    two_processes = time.perf_counter() - t0

    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; {args.pairs:,} pairs x {args.rounds} rounds")
    print(f"one worker:      {one:6.2f} s")
    print(f"two threads:     {two_threads:6.2f} s for twice the work: {2 * one / two_threads:.2f}x one worker's rate")
    print(
        f"two processes:   {two_processes:6.2f} s for twice the work: {2 * one / two_processes:.2f}x one worker's rate"
    )


if __name__ == "__main__":
    main()
