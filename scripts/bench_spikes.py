"""How often the spike rule (ckptlab/analysis/spikes.py) calls a healthy noisy small-batch
step a spike, and which planted spikes it still catches: the rule as it is against the same
rule without its upper-tail bar (`tail=0`, the rule before that bar).

The curves are an MNIST-like classification trained as users train MNIST: 10 classes of
28x28 images (a smooth random prototype per class plus pixel noise, so that a batch now and
then holds a hard example, as MNIST's do), a tiny CNN or MLP with dropout, Adadelta lr=1.0,
batches of 4 to 32, with and without 1% of the labels flipped (a mislabelled digit). Each
step's loss and pre-clip gradient norm are kept: the series the Recorder judges, step by step,
with the same SpikeDetector (`ckptlab info`, `report` and `replay` scan them alike).

Prints, per model, share of flipped labels and batch size: the false alarms per 1000 healthy steps (loss, gradient norm),
before -> after; the smallest loss each rule calls a spike, as a multiple of the window's
median (the median over the steps from 300 on); the share of planted spikes caught, one at
a time, at steps 300, 400, ...: a loss of 5x and of 30x the window's median, and of 5x the
window's highest loss; and the cost of a check. The last line is one JSON object with it all.

    PYTHONPATH=. python scripts/bench_spikes.py [--steps 1000] [--seeds 0,1,2]
        [--batches 4,8,16,32] [--models cnn,mlp] [--flips 0,0.01]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ckptlab.analysis.spikes import GRAD_RULE, LOSS_RULE, SpikeDetector, SpikeRule, find_spikes

PLANTED = {"5x median": ("median", 5.0), "30x median": ("median", 30.0), "5x window max": ("max", 5.0)}


class SmallCNN(nn.Module):
    """PyTorch's MNIST example, narrowed: two convolutions, dropout, two linear layers."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 8, 3), nn.Conv2d(8, 16, 3)
        self.drop1, self.drop2 = nn.Dropout(0.25), nn.Dropout(0.5)
        self.fc1, self.fc2 = nn.Linear(16 * 5 * 5, 32), nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = self.drop1(torch.flatten(F.max_pool2d(F.relu(self.conv2(x)), 2), 1))
        return self.fc2(self.drop2(F.relu(self.fc1(x))))


def build(model: str) -> nn.Module:
    if model == "cnn":
        return SmallCNN()
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 10))


def train(model: str, seed: int, batch: int, steps: int, flip: float) -> tuple[np.ndarray, np.ndarray]:
    """(loss, pre-clip gradient norm) of each step of a healthy run."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    prototypes = F.avg_pool2d(torch.randn(10, 1, 28, 28, generator=g), 5, 1, 2) * 2
    net = build(model)
    opt = torch.optim.Adadelta(net.parameters(), lr=1.0)
    losses, norms = [], []
    for _ in range(steps):
        y = torch.randint(0, 10, (batch,), generator=g)
        x = prototypes[y] + torch.randn(batch, 1, 28, 28, generator=g)
        wrong = torch.rand(batch, generator=g) < flip
        y = torch.where(wrong, torch.randint(0, 10, (batch,), generator=g), y)
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        norms.append(float(nn.utils.clip_grad_norm_(net.parameters(), float("inf"))))
        opt.step()
        losses.append(loss.item())
    return np.array(losses), np.array(norms)


def bar(values: np.ndarray, rule: SpikeRule) -> list[float]:
    """The smallest value the rule calls a spike at steps 300, 307, ..., over the median."""
    out = []
    for k in range(300, len(values), 7):
        w = values[k - rule.window : k]
        med = float(np.median(w))
        mad = max(float(np.median(np.abs(w - med))), 1e-3 * abs(med), 1e-12)
        low = max(med + rule.z * 1.4826 * mad, med + (rule.min_ratio - 1) * abs(med), med + rule.tail * (w.max() - med))
        out.append(low / med)
    return out


def caught(values: np.ndarray, rule: SpikeRule) -> dict[str, list[bool]]:
    """Each planted spike, alone in a copy of the curve: caught or not."""
    out: dict[str, list[bool]] = {name: [] for name in PLANTED}
    for k in range(300, len(values), 100):
        w = values[k - rule.window : k]
        for name, (of, times) in PLANTED.items():
            planted = values.copy()
            planted[k] = times * (np.median(w) if of == "median" else w.max())
            out[name].append(any(i == k for i, _ in find_spikes(planted[: k + 1], rule)))
    return out


def check_cost(curves: list[np.ndarray], rule: SpikeRule) -> float:
    """Microseconds per SpikeDetector.check over the curves (the best of 3)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for c in curves:
            det = SpikeDetector(rule)
            for v in c.tolist():
                det.check(v)
        best = min(best, time.perf_counter() - t0)
    return best / sum(len(c) for c in curves) * 1e6


def judge(runs: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """Both rules on these runs: false alarms per 1000 steps, bars, planted spikes caught."""
    steps = sum(len(loss) for loss, _ in runs)
    out: dict = {"steps": steps}
    for when, tail in (("before", 0.0), ("after", LOSS_RULE.tail)):
        rule, grad_rule = replace(LOSS_RULE, tail=tail), replace(GRAD_RULE, tail=tail)
        alarms = sum(len(find_spikes(loss, rule)) for loss, _ in runs)
        grad_alarms = sum(len(find_spikes(norm, grad_rule)) for _, norm in runs)
        hits: dict[str, list[bool]] = {name: [] for name in PLANTED}
        for loss, _ in runs:
            for name, got in caught(loss, rule).items():
                hits[name] += got
        out[when] = {
            "loss_alarms_per_1000": round(1000 * alarms / steps, 2),
            "grad_alarms_per_1000": round(1000 * grad_alarms / steps, 2),
            "bar_x_median": round(float(np.median([b for loss, _ in runs for b in bar(loss, rule)])), 1),
            "caught": {name: f"{sum(got)}/{len(got)}" for name, got in hits.items()},
        }
    return out


def line(key: str, row: dict) -> str:
    b, a = row["before"], row["after"]
    return (
        f"{key:<16} {row['steps']:>5} steps: loss alarms/1000 {b['loss_alarms_per_1000']} -> "
        f"{a['loss_alarms_per_1000']}, grad-norm {b['grad_alarms_per_1000']} -> {a['grad_alarms_per_1000']}; "
        f"bar {b['bar_x_median']}x -> {a['bar_x_median']}x the median; caught "
        + ", ".join(f"{name} {b['caught'][name]} -> {a['caught'][name]}" for name in PLANTED)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--batches", default="4,8,16,32")
    ap.add_argument("--models", default="cnn,mlp")
    ap.add_argument("--flips", default="0,0.01", help="shares of flipped labels")
    args = ap.parse_args()
    torch.set_num_threads(1)
    curves: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for model in args.models.split(","):
        for flip in (float(f) for f in args.flips.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                key = f"{model} flip={flip:g} b={batch}"
                curves[key] = [train(model, seed, batch, args.steps, flip) for seed in map(int, args.seeds.split(","))]
    result: dict = {}
    for key, runs in curves.items():
        result[key] = judge(runs)
        print(line(key, result[key]), flush=True)
    losses = [loss for runs in curves.values() for loss, _ in runs]
    result["check_us"] = {
        "before": round(check_cost(losses, replace(LOSS_RULE, tail=0)), 2),
        "after": round(check_cost(losses, LOSS_RULE), 2),
    }
    print(f"check: {result['check_us']['before']} -> {result['check_us']['after']} us (all the curves above)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
