"""Record and replay a torch.compile'd model with a real backend (inductor by default), end to end.

    python scripts/check_compile.py                      # inductor: needs a C compiler
    python scripts/check_compile.py --backend aot_eager  # what the CI tests use (fast)

The tests compile with "aot_eager", because inductor spends ~20-30 s per graph on a small CI
machine. This script is the inductor check: it records 9 steps of a tiny MLP compiled with
`--backend`, plants a finite but absurd row at step 8 (fc1's matmul overflows), replays step
8 and prints the JSON keys that say how replay ran (compiled, bit_exact, trace_eager) and the
verdict, with the seconds spent recording and replaying (compile time dominates both).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab

# From --backend, through the environment: replay imports this file again as a module.
BACKEND = os.environ.get("CKPTLAB_CHECK_BACKEND", "inductor")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def build():
    torch.manual_seed(0)
    model = MLP()
    return torch.compile(model, backend=BACKEND), torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model, optimizer, batch):
    x, y = batch
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def main() -> None:
    global BACKEND
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="inductor")
    BACKEND = os.environ["CKPTLAB_CHECK_BACKEND"] = p.parse_args().backend
    run_dir = tempfile.mkdtemp() + "/run"
    t0 = time.perf_counter()
    model, opt = build()
    g = torch.Generator().manual_seed(1)
    with ckptlab.Recorder(
        run_dir, model, opt, step_fn=step, build_fn=build, ckpt_every=5, on_nonfinite="record"
    ) as rec:
        for s in range(9):
            x = torch.randn(4, 8, generator=g)
            if s == 8:
                x[2] = 3e38  # finite, absurd: fc1's matmul sums to Inf
            rec.step((x, x[:, :1] * 0.5), sample_ids=[100 * s + r for r in range(4)])
    t1 = time.perf_counter()
    report = ckptlab.replay(run_dir, 8).to_json()
    t2 = time.perf_counter()
    keys = ("root_step", "compiled", "recorded_compiled", "bit_exact", "deterministic", "trace_eager", "verdict")
    print(json.dumps({k: report[k] for k in keys} | {"record_s": t1 - t0, "replay_s": t2 - t1}, indent=1))


if __name__ == "__main__":
    main()
