"""How often the spike rule (ckptlab/analysis/spikes.py) calls a healthy noisy small-batch
step a spike, and which planted spikes it still catches, on small-batch curves and on decaying
ones: three rules side by side, the z rule alone (`tail=0`, the rule before the upper-tail
bar), the tail bar measured from the window's highest value (the bar's first version:
`WindowTop`), and the rule as it is (the bar measured from the window's largest rise of a
value over the median of the values before it).

The small-batch curves are an MNIST-like classification trained as users train MNIST: 10
classes of 28x28 images (a smooth random prototype per class plus pixel noise, so that a batch
now and then holds a hard example, as MNIST's do), a tiny CNN or MLP with dropout, Adadelta
lr=1.0, batches of 4 to 32, with and without 1% of the labels flipped (a mislabelled digit).
Each step's loss and pre-clip gradient norm are kept: the series the Recorder judges, step by
step, with the same SpikeDetector (`ckptlab info`, `report` and `replay` scan them alike).
Printed per model, share of flipped labels and batch size: the false alarms per 1000 healthy
steps (loss, gradient norm); the smallest loss each rule calls a spike, as a multiple of the
window's median (the median over the steps from 300 on); the share of planted spikes caught,
one at a time, at steps 300, 400, ...: a loss of 5x and of 30x the window's median, and of 5x
the window's highest loss.

The decaying curves are a loss falling from 10 to 2 (2 + 8 exp(-t/tau), tau of 10 to 200
steps, 5% log-normal noise, 3 seeds each): the false alarms per 1000 steps, and the planted
spikes caught, one at a time, at steps 140, 150, ..., 300 (where the window still holds the
curve's fall): 2x, 3x and 5x the curve's level there. Last, the cost of a check (the loss
rule as it is, on every curve above), and one JSON object with it all.

    PYTHONPATH=. python scripts/bench_spikes.py [--steps 1000] [--seeds 0,1,2]
        [--batches 4,8,16,32] [--models cnn,mlp] [--flips 0,0.01] [--taus 10,25,50,100,200]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ckptlab.analysis.spikes import GRAD_RULE, LOSS_RULE, SpikeDetector, SpikeRule

PLANTED = {"5x median": ("median", 5.0), "30x median": ("median", 30.0), "5x window max": ("max", 5.0)}
DECAY_PLANTED = (2.0, 3.0, 5.0)  # times the decaying curve's level
DECAY_STEPS = range(140, 310, 10)


class WindowTop(SpikeDetector):
    """The bar's first version (2026-12-06): a spike rises `tail` times as far above the
    median as the window's highest value does."""

    def _clears_bars(self, value: float, median: float) -> bool:
        rise = value - median
        return rise >= (self.rule.min_ratio - 1) * abs(median) and rise >= self.rule.tail * (self._sorted[-1] - median)

    def top(self, median: float) -> float:
        return self._sorted[-1] - median


class Rises(SpikeDetector):
    """The rule as it is (analysis/spikes.py), with its bar's height readable."""

    def top(self, median: float) -> float:
        return self._largest_rise()


# name -> (detector, tail): the three rules compared
RULES: dict[str, tuple[type, float]] = {
    "z alone": (Rises, 0.0),
    "window top": (WindowTop, LOSS_RULE.tail),
    "rises": (Rises, LOSS_RULE.tail),
}
Detector = Callable[[SpikeRule], SpikeDetector]


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


def spikes(values: np.ndarray, rule: SpikeRule, make: Detector) -> list[int]:
    """The steps `make(rule)` calls spikes, scanning the series as the Recorder would."""
    det = make(rule)
    return [i for i, v in enumerate(values.tolist()) if det.check(v) is not None]


def bar(values: np.ndarray, rule: SpikeRule, make: Detector) -> list[float]:
    """The smallest value the rule calls a spike at steps 300, 307, ..., over the median."""
    det, out = make(rule), []
    for k, v in enumerate(values.tolist()):
        if k >= 300 and (k - 300) % 7 == 0:
            w = np.fromiter(det._window, dtype=np.float64)
            med = float(np.median(w))
            mad = max(float(np.median(np.abs(w - med))), 1e-3 * abs(med), 1e-12)
            tail = med + rule.tail * det.top(med)  # type: ignore[attr-defined]
            out.append(max(med + rule.z * 1.4826 * mad, med + (rule.min_ratio - 1) * abs(med), tail) / med)
        det.check(v)
    return out


def caught(values: np.ndarray, rule: SpikeRule, make: Detector) -> dict[str, list[bool]]:
    """Each planted spike, alone in a copy of the curve: caught or not."""
    out: dict[str, list[bool]] = {name: [] for name in PLANTED}
    for k in range(300, len(values), 100):
        w = values[k - rule.window : k]
        for name, (of, times) in PLANTED.items():
            planted = values[: k + 1].copy()
            planted[k] = times * (np.median(w) if of == "median" else w.max())
            out[name].append(k in spikes(planted, rule, make))
    return out


def judge(runs: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """The three rules on these runs: false alarms per 1000 steps, bars, planted spikes caught."""
    steps = sum(len(loss) for loss, _ in runs)
    out: dict = {"steps": steps}
    for name, (make, tail) in RULES.items():
        rule, grad_rule = replace(LOSS_RULE, tail=tail), replace(GRAD_RULE, tail=tail)
        alarms = sum(len(spikes(loss, rule, make)) for loss, _ in runs)
        grad_alarms = sum(len(spikes(norm, grad_rule, make)) for _, norm in runs)
        hits: dict[str, list[bool]] = {p: [] for p in PLANTED}
        for loss, _ in runs:
            for p, got in caught(loss, rule, make).items():
                hits[p] += got
        out[name] = {
            "loss_alarms_per_1000": round(1000 * alarms / steps, 2),
            "grad_alarms_per_1000": round(1000 * grad_alarms / steps, 2),
            "bar_x_median": round(float(np.median([b for loss, _ in runs for b in bar(loss, rule, make)])), 1),
            "caught": {p: f"{sum(got)}/{len(got)}" for p, got in hits.items()},
        }
    return out


def decaying(tau: float, seed: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(the loss, its level): 2 + 8 exp(-t/tau), with 5% log-normal noise."""
    level = 2 + 8 * np.exp(-np.arange(steps) / tau)
    return level * np.exp(0.05 * np.random.default_rng(seed).standard_normal(steps)), level


def judge_decay(tau: float, seeds: list[int], steps: int) -> dict:
    """The three rules on decaying curves: false alarms per 1000 steps, planted spikes caught."""
    curves = [decaying(tau, seed, steps) for seed in seeds]
    out: dict = {"steps": steps * len(seeds)}
    for name, (make, tail) in RULES.items():
        rule = replace(LOSS_RULE, tail=tail)
        alarms = sum(len(spikes(loss, rule, make)) for loss, _ in curves)
        hits = {f"{times:g}x": 0 for times in DECAY_PLANTED}
        for loss, level in curves:
            for k in DECAY_STEPS:
                for times in DECAY_PLANTED:
                    planted = loss[: k + 1].copy()
                    planted[k] = times * level[k]
                    hits[f"{times:g}x"] += k in spikes(planted, rule, make)
        planted_n = len(curves) * len(DECAY_STEPS)
        out[name] = {
            "loss_alarms_per_1000": round(1000 * alarms / out["steps"], 2),
            "caught": {k: f"{v}/{planted_n}" for k, v in hits.items()},
        }
    return out


def check_cost(curves: list[np.ndarray], rule: SpikeRule, make: Detector) -> float:
    """Microseconds per check over the curves (the best of 3)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for c in curves:
            det = make(rule)
            for v in c.tolist():
                det.check(v)
        best = min(best, time.perf_counter() - t0)
    return best / sum(len(c) for c in curves) * 1e6


def line(key: str, row: dict) -> str:
    """One row, the three rules as a / b / c (RULES' order)."""

    def each(what: Callable[[dict], object]) -> str:
        return " / ".join(str(what(row[name])) for name in RULES)

    text = f"{key:<18} {row['steps']:>5} steps: loss alarms/1000 {each(lambda r: r['loss_alarms_per_1000'])}"
    if "grad_alarms_per_1000" in row[next(iter(RULES))]:
        text += f", grad-norm {each(lambda r: r['grad_alarms_per_1000'])}; bar {each(lambda r: r['bar_x_median'])}x"
    caught_of = row[next(iter(RULES))]["caught"]
    return text + "; caught " + ", ".join(f"{p} {each(lambda r, p=p: r['caught'][p])}" for p in caught_of)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--batches", default="4,8,16,32")
    ap.add_argument("--models", default="cnn,mlp")
    ap.add_argument("--flips", default="0,0.01", help="shares of flipped labels")
    ap.add_argument("--taus", default="10,25,50,100,200", help="decay times of the decaying curves, in steps")
    args = ap.parse_args()
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    print("rules: " + " / ".join(RULES), flush=True)
    result: dict = {}
    losses = []
    for model in args.models.split(","):
        for flip in (float(f) for f in args.flips.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                key = f"{model} flip={flip:g} b={batch}"
                runs = [train(model, seed, batch, args.steps, flip) for seed in seeds]
                losses += [loss for loss, _ in runs]
                result[key] = judge(runs)
                print(line(key, result[key]), flush=True)
    for tau in (float(t) for t in args.taus.split(",")):
        key = f"decay tau={tau:g}"
        result[key] = judge_decay(tau, seeds, args.steps)
        losses += [decaying(tau, seed, args.steps)[0] for seed in seeds]
        print(line(key, result[key]), flush=True)
    result["check_us"] = round(check_cost(losses, LOSS_RULE, Rises), 2)  # (the others here pay for its rises too)
    print(f"check: {result['check_us']} us (the rule as it is, on all the curves above)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
