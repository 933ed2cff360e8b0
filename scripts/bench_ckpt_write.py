"""What writing one checkpoint file costs: `checkpoint.write_safetensors` of ~N GB of float32
tensors (memory already touched, as a model's is), direct to the disk (O_DIRECT, the default
for files of 64 MB and more) against through the page cache (flushed and dropped every
256 MB), alternating, then fsync. Prints the wall time and the CPU time of each (the CPU a
training step shares with the writer), and their ratios.

    python scripts/bench_ckpt_write.py [--gb 3.2] [--repeat 3] [--dir /tmp]

The files go into a new folder under --dir (default: the system's temporary folder; give a
folder on the disk the runs are written to) and are deleted as they are measured.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckptlab.run import checkpoint  # noqa: E402


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def write_once(path: Path, tensors: dict, direct: bool) -> tuple[float, float]:
    saved = checkpoint.DIRECT_MIN
    checkpoint.DIRECT_MIN = saved if direct else 1 << 62
    try:
        t, c = time.perf_counter(), cpu_seconds()
        checkpoint.write_safetensors(path, tensors, {})
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - t, cpu_seconds() - c
    finally:
        checkpoint.DIRECT_MIN = saved
        path.unlink(missing_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=3.2, help="size of the file in GB (default 3.2)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    per = int(args.gb * 1e9 / 4 / 10)
    tensors = {f"t{i}": torch.randn(per) for i in range(10)}  # touched, like a model's memory
    results: dict[str, list[tuple[float, float]]] = {"direct": [], "page cache": []}
    with tempfile.TemporaryDirectory(prefix="ckptlab-bench-write-", dir=args.dir) as tmp:
        for i in range(args.repeat):
            for mode in ("direct", "page cache") if i % 2 == 0 else ("page cache", "direct"):
                results[mode].append(write_once(Path(tmp) / "f.safetensors", tensors, mode == "direct"))
    nbytes = per * 4 * 10
    print(f"{nbytes / 1e9:.2f} GB, {args.repeat} writes each, alternating; medians")
    med = {m: (statistics.median(w for w, _ in r), statistics.median(c for _, c in r)) for m, r in results.items()}
    for mode, (wall, cpu) in med.items():
        print(f"  {mode:<11} {wall:6.2f} s wall  {nbytes / wall / 1e9:5.2f} GB/s  {cpu:6.2f} CPU-seconds")
    (dw, dc), (bw, bc) = med["direct"], med["page cache"]
    print(f"  direct / page cache: wall {dw / bw:.2f}x, CPU {dc / bc:.2f}x")


if __name__ == "__main__":
    main()
