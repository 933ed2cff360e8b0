"""The CPU time the Recorder's time and memory meter (ckptlab/record/system.py) adds to a step:
its calls of one step, on a batch of token ids, in thread time (a loaded host's descheduling
does not count), 9 x 20000 steps, the median and the least.

    PYTHONPATH=. python scripts/bench_system_meter.py
"""

import statistics
import time

import torch

from ckptlab.record.system import SystemMeter

m = SystemMeter(on_cuda=False)
batch = {"ids": torch.zeros(4, 32, dtype=torch.long), "y": torch.zeros(4, dtype=torch.long)}
ids = list(range(4))
runs = []
for _ in range(9):
    n = 20000
    s = time.thread_time()
    for _ in range(n):
        m.begin()
        m.batch(batch, ids, None)
        m.checkpointed(0.0, taken=False, wait=0.0)
        m.end(0.0)
    runs.append((time.thread_time() - s) / n * 1e6)
print(f"SystemMeter per step: median {statistics.median(runs):.2f} us, least {min(runs):.2f} us of the thread's CPU")
m.close()
