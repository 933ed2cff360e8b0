"""The report's thresholds (`HealthRules`, each with where it comes from) and what a detector
returns (`Finding`). The per-step anomaly rules (non-finite values, spikes, explosions) are not
here: they are analysis/anomalies.py's, shared with the Recorder and replay, and the defaults
below are theirs."""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptlab.analysis.anomalies import GRAD_EXPLOSION
from ckptlab.analysis.spikes import GRAD_RULE, LOSS_RULE, SpikeRule

SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}
# A GradScaler that starts at 2**16 backs off a handful of times and then skips about one step
# in its growth_interval (2000); skipping more than 5% of all steps loses real updates.
SCALER_SKIP_SHARE = 0.05


@dataclass(frozen=True)
class HealthRules:
    """Thresholds. Defaults follow common practice; the comment says where each comes from."""

    loss_spike: SpikeRule = LOSS_RULE  # OLMo-style robust z over a rolling window
    grad_spike: SpikeRule = GRAD_RULE
    grad_explosion: float = GRAD_EXPLOSION  # pre-clip global norm; typical healthy norms are O(0.1..10)
    grad_vanishing: float = 1e-6  # below this a float32 update is lost in rounding
    dead_fraction: float = 0.5  # a parameter whose gradient is exactly 0 in >= half the steps
    imbalance: float = 1e-2  # "two orders of magnitude" below (or above) its neighbours
    update_ratio_band: tuple[float, float] = (1e-3, 1e-1)  # CS231n / Karpathy: ~1e-3 is healthy
    weight_growth: float = 10.0  # a weight norm that grew 10x is exploding, not learning ...
    weight_growth_floor: float = 1.0  # ... from at least this x the other matrices' per-element scale (zero-init ones)
    fast_recovery: int = 20  # a spike recovered within 20 steps recovered "fast"
    patience: int = 3  # validation evaluations without improvement before it "turned up"
    overfit_rise: float = 0.02  # validation must end >= 2% above its best to call it overfitting ...
    overfit_noise: float = 4.0  # ... and by 4x its evaluation-to-evaluation noise (else: noise, ~1% false alarms)
    oscillation_spread: float = 0.3  # robust std of log-loss: typical swings of >= 35%
    oscillation_anticorrelation: float = -0.25  # lag-1 autocorrelation of the detrended log-loss
    plateau_band: float = 0.15  # log-loss stays within +-7.5% ...
    plateau_fraction: float = 0.2  # ... for >= 20% of the run ...
    plateau_escape: float = 0.3  # ... and later falls >= 26% below it (so it was not convergence)
    max_checkpoints: int = 6  # checkpoints read for weight histograms and drift
    precursor_window: int = 50  # steps before a loss spike searched for a gradient/update spike ...
    precursor_ratio: float = 10.0  # ... of at least 10x that parameter's median (and the loss rule's z)
    # Where the time went (system.py). A loop waiting on data 20% of its time leaves a fifth of the
    # device idle: the share at which PyTorch's performance guide calls a loop input-bound.
    input_bound_share: float = 0.2
    # ... a warning when the loop also waits at least 20 ms a step on average; below that (a toy
    # model's loop on a busy host: its own Python between steps) it is information.
    input_bound_wait: float = 0.02
    min_system_steps: int = 10  # steps with a data wait needed before any of these is judged
    slow_step_ratio: float = 3.0  # a loop turn 3x its neighbours' median (+ slow_step_floor seconds) ...
    slow_step_floor: float = 0.02  # ... 20 ms: below that a shared host's scheduling jitter looks the same
    slow_step_window: int = 10  # neighbours on each side
    slow_steps_share: float = 0.05  # slow steps that lose 5% of the loop's time are a warning, else info
    slow_steps_shown: int = 20
    long_batch: float = 2.0  # a batch with 2x the usual tokens (or rows) explains a slow step's compute
    throughput_drop: float = 0.3  # tokens/s 30% below the earlier level, staying there ...
    throughput_seconds: float = 60.0  # ... for at least a minute of the loop's time (not a busy moment of the host)
    mem_near_limit: float = 0.9  # peak memory at 90% of the device's (the allocator's headroom is ~5-10%)
    mem_rise: float = 0.05  # a steady rise of 5% of the limit over the run's second half is a leak
    flops_per_token: float | None = None  # the model's training FLOPs per token (for the MFU), given by the user
    peak_flops: float | None = None  # the device's peak FLOP/s (default: a known GPU's, system.py PEAK_FLOPS)


@dataclass
class Finding:
    kind: str
    severity: str  # "error" | "warning" | "info"
    title: str  # one line a person can act on
    steps: list[int] = field(default_factory=list)  # where to look (first ones)
    evidence: dict = field(default_factory=dict)  # the numbers that show it
    remedies: list[str] = field(default_factory=list)
    params: list[str] = field(default_factory=list)  # parameters involved, if any


def few(items: list[str], n: int = 3) -> str:
    """The first `n` names for a title, and how many more."""
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more
