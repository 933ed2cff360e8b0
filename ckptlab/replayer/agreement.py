"""How closely a replay agrees with its record, and why its bits differ when they do.

    judge(report, checks, manifest)       # agreement: bit-exact | equivalent | diverged, deviations
    why_bits_differ(inv, report, trace)   # environment_diff, the twice-replayed step, bits_differ
    survives_noise(root, report)          # a reproduced fault that is not bit-exact: does it survive
                                          # ulp-level noise, or does it exist only through it?

Three levels (docs/replay.md, "Agreement with the record"):

- bit-exact: every replayed step before the fault has the recorded loss and gradient norm
  (and GradScaler scale, and each rank's loss), bit for bit;
- equivalent: not bit for bit, but each of those values within the round-off of the
  parameters' dtype: a relative deviation of at most TOL_ULPS units of round-off, growing with
  the square root of the steps replayed (round-off accumulates, and training amplifies it);
- diverged: beyond that, from the first step that is.

Steps from the fault on are judged by the fault itself (does it reproduce, does it survive
noise): a blow-up amplifies the last bits into any deviation.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ckptlab.numbers import same
from ckptlab.replayer.divergence import check_divergence
from ckptlab.replayer.findings import NoiseCheck, ReplayReport, StepCheck
from ckptlab.run.environment import capture, compare, describe
from ckptlab.training.crash import is_step_error

TOL_ULPS = 64  # the round-off one step may show, in units of the dtype's epsilon
MAX_TOLERANCE = 1e-2  # never call a replay equivalent beyond 1% (bfloat16 parameters)
EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}


def dtype_eps(manifest: dict) -> tuple[str, float]:
    """The coarsest floating dtype of the recorded parameters and its epsilon (float32 when
    none is recorded)."""
    found = [(EPS[p["dtype"]], p["dtype"]) for p in manifest.get("parameters", []) if p.get("dtype") in EPS]
    eps, name = max(found) if found else (EPS["float32"], "float32")
    return name, eps


def tolerance(eps: float, n: int) -> float:
    """The relative deviation allowed `n` steps after the first replayed one."""
    return min(TOL_ULPS * eps * math.sqrt(n + 1), MAX_TOLERANCE)


def rel_deviation(a: float | None, b: float | None) -> float:
    """|a - b| relative to the larger; 0 when equal bit for bit (NaN = NaN); inf when only one
    is finite, or one is missing."""
    if same(a, b):
        return 0.0
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b))


def _values(c: StepCheck) -> list[tuple[str, float | None, float | None]]:
    out: list[tuple[str, float | None, float | None]] = [("grad_norm", c.grad_norm, c.recorded_grad_norm)]
    if c.loss is not None or c.recorded_loss is not None:  # (two losses not known: nothing to compare)
        out.insert(0, ("loss", c.loss, c.recorded_loss))
    if c.grad_scale is not None or c.recorded_grad_scale is not None:
        out.append(("grad_scale", c.grad_scale, c.recorded_grad_scale))
    if c.rank_loss is not None:
        rec = c.recorded_rank_loss or []
        out += [(f"rank_loss[{r}]", a, rec[r] if r < len(rec) else None) for r, a in enumerate(c.rank_loss)]
    return out


@dataclass
class _Worst:
    dev: float = 0.0
    step: int | None = None
    value: str | None = None


def judge(report: ReplayReport, checks: list[StepCheck], manifest: dict) -> None:
    """Fill the report's agreement fields from `checks` (the replayed steps before the fault;
    the first replayed step when the fault is there)."""
    if not checks:
        return
    name, eps = dtype_eps(manifest)
    worst, grows, diverged = _Worst(), None, None
    first = checks[0].step
    for c in checks:
        if c.match:
            continue
        for what, got, rec in _values(c):
            dev = rel_deviation(got, rec)
            if dev > worst.dev:
                worst = _Worst(dev, c.step, what)
            if grows is None and dev > eps:
                grows = c.step
            tol = tolerance(eps, c.step - first)
            if diverged is None and dev > tol:
                diverged = {
                    "step": c.step,
                    "value": what,
                    "replayed": got,
                    "recorded": rec,
                    "rel_deviation": dev,
                    "tolerance": tol,
                }
    exact = all(c.match for c in checks)
    report.agreement = "bit-exact" if exact else "diverged" if diverged is not None else "equivalent"
    report.max_rel_deviation = worst.dev
    report.deviation = {
        "dtype": name,
        "tolerance": tolerance(eps, 0),
        "steps": len(checks),
        "bit_exact_steps": sum(1 for c in checks if c.match),
        "max_at": {"step": worst.step, "value": worst.value} if worst.step is not None else None,
        "grows_from": grows,
    }
    report.diverged_at = diverged


def why_bits_differ(inv, report: ReplayReport, trace: bool) -> None:
    """Not bit-exact: what differs from the recording machine, and (one process, `trace`)
    whether two replays of the first step off the record agree here."""
    t0 = time.perf_counter()
    alone = trace and inv.run.world_size == 1  # (a rank's share of a distributed run never matches)
    explain_bits(inv, report, (lambda step: check_divergence(inv, step)) if alone else None)
    inv.timing["agreement_s"] = time.perf_counter() - t0


def survives_noise(root, report: ReplayReport) -> None:
    """A reproduced fault in a replay that is not bit-exact (one process): `noise_check`. One
    that does not survive ulp-level noise reappeared only through it: not reproduced."""
    if report.agreement in (None, "bit-exact") or root.inv.run.world_size != 1:
        return
    root.inv.log(f"step {root.root} is not bit-exact: replaying it with ulp-level noise")
    report.noise_check = noise_check(root, root.inv.run.manifest)
    report.reproduced = report.noise_check.robust


def explain_bits(inv, report: ReplayReport, twice) -> None:
    """Why a replay that is not bit-exact differs: what differs from the recording machine
    (`environment_diff`), and, with `twice(step)` (divergence.py's check_divergence, or None
    when it cannot run), whether this machine's own replays of the first step off the record
    agree with each other. The reasons go to `bits_differ`."""
    manifest = inv.run.manifest
    recorded_device = str(manifest.get("device", "cpu"))
    gpu = recorded_device.startswith("cuda") or str(inv.replayer.device or "").startswith("cuda")
    report.environment_diff = compare(manifest.get("environment"), capture(), gpu=gpu)
    if report.agreement in (None, "bit-exact"):
        return
    reasons = []
    if isinstance(report.environment_diff, str):
        reasons.append("the run does not hold the environment it was recorded in (recorded before ckptlab kept it)")
    elif report.environment_diff:
        reasons.append(f"recorded in another environment: {describe(report.environment_diff)}")
    if inv.folded is not None:
        k, w = inv.folded
        reasons.append(
            f"replayed on {k} of the recorded {w} processes: the ranks' gradients were averaged in another order "
            "than the recorded all-reduce or reduce-scatter (a ring starts each chunk's sum at another rank)"
        )
    step = next((c.step for c in report.steps if not c.match), None)
    resumed = resumed_optimizer(manifest)
    if resumed is not None and step is not None and step > (report.start_checkpoint or 0):
        reasons.append(resumed)
    if step is not None and twice is not None:
        same_step = report.divergence if report.divergence is not None and report.divergence.step == step else None
        report.run_to_run = same_step or twice(step)
    rr = report.run_to_run
    if rr is not None and not rr.replays_agree:
        op = rr.first_nondeterministic_op or {}
        at = f": the first is {op.get('op')}" + (
            f" in `{op['module'] or '<root>'}`" if op.get("module") is not None else ""
        )
        reasons.append(
            f"nondeterministic kernels: two replays of step {rr.step} on this machine differ"
            + (f"{at} ({op.get('phase')}, op {op.get('index')})" if op else "")
        )
    elif rr is not None:
        reasons.append(
            f"two replays of step {rr.step} on this machine agree bit for bit, so the difference is with the "
            "recording, not this machine's own noise"
        )
    if step is not None and twice is not None and _replays_on_gpu(inv):
        with _without_deterministic_algorithms():
            free = report.run_to_run_without_deterministic = twice(step)
        if not free.replays_agree and (rr is None or rr.replays_agree):
            op = free.first_nondeterministic_op or {}
            reasons.append(
                f"nondeterministic GPU kernels: two replays of step {step} agree with deterministic algorithms, "
                f"not without them (the first op that differs: {op.get('op')})"
            )
    env = manifest.get("environment")
    det = env.get("deterministic") if isinstance(env, dict) else None
    if gpu and isinstance(det, dict) and not det.get("algorithms"):
        reasons.append("recorded on a GPU without deterministic algorithms")
    report.bits_differ = reasons


def resumed_optimizer(manifest: dict) -> str | None:
    """Why a replay from a checkpoint leaves the record from its second step whatever the
    machine: DeepSpeed's Adam on the CPU (its C++ build of FusedAdam, which a ZeRO run's
    optimizers name) keeps beta1^t and beta2^t as running float products, one multiplication
    per step, and computes them with `pow` when its step count jumps, as it does in a process
    that resumes at a checkpoint: the bias corrections differ in their last bits (a relative
    ~1e-7 in the losses of the steps after), while the uninterrupted run multiplied on."""
    classes = {o.get("class") for o in manifest.get("optimizers") or [] if isinstance(o, dict)}
    on_cpu = str(manifest.get("device", "cpu")).startswith("cpu")
    if manifest.get("layout") != "zero" or "FusedAdam" not in classes or not on_cpu:
        return None
    return (
        "DeepSpeed's Adam (FusedAdam's CPU build) keeps beta^t as a running product, which a replay resumed at a "
        "checkpoint recomputes with pow: its updates differ in the last bits from the replay's second step"
    )


def _replays_on_gpu(inv) -> bool:
    return str(inv.replayer.device or "").startswith("cuda")


@contextmanager
def _without_deterministic_algorithms():
    """Replay's own deterministic settings (on a GPU it turns them on) off for a while."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
    )
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic = saved[2]


def noise_check(root, manifest: dict) -> NoiseCheck:
    """The root step again, from the state it started in: once as is, and three times with every
    floating parameter moved by one unit of round-off (all up, all down, each at random). A fault
    present in every one is robust to the noise a replay that is not bit-exact carries; one that
    some of them lose sits at an edge (a value at the edge of overflow) and exists only through
    the last bits."""
    _, eps = dtype_eps(manifest)
    tried = []
    for how in ("as is", "up", "down", "random"):
        root.fresh()
        if how != "as is":
            _perturb(root.runner.model, eps, how)
        try:
            h = root.replayer.run_step(root.runner, root.rec)
            fault = bool(root.fault(h))
        except Exception as e:
            if not is_step_error(e):
                raise
            fault = True  # a step that raises under noise faults too
        tried.append((how, fault))
    faulted = [how for how, fault in tried if fault]
    return NoiseCheck(
        step=root.root,
        replays=len(tried),
        faulted=len(faulted),
        robust=len(faulted) == len(tried),
        perturbations=[f"{how}: {'fault' if fault else 'healthy'}" for how, fault in tried],
    )


def _perturb(model: torch.nn.Module, eps: float, how: str) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_floating_point() or not p.numel():
                continue
            if how == "random":
                sign = (torch.randint(0, 2, tuple(p.shape), generator=g) * 2 - 1).to(p.device, p.dtype)
            else:
                sign = torch.full_like(p, 1.0 if how == "up" else -1.0)
            p.mul_(1 + sign * eps)
