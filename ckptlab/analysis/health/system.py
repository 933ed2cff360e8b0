"""Where the steps' time went (the step records' system fields, record/system.py): a loop that
waits for its data (`input_bound`), steps far slower than their neighbours and why
(`slow_steps`), a throughput that falls and stays down (`throughput_drop`), memory near the
device's limit, rising towards it, or swapped out (`memory_pressure`), and the model FLOPs
utilization when the user gives the model's FLOPs per token (`mfu`). docs/report.md gives
each rule."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ckptlab.analysis.batches import leaves
from ckptlab.analysis.health.inputs import RunData
from ckptlab.analysis.health.rules import Finding, HealthRules
from ckptlab.analysis.spikes import sorted_median
from ckptlab.numbers import human_bytes
from ckptlab.run.reader import Metrics

# The kinds of finding this module makes: they describe the machine's time as much as the
# training (a test run's depend on the host's load that minute).
KINDS = ("input_bound", "slow_steps", "throughput_drop", "memory_pressure", "mfu")
# The order in which a slow step's causes are named when several explain it.
CAUSES = ("checkpoint", "gc", "recompile", "long_batch", "data_wait", "validation", "compute")
# The causes a person can act on within the loop: slow steps that lose time to them are a
# warning. A data wait is input_bound's to judge; a validation is time well spent; slowness the
# record shows no cause for is most often the machine's other load.
ACTIONABLE = ("checkpoint", "gc", "recompile", "long_batch")


def _turns(d: RunData) -> np.ndarray:
    """The rows whose loop turn is judged: those with a data wait (not a session's first step),
    and none that a validation preceded (its evaluation ran in the turn, counted as data wait)."""
    m = d.m
    judged = np.isfinite(m.wall_time) & np.isfinite(m.data_wait)
    validated = np.isin(m.step, _validated(d))
    return np.flatnonzero(judged & ~validated)


def _validated(d: RunData) -> list[int]:
    return [int(v["step"]) for v in d.run.validation()]


def input_bound(d: RunData, rules: HealthRules) -> list[Finding]:
    """The loop spent at least `input_bound_share` of its time outside `rec.step`, waiting for
    its next batch (or logging: whatever the loop does between steps). The turns in which it
    evaluated (a validation was recorded before the step) are left out. Information only when
    the wait averages under `input_bound_wait` a step."""
    m = d.m
    rows = _turns(d)
    if len(rows) < rules.min_system_steps:
        return []
    wait, wall = float(m.data_wait[rows].sum()), float(m.wall_time[rows].sum())
    share = wait / wall if wall > 0 else 0.0
    if share < rules.input_bound_share:
        return []
    worst = rows[np.argsort(-m.data_wait[rows], kind="stable")][:10]
    steady = float(np.median(m.data_wait[rows]))
    return [
        Finding(
            kind="input_bound",
            severity="warning" if wait / len(rows) >= rules.input_bound_wait else "info",
            title=f"the loop waits for its data {share:.0%} of its time ({wait:.3g} s of {wall:.3g} s "
            "between steps, outside rec.step)",
            steps=sorted(int(m.step[i]) for i in worst),
            evidence={
                "share": round(share, 4),
                "data_wait_s": round(wait, 6),
                "wall_time_s": round(wall, 6),
                "steps": len(rows),
                "median_data_wait_s": steady,
                "longest_waits": {int(m.step[i]): float(m.data_wait[i]) for i in worst},
            },
            remedies=[
                "more DataLoader workers (num_workers), with persistent_workers=True and prefetch_factor >= 2",
                "pin_memory=True and .to(device, non_blocking=True) for the host-to-device copy",
                "decode, tokenize and augment ahead of time (a preprocessed, memory-mapped dataset) "
                "instead of in the loop",
                "log, evaluate and print less often: they count as time outside the step too",
                "waits on a few steps only (see longest_waits): a slow shard, file or remote read at those samples",
            ],
        )
    ]


def slow_steps(d: RunData, rules: HealthRules) -> list[Finding]:
    """Steps whose loop turn (`wall_time`) took at least `slow_step_ratio` times the median of
    their neighbours' and `slow_step_floor` seconds more, each with its cause when the record
    shows one. A session's first step (no data wait: it carries the start's one-time costs) is
    not judged; a step a validation preceded is, its cause `validation` when its wait grew most.
    A warning when the steps slow for an ACTIONABLE cause lose `slow_steps_share` of the loop's
    time, else information."""
    m = d.m
    rows = np.flatnonzero(np.isfinite(m.wall_time) & np.isfinite(m.data_wait))
    if len(rows) < rules.min_system_steps:
        return []
    wall = m.wall_time[rows]
    usual = _neighbour_median(wall, rules.slow_step_window)
    slow = np.flatnonzero((wall >= rules.slow_step_ratio * usual) & (wall - usual >= rules.slow_step_floor))
    if not len(slow):
        return []
    found = [_slow_step(d, rows, int(j), rules) for j in slow]
    excess = float(sum(s["wall_time"] - s["usual_wall_time"] for s in found))
    acted = float(sum(s["wall_time"] - s["usual_wall_time"] for s in found if s["cause"] in ACTIONABLE))
    total = float(wall.sum())
    causes = sorted({s["cause"] for s in found}, key=CAUSES.index)
    shown = found[: rules.slow_steps_shown]
    return [
        Finding(
            kind="slow_steps",
            severity="warning" if acted >= rules.slow_steps_share * total else "info",
            title=f"{len(found)} step(s) far slower than their neighbours (causes: {', '.join(causes)}), "
            f"{excess:.3g} s lost ({excess / total:.0%} of the loop's time)",
            steps=[s["step"] for s in shown],
            evidence={
                "count": len(found),
                "lost_s": round(excess, 6),
                "share": round(excess / total, 4) if total > 0 else 0.0,
                "steps": shown,
            },
            remedies=_slow_remedies(causes, {s["cause"]: s["step"] for s in reversed(found)}),
        )
    ]


def _neighbour_median(x: np.ndarray, window: int) -> np.ndarray:
    """Each value's usual level: the median of the `window` values on each side (itself left
    out; fewer at the ends). The full windows in one vectorized pass (a million steps in ~1 s)."""
    x = x.astype(np.float64)
    out = np.empty(len(x))
    if len(x) > 2 * window:
        full = np.lib.stride_tricks.sliding_window_view(x, 2 * window + 1)  # (n - 2w, 2w + 1)
        out[window : len(x) - window] = np.median(np.delete(full, window, axis=1), axis=1)
        edges = [*range(window), *range(len(x) - window, len(x))]
    else:
        edges = list(range(len(x)))
    for i in edges:
        near = np.concatenate([x[max(0, i - window) : i], x[i + 1 : i + 1 + window]])
        out[i] = np.median(near) if len(near) else x[i]
    return out


def _slow_step(d: RunData, rows: np.ndarray, j: int, rules: HealthRules) -> dict:
    """One slow step: its times against its neighbours' and its cause (the part of the loop's
    turn that grew most; the step's own compute explained by a recompilation or a long batch)."""
    m, i = d.m, int(rows[j])
    near = np.concatenate([rows[max(0, j - rules.slow_step_window) : j], rows[j + 1 : j + 1 + rules.slow_step_window]])

    def usual(a: np.ndarray) -> float:
        """np.median of a[near]'s finite values (0 when none), on a few dozen Python floats: a
        long run has thousands of slow steps, and np.median's fixed cost is most of a call."""
        values = sorted(v for v in a[near].tolist() if math.isfinite(v))
        return sorted_median(values) if values else 0.0

    out: dict[str, Any] = {"step": int(m.step[i]), "wall_time": float(m.wall_time[i])}
    out["usual_wall_time"] = usual(m.wall_time)
    grew = {
        "data_wait": float(m.data_wait[i]) - usual(m.data_wait),
        "checkpoint": float(m.ckpt_time[i]) - usual(m.ckpt_time),
        "gc": float(m.gc_time[i]),
        "compute": float(m.step_time[i]) - usual(m.step_time),
    }
    for key in ("data_wait", "step_time", "ckpt_time", "gc_time"):
        out[key] = float(getattr(m, key)[i])
    cause = max(grew, key=lambda k: grew[k])
    if cause == "data_wait" and int(m.step[i]) in _validated(d):
        cause = "validation"
    detail = _detail(cause, grew[cause if cause != "validation" else "data_wait"])
    if cause == "compute":
        cause, detail = _compute_cause(d, i, usual, grew["compute"], rules.long_batch)
    out["cause"], out["detail"] = cause, detail
    if m.recompiles[i] > 0:
        out["recompiles"] = int(m.recompiles[i])
        out["batch_shape"] = batch_shape(d, int(m.step[i]))
    if np.isfinite(m.tokens[i]):
        out["tokens"], out["usual_tokens"] = int(m.tokens[i]), usual(m.tokens)
    return out


def _detail(cause: str, grew: float) -> str:
    return {
        "data_wait": f"waited {grew:.3g} s longer than usual for its batch (outside rec.step)",
        "checkpoint": f"ckptlab's checkpoint write took {grew:.3g} s more than usual on the training thread",
        "gc": f"the garbage collector paused the loop for {grew:.3g} s",
        "validation": f"the loop evaluated before it ({grew:.3g} s longer than a usual turn's wait)",
    }.get(cause, "")


def _compute_cause(d: RunData, i: int, usual, grew: float, long_batch: float) -> tuple[str, str]:
    """Why the step's own compute took `grew` seconds more: a recompilation, a batch much
    longer than usual, or nothing the record shows."""
    m = d.m
    if m.recompiles[i] > 0:
        shape = batch_shape(d, int(m.step[i]))
        return (
            "recompile",
            f"torch.compile compiled {int(m.recompiles[i])} graph(s) in it (+{grew:.3g} s), for the batch {shape}",
        )
    for key in ("tokens", "samples"):
        size, typical = float(getattr(m, key)[i]), usual(getattr(m, key))
        if np.isfinite(size) and typical > 0 and size >= long_batch * typical:
            return (
                "long_batch",
                f"its batch held {size:.0f} {key}, {size / typical:.3g}x the usual {typical:.0f} (+{grew:.3g} s)",
            )
    return (
        "compute",
        f"step_fn took {grew:.3g} s longer than usual, and the record shows no reason (a slow path in the model?)",
    )


def batch_shape(d: RunData, step: int) -> str:
    """The shapes of a step's recorded batch, as `ids (6, 16), y (6,)` (`?` when unreadable)."""
    try:
        batch, _ = d.run.batch(step)
    except Exception:  # noqa: BLE001 - a batch we cannot read only leaves the shape unknown
        return "?"
    shapes = [f"{path} {tuple(np.shape(v))}" for path, v in leaves(batch)]
    return ", ".join(shapes[:6]) if shapes else "?"


def _slow_remedies(causes: list[str], first: dict[str, int]) -> list[str]:
    """The remedies of the causes found; `first`: each cause's first step."""
    said = {
        "checkpoint": "checkpoints: write them in the background (async_sharded=True for sharded ones), less often "
        "(ckpt_every), or to faster storage",
        "gc": "garbage-collector pauses: gc.freeze() after building the model and loader, or gc.disable() in the "
        "loop with a gc.collect() every N steps",
        "recompile": "recompilations: pad batches to a few fixed shapes (bucketing), mark the varying dimension "
        "dynamic (torch._dynamo.mark_dynamic), or compile with dynamic=True",
        "long_batch": "long batches: cap or bucket sequence lengths, or pack sequences to a fixed length",
        "data_wait": "data waits: see the input_bound remedies (more workers, prefetching, a faster source)",
        "validation": "validations: evaluate less often, or on fewer batches, if their time matters",
        "compute": "unexplained compute: replay the step timed and profiled, to see whether its slowness comes back "
        f"(the step's own: the module, op and line) or not (the machine's): ckptlab replay --step {first.get('compute')} "
        "--profile",
    }
    return [said[c] for c in causes]


def throughput_drop(d: RunData, rules: HealthRules) -> list[Finding]:
    """Tokens/s (samples/s where no tokens are known) fell by at least `throughput_drop` and
    stayed down for `throughput_seconds` of the loop's time at least: the run split where it best parts into two levels, the later one's median at
    least that much below the earlier one's, with at least 80% of the later steps below the
    midpoint of the two."""
    m = d.m
    key = "tokens" if np.isfinite(m.tokens).sum() >= rules.min_system_steps else "samples"
    rate = getattr(m, f"{key}_per_s")
    rows = np.flatnonzero(np.isfinite(rate) & np.isfinite(m.data_wait))
    if len(rows) < 2 * rules.min_system_steps:
        return []
    r = rate[rows]
    k, ratio = _worst_split(r, rules.min_system_steps // 2)
    before, after = float(np.median(r[:k])), float(np.median(r[k:]))
    stays = float(np.mean(r[k:] < (before + after) / 2))
    lasted = float(m.wall_time[rows[k:]].sum())
    if ratio > 1 - rules.throughput_drop or stays < 0.8 or lasted < rules.throughput_seconds:
        return []
    first = int(m.step[rows[k]])
    part = {"data_wait": m.data_wait, "step_time": m.step_time, "ckpt_time": m.ckpt_time}
    grew = {n: float(np.median(a[rows[k:]]) - np.median(a[rows[:k]])) for n, a in part.items()}
    why = max(grew, key=lambda n: grew[n])
    return [
        Finding(
            kind="throughput_drop",
            severity="warning",
            title=f"{key}/s fell {1 - ratio:.0%} from step {first} and stayed down "
            f"({before:.4g} -> {after:.4g}; {why} grew most, by {grew[why]:.3g} s a step)",
            steps=[first],
            evidence={
                "rate": f"{key}_per_s",
                "before": before,
                "after": after,
                "ratio": ratio,
                "lasted_s": lasted,
                "from_step": first,
                "stayed_down": round(stays, 3),
                "grew_s": grew,
            },
            remedies=[
                "data_wait grew: the input pipeline slowed (a slower shard or storage, a worker that died, "
                "a cache that filled): see input_bound",
                "step_time grew: longer sequences, a recompiled or slower code path, thermal or power throttling, "
                "or another job on the device",
                "ckpt_time grew: checkpoints got larger or the storage slower",
                "memory fragmentation or swapping (see memory_pressure)",
            ],
        )
    ]


def _worst_split(r: np.ndarray, margin: int) -> tuple[int, float]:
    """(k, median(r[k:]) / median(r[:k])) at the k that splits log(r) best into two levels (the
    least squared error about the two parts' means), k at least `margin` from either end."""
    x = np.log(np.maximum(r, 1e-300))
    n = len(x)
    k = np.arange(margin, n - margin + 1)
    c1, c2 = np.concatenate([[0.0], np.cumsum(x)]), np.concatenate([[0.0], np.cumsum(x * x)])
    left = c2[k] - c1[k] ** 2 / k
    right = (c2[n] - c2[k]) - (c1[n] - c1[k]) ** 2 / (n - k)
    best = int(k[np.argmin(left + right)])
    before = float(np.median(r[:best]))
    return best, float(np.median(r[best:])) / before if before > 0 else np.inf


def memory_pressure(d: RunData, rules: HealthRules) -> list[Finding]:
    """Peak memory at `mem_near_limit` of the device's (CUDA) or host's (RSS) memory, or rising
    steadily towards it, or some of the process's memory swapped out."""
    m = d.m
    mem = np.flatnonzero(np.isfinite(m.mem_peak))
    limits = m.mem_limit[np.isfinite(m.mem_limit)]
    out = []
    if len(mem) and len(limits):
        limit = float(limits.min())
        i = int(mem[np.argmax(m.mem_peak[mem])])
        peak = float(m.mem_peak[i])
        rising = _rising(m, mem, limit, rules)
        if peak >= rules.mem_near_limit * limit:
            out.append(
                _memory_finding(
                    f"peak memory {human_bytes(peak)} at step {int(m.step[i])} is "
                    f"{peak / limit:.0%} of the {human_bytes(limit)} there is",
                    [int(m.step[i])],
                    {"peak": peak, "limit": limit, "share": peak / limit},
                )
            )
        elif rising is not None:
            out.append(_memory_finding(rising[0], [rising[1]], {**rising[2], "limit": limit}))
    swapped = np.flatnonzero(m.swap > 0)
    if len(swapped):
        i = int(swapped[np.argmax(m.swap[swapped])])
        out.append(
            _memory_finding(
                f"{human_bytes(float(m.swap[i]))} of the process's memory was swapped out "
                f"(step {int(m.step[i])}): host memory is short",
                [int(m.step[j]) for j in swapped[:10]],
                {"swap": float(m.swap[i])},
            )
        )
    return out


def _rising(m: Metrics, rows: np.ndarray, limit: float, rules: HealthRules) -> tuple[str, int, dict] | None:
    """Memory that grows steadily over the run's second half (a leak): by at least
    `mem_rise` of the limit, in at least 80% of its windows; with the step it would reach the limit at."""
    if len(rows) < 2 * rules.min_system_steps:
        return None
    half = rows[len(rows) // 2 :]
    x, y = m.step[half].astype(np.float64), m.mem_peak[half]
    slope, icept = np.polyfit(x, y, 1)
    chunks = np.array_split(y, 10)
    ups = np.mean(np.diff([np.median(c) for c in chunks]) > 0)
    if slope <= 0 or slope * (x[-1] - x[0]) < rules.mem_rise * limit or ups < 0.8:
        return None
    at = int((limit - icept) / slope)
    text = (
        f"memory rises steadily: {human_bytes(float(y[0]))} -> {human_bytes(float(y[-1]))} over steps "
        f"{int(x[0])}..{int(x[-1])}; at this rate it reaches the {human_bytes(limit)} limit near step {at}"
    )
    return (
        text,
        int(x[-1]),
        {"first": float(y[0]), "last": float(y[-1]), "bytes_per_step": float(slope), "full_at_step": at},
    )


def _memory_finding(title: str, steps: list[int], evidence: dict) -> Finding:
    return Finding(
        kind="memory_pressure",
        severity="warning",
        title=title,
        steps=steps,
        evidence=evidence,
        remedies=[
            "a smaller micro-batch with gradient accumulation, activation checkpointing, or mixed precision",
            "memory that keeps rising is kept alive by the loop: losses or outputs stored without .item() or "
            ".detach(), growing lists or caches",
            "on the CPU: fewer or lighter DataLoader workers, or a machine with more RAM; swapping slows every step",
            "CUDA: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against fragmentation",
        ],
    )


# Dense bf16/fp16 tensor-core peaks, FLOP/s, from the vendors' datasheets (without sparsity;
# the SXM parts): the denominator of `mfu` when the run's GPU is one of them and no
# --peak-flops is given. Matched as a word in the manifest's GPU name.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
    "V100": 125e12,
    "4090": 165e12,
}


def mfu(d: RunData, rules: HealthRules) -> list[Finding]:
    """Model FLOPs utilization when the user gives the model's training FLOPs per token
    (`flops_per_token`, ~6 x parameters for a transformer): tokens/s x FLOPs per token over the
    device's peak (`peak_flops`, or PEAK_FLOPS of the recorded GPU), over the judged steps' median."""
    if not rules.flops_per_token:
        return []
    m = d.m
    rate = m.tokens_per_s[np.isfinite(m.tokens_per_s) & np.isfinite(m.data_wait)]
    if not len(rate):
        return []
    gpu = (d.run.manifest.get("environment") or {}).get("gpu") or {}
    peak = rules.peak_flops or _peak_of(str(gpu.get("name") or ""))
    achieved = float(np.median(rate)) * rules.flops_per_token
    evidence: dict[str, Any] = {
        "tokens_per_s": float(np.median(rate)),
        "flops_per_token": rules.flops_per_token,
        "achieved_flops": achieved,
        "peak_flops": peak,
    }
    if not peak:
        title = f"{achieved:.3g} FLOP/s achieved; the device's peak is not known (give --peak-flops for the MFU)"
    else:
        evidence["mfu"] = achieved / peak
        title = f"MFU {achieved / peak:.1%}: {achieved:.3g} of the device's {peak:.3g} FLOP/s"
    return [
        Finding(
            kind="mfu",
            severity="info",
            title=title,
            evidence=evidence,
            remedies=[
                "the loop's whole turn counts (data waits, checkpoints): fix input_bound and slow_steps first",
                "bf16 autocast, torch.compile, fused optimizers and larger micro-batches raise the device's share",
            ],
        )
    ]


def _peak_of(name: str) -> float | None:
    words = name.replace("-", " ").split()
    return next((flops for key, flops in PEAK_FLOPS.items() if key in words), None)
