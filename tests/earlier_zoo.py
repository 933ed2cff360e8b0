"""The earlier-cause zoo: scenarios whose cause lies before the replay window
(tests/earlier_models.py), with their ground truth, for tests/test_earlier_zoo.py and the
"earlier cause" column of scripts/bench_accuracy.py (docs/accuracy.md).

Ground truth per scenario: the symptom step (what a user asks about: the first non-finite
loss, or a finite spike's step), the cause step (the step whose removal prevents the fault; for
a restarted schedule, the first step that ran with it), the cause's sample ids ([]: no row,
the whole step), and the checkpoint boundaries between cause and symptom.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tests import earlier_models as em


@dataclass(frozen=True)
class EarlierScenario:
    name: str
    record: Callable  # record(run_dir) -> earlier_models.Earlier
    symptom: int
    cause: int
    samples: list = field(default_factory=list)
    what: str = ""  # one line for docs/accuracy.md

    @property
    def boundaries(self) -> int:
        """Checkpoints strictly after the cause, up to the symptom's window start."""
        return len([c for c in range(0, self.symptom + 1, em.CKPT_EVERY) if self.cause < c <= self.symptom])


def _e(name, symptom, cause, samples=(), what=""):
    return EarlierScenario(name, getattr(em, f"record_{name}"), symptom, cause, list(samples), what)


EARLIER: list[EarlierScenario] = [
    _e("token_sgd", 42, 37, [3702], "SGD: a corrupt count pushes a rare token's embedding row; NaN when next used"),
    _e("token_sgd_two", 42, 27, [2702], "the same, across two checkpoints"),
    _e("token_spike", 42, 37, [3702], "the same, smaller: a finite spike that recovers (a transient symptom)"),
    _e(
        "branch_sgd",
        43,
        36,
        [3602],
        "SGD: a corrupt importance weight pushes a rarely used branch (its LayerNorm, its zero-init output)",
    ),
    _e("branch_spike", 44, 38, [3802], "the same, smaller: a finite spike that recovers"),
    _e(
        "branch_adam",
        42,
        37,
        [3702],
        "Adam: a branch's first use meets an empty second moment (a sign-like update); a finite spike when next used",
    ),
    _e("branch_adam_two", 41, 26, [2602], "the same across two checkpoints: NaN"),
    _e("lr_restart", 50, 31, [], "a resumed session's scheduler built anew: the learning rate back at 20x"),
]

BY_NAME = {s.name: s for s in EARLIER}
