"""One prepared check of the Recorder on a CUDA machine (under 6 minutes on one GPU).

    python scripts/gpu_check.py            # a GPT-2-small-shaped LM (124M parameters), bf16 autocast
    python scripts/gpu_check.py --cpu      # the same checks at a tiny size on the CPU (tests run this)

Trains two identical models side by side, bare and recorded (`ckptlab.Recorder`, default
options: the health of a step is read when the next one ends), in blocks of steps in
alternating order, with a NaN planted in one sample's loss weight near the end. Then:

  (a) overhead: recorded vs bare time per block (the device synchronized at block ends only,
      so the host may run ahead inside a block as in real training); and recording changes
      nothing: every recorded loss equals the bare one, bit for bit;
  (b) no host sync: a few recorded steps (one of them measuring update ratios) run under
      `torch.cuda.set_sync_debug_mode("error")`;
  (c) replay, with the deterministic CUDA settings the run was recorded with, from the last
      checkpoint through the planted step: every replayed loss and grad norm equal to the record;
  (d) the verdict names the planted sample, and NonFiniteLoss named the planted step (at most
      one step late);
  (e) one JSON line of figures on stdout (last line); exit status 1 if a check failed.

Without a CUDA device (and without --cpu) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab

# Read by build() from the environment: replay imports this file again as a module, so the
# size chosen on the command line must reach it another way.
CFG_ENV = "CKPTLAB_GPU_CHECK_CFG"
SIZES = {
    "gpt2-small": {"vocab": 50257, "ctx": 512, "width": 768, "layers": 12, "heads": 12, "batch": 8},
    "tiny": {"vocab": 64, "ctx": 16, "width": 32, "layers": 2, "heads": 2, "batch": 4},
}
CFG = {**SIZES["tiny"], "device": "cpu"}


class Attention(nn.Module):
    """Causal self-attention written out (matmul, mask, softmax): deterministic on CUDA."""

    def __init__(self, d: int, heads: int, ctx: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.register_buffer("causal", torch.tril(torch.ones(ctx, ctx, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.heads)  # (B, H, T, T)
        att = att.masked_fill(~self.causal[:T, :T], float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ctx: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, ctx)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, ctx: int, width: int, layers: int, heads: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(ctx, width)
        self.blocks = nn.ModuleList(Block(width, heads, ctx) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.size(1), device=ids.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


def build():
    if os.environ.get(CFG_ENV):
        CFG.update(json.loads(os.environ[CFG_ENV]))
    torch.manual_seed(0)
    model = GPT(CFG["vocab"], CFG["ctx"], CFG["width"], CFG["layers"], CFG["heads"]).to(CFG["device"])
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)


def step(model, optimizer, batch):
    """One step in bf16 autocast; the batch arrives on the host (pinned on CUDA) and moves
    without a sync. `weight` weighs each row's loss (the planted NaN sits in one)."""
    device = next(model.parameters()).device
    ids = batch["ids"].to(device, non_blocking=True)  # (B, T+1)
    weight = batch["weight"].to(device, non_blocking=True)  # (B,)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(ids[:, :-1])
    rows = F.cross_entropy(logits.float().transpose(1, 2), ids[:, 1:], reduction="none").mean(dim=1)  # (B,)
    loss = (rows * weight).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def make_batches(n: int, planted: tuple[int, int], pin: bool) -> list[tuple[dict, list[int]]]:
    """Token ids from a Zipf-like law; weights 1, except NaN at planted = (step, row)."""
    g = torch.Generator().manual_seed(1)
    B, T = CFG["batch"], CFG["ctx"]
    probs = 1.0 / (torch.arange(CFG["vocab"], dtype=torch.float64) + 10)
    out = []
    for i in range(n):
        ids = torch.multinomial(probs, B * (T + 1), replacement=True, generator=g).view(B, T + 1)
        weight = torch.ones(B)
        if i == planted[0]:
            weight[planted[1]] = math.nan
        batch = {"ids": ids.pin_memory() if pin else ids, "weight": weight.pin_memory() if pin else weight}
        out.append((batch, [i * B + r for r in range(B)]))
    return out


def deterministic_cuda() -> None:
    """The settings replay restores on CUDA; set before CUDA starts so the record has them too."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run the same checks on the CPU at a tiny size")
    ap.add_argument("--steps", type=int, default=None, help="steps per model (default 200; --cpu 40)")
    ap.add_argument("--block", type=int, default=None, help="steps per timed block (default 10; --cpu 5)")
    ap.add_argument("--run-dir", default=None, help="where to record (default: a temporary folder, deleted)")
    args = ap.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is present; nothing was measured (--cpu runs the checks on the CPU)")
        return 0
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda":
        deterministic_cuda()
    CFG.update(SIZES["tiny" if args.cpu else "gpt2-small"], device=device)
    os.environ[CFG_ENV] = json.dumps(CFG)
    steps = args.steps or (40 if args.cpu else 200)
    block = args.block or (5 if args.cpu else 10)
    if block < 3 or steps < 3 * block:
        ap.error("--block must be >= 3 and --steps >= 3 blocks (a warm-up block, a timed one, the planted NaN's)")
    ckpt_every = max(block, steps // 4 // block * block)
    planted = (steps - block + 2, 1)  # (step, row): in the last block, after the last checkpoint
    with tempfile.TemporaryDirectory(prefix="ckptlab-gpu-check-") as tmp:
        run_dir = Path(args.run_dir) if args.run_dir else Path(tmp) / "run"
        figures = check(run_dir, device, steps, block, ckpt_every, planted)
    print(json.dumps(figures))
    return 0 if figures["ok"] else 1


def check(run_dir: Path, device: str, steps: int, block: int, ckpt_every: int, planted: tuple[int, int]) -> dict:
    batches = make_batches(steps, planted, pin=device == "cuda")
    bare_model, bare_opt = build()
    model, opt = build()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{n_params / 1e6:.1f}M parameters on {device}; {steps} steps in blocks of {block}; planted NaN {planted}")
    times: dict[str, list[float]] = {"bare": [], "recorded": []}
    losses: dict[str, list[torch.Tensor]] = {"bare": [], "recorded": []}
    sync_checked, sync_error, raised_at = [], None, None
    # health_read="deferred" on the CPU too, so --cpu runs the GPU's code path.
    rec = ckptlab.Recorder(
        run_dir,
        model,
        opt,
        step_fn=step,
        build_fn=build,
        ckpt_every=ckpt_every,
        on_anomaly=None,
        health_read="deferred",
    )
    sync_steps = sync_check_steps(steps, block, ckpt_every, planted[0])
    waits = count_health_waits() if device == "cuda" else None
    with rec:
        for first in range(0, steps, block):
            order = ["bare", "recorded"] if (first // block) % 2 == 0 else ["recorded", "bare"]
            for mode in order:
                sync(device)
                t0 = time.perf_counter()
                for i in range(first, min(first + block, steps)):
                    if mode == "bare":
                        losses[mode].append(step(bare_model, bare_opt, batches[i][0]).detach())
                        continue
                    try:
                        if device == "cuda" and i in sync_steps and sync_error is None:
                            torch.cuda.set_sync_debug_mode("error")
                            try:
                                losses[mode].append(rec.step(*batches[i]).detach())
                            finally:
                                torch.cuda.set_sync_debug_mode("default")
                            sync_checked.append(i)
                        else:
                            losses[mode].append(rec.step(*batches[i]).detach())
                    except ckptlab.NonFiniteLoss as e:
                        raised_at = (e.step, i)
                        break
                    except RuntimeError as e:
                        if "synchroniz" not in str(e):  # out of memory, a determinism error, ...: not (b)'s
                            raise
                        sync_error = f"step {i}: {e}\n{traceback.format_exc()}"  # where, in whose code
                        break
                sync(device)
                if first and first + block <= planted[0]:  # the first block warms up; stop before the NaN
                    times[mode].append(time.perf_counter() - t0)
            if raised_at is not None or sync_error is not None:
                break
    same_losses = len(losses["recorded"]) > 0 and all(
        torch.equal(a, b) or (a.isnan().all() and b.isnan().all()) for a, b in zip(losses["recorded"], losses["bare"])
    )
    ratios = [r / b for r, b in zip(times["recorded"], times["bare"])]

    planted_id = batches[planted[0]][1][planted[1]]
    report, replay_s, replay_error = None, None, None
    if len(losses["recorded"]) > planted[0]:  # (a sync error stops the recording early: nothing to replay)
        log("replaying the planted step ...")
        t0 = time.perf_counter()
        try:
            report = ckptlab.replay(run_dir, planted[0])
        except Exception:  # noqa: BLE001 - reported in the JSON line with the other figures
            replay_error = traceback.format_exc()
        replay_s = time.perf_counter() - t0
    else:
        replay_error = f"the recording stopped at step {len(losses['recorded'])}, before the planted step"
    named = [s.sample_id for s in report.samples] if report else []
    replayed = report.steps if report else []
    bit_exact = sum(c.match for c in replayed if c.step < planted[0])
    figures = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "parameters": n_params,
        "steps": steps,
        "block": block,
        "overhead_ratio_median": round(statistics.median(ratios), 4) if ratios else None,
        "overhead_ratio_total": round(sum(times["recorded"]) / sum(times["bare"]), 4) if ratios else None,
        "bare_ms_per_step": round(statistics.median(times["bare"]) / block * 1e3, 3) if ratios else None,
        "recorded_ms_per_step": round(statistics.median(times["recorded"]) / block * 1e3, 3) if ratios else None,
        "recorded_equals_bare": same_losses,
        "sync_free_steps": sync_checked if device == "cuda" else None,
        "sync_error": sync_error,
        # Not a sync by sync-debug's rules: the Recorder waiting at the end of step n+1 for step
        # n's health copy, i.e. the host running more than a step ahead of the device.
        "health_waits": waits if device == "cuda" else None,
        "nonfinite_raised": {"step": raised_at[0], "during_step": raised_at[1]} if raised_at else None,
        "replay_error": replay_error,
        "replay_from": replayed[0].step if replayed else None,
        "replayed_steps": len(replayed),
        "replay_bit_exact": bit_exact,
        "replay_deterministic": report.deterministic if report else None,
        "replay_s": round(replay_s, 2) if replay_s is not None else None,
        "root_step": report.root_step if report else None,
        "origin": report.origin.kind if report else None,
        "planted": {"step": planted[0], "row": planted[1], "sample_id": planted_id},
        "named_samples": named[:3],
        "verdict": report.verdict if report else None,
    }
    checks = {
        "a_overhead_measured": bool(ratios) and same_losses,
        "b_no_sync": sync_error is None and (device != "cuda" or sorted(sync_checked) == sorted(sync_steps)),
        "c_replay_bit_exact": report is not None
        and report.deterministic
        and bit_exact == len([c for c in replayed if c.step < planted[0]]),
        "d_verdict_names_sample": report is not None
        and report.root_step == planted[0]
        and bool(named)
        and named[0] == planted_id
        and raised_at is not None
        and raised_at[0] == planted[0]
        and raised_at[1] - planted[0] <= 1,
    }
    figures["checks"] = checks
    figures["ok"] = all(checks.values())
    for name, passed in checks.items():
        log(f"{'ok  ' if passed else 'FAIL'} {name}")
    return figures


def sync_check_steps(steps: int, block: int, ckpt_every: int, planted: int, health_every: int = 10) -> set[int]:
    """The recorded steps run under set_sync_debug_mode("error"): two ordinary steps after the
    warm-up block, one that measures update ratios (a multiple of health_every), none that
    checkpoints (the state's copy to host memory is a sync: documented, not checked here), and
    the planted NaN's step and the next (the anomaly is read and NonFiniteLoss raised there)."""
    ordinary = [s for s in range(block + 1, planted) if s % ckpt_every and s % health_every]
    measured = [s for s in range(block + 1, planted) if s % ckpt_every and not s % health_every]
    chosen = set(ordinary[:2] + measured[:1])
    chosen |= {s for s in (planted, planted + 1) if s < steps and s % ckpt_every}
    return chosen


def count_health_waits() -> dict:
    """Counts, in the returned dict, the CUDA events the Recorder had to wait on (their time
    included): torch.cuda.Event.synchronize, which only the deferred health read calls here."""
    waits = {"count": 0, "ms": 0.0}
    real = torch.cuda.Event.synchronize

    def timed(event):
        t0 = time.perf_counter()
        real(event)
        waits["count"] += 1
        waits["ms"] = round(waits["ms"] + (time.perf_counter() - t0) * 1e3, 3)

    torch.cuda.Event.synchronize = timed
    return waits


def log(msg: str) -> None:
    print(f"gpu_check: {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # e.g. deterministic-algorithm notes
        sys.exit(main())
