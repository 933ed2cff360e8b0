"""What writing one checkpoint file costs: `checkpoint.write_safetensors` of ~N GB of float32
tensors (memory already touched, as a model's is), direct to the disk (O_DIRECT, the default
for files of 64 MB and more) against through the page cache (flushed and dropped every
256 MB), alternating, then fsync; and the way a live checkpoint writes it (direct, not hashed:
the part training waits for), then reads it back and hashes it. Prints the wall time and the
CPU time of each (the CPU a training step shares with the writer), and their ratios.

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


def write_once(path: Path, tensors: dict, mode: str) -> list[tuple[float, float]]:
    """(wall, CPU seconds) of the write and fsync; for "live", then of the read-back hash too."""
    saved = checkpoint.DIRECT_MIN
    checkpoint.DIRECT_MIN = 1 << 62 if mode == "page cache" else saved
    try:
        t, c = time.perf_counter(), cpu_seconds()
        checkpoint.write_safetensors(path, tensors, {}, hash=mode != "live")
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        times = [(time.perf_counter() - t, cpu_seconds() - c)]
        if mode == "live":
            t, c = time.perf_counter(), cpu_seconds()
            checkpoint.hash_written(path)
            times.append((time.perf_counter() - t, cpu_seconds() - c))
        return times
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
    modes = ("direct", "page cache", "live")
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in (*modes, "live: read back")}
    with tempfile.TemporaryDirectory(prefix="ckptlab-bench-write-", dir=args.dir) as tmp:
        for i in range(args.repeat):
            for mode in modes[i % 3 :] + modes[: i % 3]:
                times = write_once(Path(tmp) / "f.safetensors", tensors, mode)
                results[mode].append(times[0])
                if len(times) > 1:
                    results["live: read back"].append(times[1])
    nbytes = per * 4 * 10
    print(f"{nbytes / 1e9:.2f} GB, {args.repeat} writes each, in turns; medians")
    med = {m: (statistics.median(w for w, _ in r), statistics.median(c for _, c in r)) for m, r in results.items()}
    labels = {"live": "live: written (not hashed)", "live: read back": "live: read back, hashed"}
    for mode, (wall, cpu) in med.items():
        label = labels.get(mode, f"{mode}, hashed as written")
        print(f"  {label:<28} {wall:6.2f} s wall  {nbytes / wall / 1e9:5.2f} GB/s  {cpu:6.2f} CPU-seconds")
    (dw, dc), (bw, bc), (lw, lc) = med["direct"], med["page cache"], med["live"]
    print(f"  direct / page cache: wall {dw / bw:.2f}x, CPU {dc / bc:.2f}x")
    print(f"  live (what the optimizer's step may wait for) / direct: wall {lw / dw:.2f}x, CPU {lc / dc:.2f}x")


if __name__ == "__main__":
    main()
