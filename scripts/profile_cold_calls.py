"""What one call costs right after a training step, against the same call repeated at once.

After case c's step (scripts/bench_record.py: the LM at 1 layer x 64 wide, batch 4 x 32, 1
torch thread) the host's caches hold the step's code and data; the first call into code the
step did not use pays for bringing it back. This prints, per primitive the Recorder's
per-step path could use, the median over `--rounds` steps of its first call after a step
("cold") and of a second call right after ("warm"), in microseconds. It is why that path
avoids numpy, the JSON encoder and ctypes calls on the usual step (docs/performance.md).

    PYTHONPATH=.:scripts python scripts/profile_cold_calls.py [--rounds 150] [--hook-rounds 800]

The last line is what autograd's call of a Python hook costs: the step with a no-op
`register_post_accumulate_grad_hook` on every parameter against the step without, in turns
(the median of the differences), the price of the probe's gradient hooks before their body.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import statistics
import struct
import tempfile
import time
import zlib

import numpy as np
import torch

from bench_record import make_batches, steady_malloc  # scripts/ is on sys.path
from bench_replay import CFG, build, step


def primitives(fd: int) -> dict:
    a = np.arange(16, dtype=np.float32)
    t = torch.arange(16, dtype=torch.float32)
    record = {"step": 1, "time": 1.7e9, "loss": 4.1, "grad_norm": 7.5, "lr": [3e-4], "stepped": True}
    encode = json.JSONEncoder(separators=(",", ":")).encode
    buf, raw = b"x" * 300, bytes(2500)
    view = memoryview(raw)
    floats = t.tolist()
    return {
        "a call that does nothing": lambda: None,
        "numpy: isfinite(a).all() (16 floats)": lambda: np.isfinite(a).all(),
        "numpy: a.sum()": lambda: a.sum(),
        "numpy: a.astype(float64)": lambda: a.astype(np.float64),
        "numpy: float(a[0])": lambda: float(a[0]),
        "torch: t.numpy()": lambda: t.numpy(),
        "torch: torch.cat of two": lambda: torch.cat([t, t]),
        "torch: torch.stack of 16 scalars": lambda: torch.stack([t[0]] * 16),
        "torch: t.tolist()": lambda: t.tolist(),
        "json: encode a step's scalars": lambda: encode(record),
        "f-string of the same scalars": lambda: f'{{"step":{1},"loss":{4.1!r},"grad_norm":{7.5!r}}}',
        "struct.pack of 16 floats": lambda: struct.pack("<16f", *floats),
        "math.fsum of 16 floats": lambda: math.fsum(floats),
        "zlib.crc32 of 300 bytes": lambda: zlib.crc32(buf),
        "ctypes.string_at 2.5 KB": lambda: ctypes.string_at(id(raw), 2500),
        "memoryview.tobytes 2.5 KB": view.tobytes,
        "os.write 300 bytes": lambda: os.write(fd, buf),
        "time.time()": time.time,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=150, help="steps per primitive (default 150)")
    ap.add_argument("--hook-rounds", type=int, default=800, help="steps each way for the hooks' line (default 800)")
    args = ap.parse_args()
    steady_malloc()
    torch.set_num_threads(1)
    CFG.update(layers=1, width=64, seq=32)
    batches = make_batches(32, 4)
    model, opt = build()
    with tempfile.TemporaryDirectory(prefix="ckptlab-cold-") as tmp:
        fd = os.open(os.path.join(tmp, "sink"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        calls = primitives(fd)
        cold: dict[str, list[int]] = {k: [] for k in calls}
        warm: dict[str, list[int]] = {k: [] for k in calls}
        for i in range(args.rounds):
            for name, fn in calls.items():
                step(model, opt, batches[i % len(batches)][0])
                t0 = time.perf_counter_ns()
                fn()
                t1 = time.perf_counter_ns()
                fn()
                t2 = time.perf_counter_ns()
                cold[name].append(t1 - t0)
                warm[name].append(t2 - t1)
        os.close(fd)
    hooked = hook_cost(model, opt, batches, args.hook_rounds)
    print(f"case c's step, 1 torch thread; median of {args.rounds} steps per primitive, in us")
    print(f"  {'primitive':<42}{'after a step':>14}{'again at once':>15}{'ratio':>8}")
    for name in calls:
        c, w = statistics.median(cold[name]) / 1e3, statistics.median(warm[name]) / 1e3
        print(f"  {name:<42}{c:>14.1f}{w:>15.1f}{c / w:>8.1f}")
    n = sum(1 for p in model.parameters() if p.requires_grad)
    print(f"  a no-op gradient hook on each of the {n} parameters: {hooked:+.1f} us a step")


def hook_cost(model, opt, batches, rounds: int) -> float:
    """The step with a no-op post-accumulate-grad hook on every parameter, minus without (us)."""
    params = [p for p in model.parameters() if p.requires_grad]
    spent: dict[bool, list[int]] = {False: [], True: []}
    for i in range(rounds):
        for hooks in (False, True) if i % 2 else (True, False):
            handles = [p.register_post_accumulate_grad_hook(lambda p: None) for p in params] if hooks else []
            t0 = time.perf_counter_ns()
            step(model, opt, batches[i % len(batches)][0])
            spent[hooks].append(time.perf_counter_ns() - t0)
            for h in handles:
                h.remove()
    diffs = [a - b for a, b in zip(spent[True], spent[False])]
    # The step that runs second in a round is faster: average each two rounds (one of each
    # order), then the median of those.
    return statistics.median((a + b) / 2 for a, b in zip(diffs[::2], diffs[1::2])) / 1e3


if __name__ == "__main__":
    main()
