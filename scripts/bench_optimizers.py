"""The probed step with several optimizers against one, on the same model: what measuring each
optimizer at its own step (ckptlab/training/member_steps.py) costs the hot path.

The model is many small parameter tensors (`--tensors`, default 600: a stack of Linear(16, 16)
layers, two tensors each), so that per-parameter Python work shows. Each step runs one forward,
one backward and then the optimizers' steps (the Muon beside AdamW shape: every optimizer finds
the same measurement): one SGD over every parameter, or `--optimizers N` SGDs over as many
slices of them (the same arithmetic in all). Two copies of the model, built alike, take turns
step by step (in alternating order), each through its own StepRunner, the measured step as the
Recorder and replay run it (begin, step_fn, end, the health read), nothing written. Machines
here are shared and noisy: compare the ratio, not the milliseconds.

    PYTHONPATH=. python scripts/bench_optimizers.py [--steps 400] [--tensors 600] [--optimizers 2] [--each]

Prints each copy's median step time and the ratio of several to one; the last line is one JSON
object with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn as nn

from ckptlab.training.step import StepRunner


def build(tensors: int, optimizers: int):
    """(model, optimizer or list of them): `tensors` parameter tensors, the same weights for
    the same arguments; several optimizers each hold a contiguous slice of the layers."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(tensors // 2)])
    layers = list(model)
    if optimizers == 1:
        return model, torch.optim.SGD(model.parameters(), lr=1e-3)
    share = -(-len(layers) // optimizers)
    parts = [layers[i : i + share] for i in range(0, len(layers), share)]
    return model, [torch.optim.SGD([p for m in part for p in m.parameters()], lr=1e-3) for part in parts]


def step(model, optimizer, batch):
    """One backward, then every optimizer's step."""
    optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    loss = model(batch).square().mean()
    loss.backward()
    for opt in optimizers:
        opt.step()
    return loss


def step_each(model, optimizer, batch):
    """A GAN's shape (`--each`): two backward passes, each optimizer stepping after one (the
    first after the first, the others after the second), so that the step's end takes the
    first one's norms from the earlier measurement; one optimizer steps after both."""
    optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    loss = model(batch).square().mean()
    loss.backward()
    if len(optimizers) > 1:
        optimizers[0].step()
    second = model(batch).abs().mean()
    second.backward()
    for opt in optimizers[1:] if len(optimizers) > 1 else optimizers:
        opt.step()
    return loss.detach() + second.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--tensors", type=int, default=600)
    ap.add_argument("--optimizers", type=int, default=2)
    ap.add_argument("--each", action="store_true", help="two backward passes, an optimizer after each (step_each)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    runners = {n: StepRunner(*build(args.tensors, n)) for n in (1, args.optimizers)}
    batch = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    times: dict[int, list[float]] = {n: [] for n in runners}
    for i in range(args.steps):
        for n in list(runners) if i % 2 else list(runners)[::-1]:
            runner = runners[n]
            t0 = time.perf_counter()
            runner.run_step(step_each if args.each else step, batch, measure_update=False)
            if i >= 10:  # (the first steps warm the caches and the probe learns the loop)
                times[n].append(time.perf_counter() - t0)
    for runner in runners.values():
        runner.close()
    one, several = (statistics.median(times[n]) * 1e3 for n in (1, args.optimizers))
    shape = "two backward passes" if args.each else "one backward"
    print(f"{args.tensors} parameter tensors, {shape}, {args.steps - 10} steps each, 1 thread:")
    print(f"  1 optimizer:  {one:.2f} ms a probed step")
    print(f"  {args.optimizers} optimizers: {several:.2f} ms a probed step ({several / one:.3f}x)")
    print(json.dumps({"one_ms": one, "several_ms": several, "ratio": several / one, "optimizers": args.optimizers}))


if __name__ == "__main__":
    main()
