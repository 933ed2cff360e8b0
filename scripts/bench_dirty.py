"""Throughput of `ckptlab dirty`'s scan (batches/s) on a run with many steps.

    python scripts/bench_dirty.py                        # 5000 steps of 32 x 128 tokens
    python scripts/bench_dirty.py --kind features --steps 5000 --batch 64
    python scripts/bench_dirty.py --keep /tmp/bench-run  # keep the run (re-used when it exists)

Records a run whose model is a token embedding + linear head (so recording is cheap and the
time measured is the scan's), then times `ckptlab.analysis.dirty.scan` without attribution:
static scan of every retained batch plus the dynamic step-health scan. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ckptlab  # noqa: E402
from ckptlab.analysis.dirty import scan  # noqa: E402

VOCAB = 1000


class Bag(nn.Module):
    def __init__(self, d_in: int = VOCAB, kind: str = "tokens"):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(VOCAB, 16) if kind == "tokens" else None
        self.head = nn.Linear(16 if kind == "tokens" else 32, VOCAB if kind == "tokens" else 1)


def build_tokens():
    torch.manual_seed(0)
    model = Bag(kind="tokens")
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def build_features():
    torch.manual_seed(0)
    model = Bag(kind="features")
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def step_tokens(model, optimizer, batch):
    ids = batch["ids"]
    h = model.emb(ids[:, :-1]).mean(1)  # (B, 16)
    loss = F.cross_entropy(model.head(h), ids[:, 0])  # uniform targets: a flat, spike-free loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def step_features(model, optimizer, batch):
    loss = F.mse_loss(model.head(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def batches(kind: str, steps: int, batch: int, seq: int):
    g = torch.Generator().manual_seed(0)
    for i in range(steps):
        if kind == "tokens":
            ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
            lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
            ids[torch.arange(seq) >= lengths[:, None]] = 0
            yield {"ids": ids}, [i * batch + r for r in range(batch)]
        else:
            x = torch.randn(batch, 32, generator=g)
            yield {"x": x, "y": x[:, :1]}, [i * batch + r for r in range(batch)]


def record(path: Path, kind: str, steps: int, batch: int, seq: int) -> float:
    build, step = (build_tokens, step_tokens) if kind == "tokens" else (build_features, step_features)
    model, opt = build()
    t0 = time.perf_counter()
    with ckptlab.Recorder(
        path,
        model,
        opt,
        step_fn=step,
        build_fn=build,
        ckpt_every=max(1, steps // 5),
        keep_last=10,
        health_every=100,
        data_info={"pad_id": 0, "vocab_size": VOCAB} if kind == "tokens" else {},
    ) as rec:
        for b, ids in batches(kind, steps, batch, seq):
            rec.step(b, sample_ids=ids)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=["tokens", "features"], default="tokens")
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3, help="scans timed; the best is reported")
    ap.add_argument("--keep", type=Path, default=None, help="record into (or reuse) this run directory")
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = args.keep or Path(tempfile.mkdtemp()) / "run"
    rec_s = None if (path / "manifest.json").exists() else record(path, args.kind, args.steps, args.batch, args.seq)
    run = ckptlab.open_run(path)
    best = None
    for _ in range(args.repeat):
        run = ckptlab.open_run(path)  # cold reader: the scan pays for indexing and decoding
        t0 = time.perf_counter()
        report = scan(run)
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    n, rows = report.scanned["steps"], report.scanned["rows"]
    print(
        json.dumps(
            {
                "kind": args.kind,
                "steps": n,
                "rows": rows,
                "batch": args.batch,
                "seq": args.seq if args.kind == "tokens" else None,
                "scan_s": round(best, 3),
                "batches_per_s": round(n / best, 1),
                "rows_per_s": round(rows / best),
                "flagged": len(report.flagged),
                "record_s": round(rec_s, 1) if rec_s else None,
                "python": platform.python_version(),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
