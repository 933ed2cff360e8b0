"""What `ckptlab.portable_cpu()` costs: training steps with this CPU's own kernels against the
portable AVX2 ones (ATen, MKL and oneDNN pinned), each in a fresh process (torch reads the
kernel choice once), interleaved, medians.

    python scripts/bench_portable.py [--repeats 3] [--steps 20] [--threads 1]

Two models: the sample's tiny LM (ckptlab/examples/tiny_lm.py, batches of 8 x 32) and
bench_replay.py's 4.2M-parameter LM (batches of 16 x 128), each step a whole training step
(forward, backward, clipping, AdamW), on `--threads` torch threads (1, as the sample records).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
which, steps = sys.argv[1], int(sys.argv[2])
if which == "tiny":
    from ckptlab.examples import tiny_lm as m
    model, opt, _ = m.build()
    g = torch.Generator().manual_seed(1)
    batch = {"ids": torch.randint(1, m.VOCAB, (8, m.CTX + 1), generator=g)}
else:
    sys.path.insert(0, "scripts")
    import bench_replay as m
    model, opt = m.build()
    g = torch.Generator().manual_seed(1)
    batch = {"ids": torch.randint(0, m.VOCAB, (16, 129), generator=g)}
times = []
for i in range(steps + 3):
    t0 = time.perf_counter()
    m.step(model, opt, batch)
    if i >= 3:
        times.append(time.perf_counter() - t0)
print(json.dumps({"ms": sorted(times)[len(times) // 2] * 1e3, "cap": torch.backends.cpu.get_cpu_capability()}))
"""


def once(which: str, portable: bool, steps: int, threads: int) -> dict:
    from ckptlab.run.environment import PORTABLE

    env = {k: v for k, v in os.environ.items() if k not in PORTABLE}
    if portable:
        env.update(PORTABLE)
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, which, str(steps), str(threads)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    for which in ("tiny", "lm"):
        native, portable, caps = [], [], set()
        for _ in range(args.repeats):
            for pin, out in ((False, native), (True, portable)):
                r = once(which, pin, args.steps, args.threads)
                out.append(r["ms"])
                caps.add(r["cap"])
        a, b = statistics.median(native), statistics.median(portable)
        print(f"{which}: native {a:.1f} ms/step vs portable {b:.1f} ms/step = {b / a:.2f}x ({', '.join(sorted(caps))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
