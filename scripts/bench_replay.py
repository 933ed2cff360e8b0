"""Benchmark replay: re-running recorded steps, and tracing one, against baselines measured in
the same run (machines here are shared and noisy: compare ratios, not seconds).

1. replay K steps without tracing vs the recorded time of those K steps (target <= 1.2x;
   process start and imports excluded, model build and checkpoint load included);
2. one traced step (per-op TorchDispatchMode + module hooks) vs one plain step, and vs the
   same step under torch.autograd.detect_anomaly (PyTorch's own NaN hunter).

    python scripts/bench_replay.py [--steps 200] [--layers 4] [--width 256] [--batch 16] [--seq 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab

VOCAB = 4096
# Read by build() from the environment: replay re-imports this script as a module, so the
# command-line arguments of the recording process must reach it another way.
CFG = {"layers": 4, "width": 256, "heads": 4, "seq": 128}
CFG_ENV = "CKPTLAB_BENCH_REPLAY_CFG"


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)[0]
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        d = CFG["width"]
        self.wte, self.wpe = nn.Embedding(VOCAB, d), nn.Embedding(CFG["seq"], d)
        self.blocks = nn.ModuleList(Block(d, CFG["heads"]) for _ in range(CFG["layers"]))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        T = ids.size(1)
        x = self.wte(ids) + self.wpe(torch.arange(T))
        mask = nn.Transformer.generate_square_subsequent_mask(T)
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln_f(x))


def build():
    if os.environ.get(CFG_ENV):
        CFG.update(json.loads(os.environ[CFG_ENV]))
    torch.manual_seed(0)
    model = LM()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4)


def step(model, opt, batch):
    ids = batch["ids"]
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="steps recorded and replayed")
    ap.add_argument("--layers", type=int, default=CFG["layers"])
    ap.add_argument("--width", type=int, default=CFG["width"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=CFG["seq"])
    ap.add_argument("--repeats", type=int, default=5, help="repeats of the one-step timings (median)")
    args = ap.parse_args()
    CFG.update(layers=args.layers, width=args.width, seq=args.seq)
    os.environ[CFG_ENV] = json.dumps(CFG)
    torch.set_num_threads(2)

    tmp = Path(tempfile.mkdtemp(prefix="ckptlab-bench-replay-"))
    run_dir = tmp / "run"
    g = torch.Generator().manual_seed(1)
    model, opt = build()
    print(
        f"model: {args.layers} layers, width {args.width}, batch {args.batch}x{args.seq}; "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters",
        flush=True,
    )
    with ckptlab.Recorder(run_dir, model, opt, step_fn=step, build_fn=build, ckpt_every=args.steps) as rec:
        for _ in range(args.steps + 1):
            rec.step({"ids": torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=g)})
    run = ckptlab.open_run(run_dir)
    m = run.metrics()
    last = args.steps - 1  # replay 0..last from the checkpoint at 0
    recorded = float(m.step_time[: last + 1].sum())

    t0 = time.perf_counter()
    report = ckptlab.replay(run, last, trace=False, counterfactuals=False)
    replay_s = time.perf_counter() - t0
    assert report.deterministic, "replay diverged from the record"
    print(
        f"replay {args.steps} steps: {replay_s:.2f} s vs recorded {recorded:.2f} s -> {replay_s / recorded:.2f}x "
        f"(bit-exact: {sum(c.match for c in report.steps)}/{len(report.steps)})"
    )

    from ckptlab.replayer.driver import Replayer
    from ckptlab.replayer.trace import Tracer
    from ckptlab.training.state import restore_snapshot, snapshot

    r = Replayer(run)
    t = r.build()
    r.load_checkpoint(t, 0)
    rec0 = r.batch(0)
    snap = snapshot(0, t.model, t.optimizer)

    def timed(kind: str) -> float:
        restore_snapshot(snap, t.model, t.optimizer)
        t1 = time.perf_counter()
        if kind == "traced":
            r.run_step(t, rec0, tracer=Tracer(t.model, t.optimizer, rows=args.batch))
        elif kind == "anomaly":
            with torch.autograd.detect_anomaly(check_nan=True):
                r.run_step(t, rec0)
        else:
            r.run_step(t, rec0)
        return time.perf_counter() - t1

    times = {k: [] for k in ("plain", "traced", "anomaly")}
    for _ in range(args.repeats):  # interleaved, so drift hits all three alike
        for k in times:
            times[k].append(timed(k))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"one step: plain {med['plain'] * 1e3:.0f} ms, traced {med['traced'] * 1e3:.0f} ms, "
        f"detect_anomaly {med['anomaly'] * 1e3:.0f} ms"
    )
    print(
        f"traced / plain = {med['traced'] / med['plain']:.2f}x; traced / detect_anomaly = {med['traced'] / med['anomaly']:.2f}x "
        f"(detect_anomaly / plain = {med['anomaly'] / med['plain']:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
