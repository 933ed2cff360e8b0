"""What `ckptlab dirty` finds and by which rules: `DirtyRules` (the thresholds), the base score
of each reason, and the results, `DirtyRow` (one suspicious row or step) and `DirtyReport`.
Their fields are the JSON of `ckptlab dirty --json`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ckptlab.analysis.spikes import GRAD_RULE, LOSS_RULE, SpikeRule

# attribute(run, step[, rank=r]) -> [(row, sample_id, loss, grad_norm) | {"row": ...} | SampleBlame]
Attribute = Callable[..., Iterable[Any]]

# Base scores: how sure a reason alone makes us that a row is bad.
SCORES = {
    "nonfinite": 100.0,
    "out_of_range": 90.0,
    "nonfinite_loss": 85.0,
    "nonfinite_grad": 85.0,
    "attributed": 80.0,
    "extreme": 70.0,
    "loss_spike": 60.0,
    "grad_spike": 55.0,
    "all_padding": 50.0,
    "empty": 50.0,
    "duplicate": 30.0,
    "length": 20.0,
}
CORROBORATED = 15.0  # a content flag in a step whose loss/gradient also went wrong
DOWNSTREAM_PENALTY = 50.0  # a step that failed because an earlier update made the weights non-finite
# Reasons whose rows go into the skip list. Length outliers are reported but kept: long or
# short documents are usually legitimate.
SKIP_REASONS = frozenset(SCORES) - {"length"}


@dataclass(frozen=True)
class DirtyRules:
    extreme_z: float = 10.0  # robust z (median/MAD) a value must exceed to be "extreme"
    length_z: float = 6.0  # robust z of a row's length ...
    length_ratio: float = 4.0  # ... and >= 4x shorter/longer than the median length
    max_features: int = 64  # per-feature statistics for fields up to this many values per row
    ignore_index: int = -100  # a negative label that is not out of range (cross_entropy's default)
    loss_spike: SpikeRule = LOSS_RULE
    grad_spike: SpikeRule = GRAD_RULE
    attribution_ratio: float = 3.0  # a row is to blame at >= 3x the other rows' median loss (or squared grad norm) ...
    attribution_share: float = 0.2  # ... carrying >= 20% of the batch's excess over its median
    max_attribute: int = 20  # flagged steps replayed for attribution, worst first


DEFAULT_RULES = DirtyRules()


@dataclass
class DirtyRow:
    step: int
    row: int | None  # None: the whole batch (a step flag without a row to blame)
    sample_id: Any
    reason: str
    evidence: dict
    score: float
    rank: int | None = None  # distributed runs: whose micro-batch (None: one process, or a step flag)


@dataclass
class DirtyReport:
    run: str
    scanned: dict  # steps, rows, fields, seconds, batches_per_s
    data_info: dict  # pad_id / vocab_size used, and where they came from
    rules: DirtyRules
    flagged: list[DirtyRow]  # ranked, most suspicious first
    steps: list[dict]  # dynamic flags: {step, kind, value, median, z, batch}
    attribution: dict  # {"status": "done" | "unavailable" | "off" | "nothing to attribute", ...}
    skip_ids: list  # sample ids a resumed run should skip
    notes: list[str] = field(default_factory=list)
    verdict: str = ""
