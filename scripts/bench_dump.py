"""Benchmark `ckptlab replay --dump` on the bundled sample run, against the plain replay
measured in the same run (machines here are shared and noisy: compare ratios, not seconds).

1. the whole CLI, `ckptlab replay --run sample_ckpts/tinylm-nan --step 5432 --json`, as a user
   types it (process start and imports included; the target: under 10 s), without and with
   `--dump`;
2. inside one process, `ckptlab.replay` plain vs with a dump: its `timing` (trace_s,
   dump_capture_s, dump_write_s, total_s), the dump's tensors and file size.

Runs are interleaved (plain, dump, plain, dump, ...); medians are printed.

    python scripts/bench_dump.py [--repeat 3]
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

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_ckpts" / "tinylm-nan"
STEP = 5432


def cli(*extra: str) -> float:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "ckptlab", "replay", "--run", str(SAMPLE), "--step", str(STEP), "--json", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode:
        sys.exit(f"{' '.join(cmd)} failed: {p.stderr[-2000:]}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import ckptlab

    tmp = Path(tempfile.mkdtemp())
    wall = {"plain": [], "dump": []}
    timing = {"plain": [], "dump": []}
    report = None
    for i in range(args.repeat):
        wall["plain"].append(cli())
        wall["dump"].append(cli("--dump", str(tmp / f"cli{i}.h5")))
        timing["plain"].append(ckptlab.replay(SAMPLE, STEP).timing)
        report = ckptlab.replay(SAMPLE, STEP, dump=tmp / f"api{i}.h5")
        timing["dump"].append(report.timing)

    def med(kind: str, key: str) -> float:
        return statistics.median(t.get(key, 0.0) for t in timing[kind])

    out = {
        "cli_plain_s": statistics.median(wall["plain"]),
        "cli_dump_s": statistics.median(wall["dump"]),
        "plain_total_s": med("plain", "total_s"),
        "dump_total_s": med("dump", "total_s"),
        "trace_s": med("plain", "trace_s"),
        "dump_capture_s": med("dump", "dump_capture_s"),
        "dump_write_s": med("dump", "dump_write_s"),
        "dump_tensors": report.dump.datasets,
        "dump_data_bytes": report.dump.data_bytes,
        "dump_file_bytes": report.dump.file_bytes,
    }
    out["dump_vs_plain"] = out["dump_total_s"] / out["plain_total_s"]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
