"""The earlier-cause zoo: faults whose cause lies one or two checkpoints before the symptom
(docs/replay.md, "Past the window"; docs/accuracy.md, the "earlier cause" column).

One model family: a bag-of-tokens Poisson regression (the log of a count) with a side branch
for a rare "modality" (rows flagged `m = 1` go through `proj -> LayerNorm`), and a fixed
readout. Two poisons whose loss looks normal: a corrupt count on a row whose prediction is
exactly 0 (its loss exp(0) - count * 0 = 1), and a corrupt importance weight (the step
function logs the plain mean loss but back-propagates the weighted one, as importance-sampled
and RL losses do). Either gives one row an enormous gradient. The poisoned row uses only what the rest of the window never
touches (the rare token's embedding row, or the side branch), so the state is primed silently:
the steps between look healthy, and the symptom comes when an ordinary row next uses the
primed part. A checkpoint every 10 steps; sample id `100 * step + row`.

Each `record_<name>(run_dir) -> Earlier` records one scenario; the registry is
tests/earlier_zoo.py. Build and step functions live at module level: replay imports them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.models import record_run

VOCAB, D, B, T = 16, 8, 6, 24
RARE = VOCAB - 1
POISON_ROW = 2
CKPT_EVERY = 10
SPIKE_COUNT, SPIKE_WEIGHT = 400.0, 30.0  # poisons that make a finite spike


@dataclass
class Earlier:
    cause: int  # the step whose removal prevents the fault
    symptom: int  # the step a user asks about (the first non-finite loss, or the spike)
    rows: list[int] = field(default_factory=list)  # the cause's rows to blame ([]: the whole step)

    @property
    def sample_ids(self) -> list[int]:
        return [100 * self.cause + r for r in self.rows]


class RareParts(nn.Module):
    def __init__(self, gate: float):
        super().__init__()
        self.gate = gate  # the side branch's scale
        self.emb = nn.Embedding(VOCAB, D)
        self.proj = nn.Linear(D, D)
        self.ln = nn.LayerNorm(D)
        self.out = nn.Linear(D, D, bias=False)  # the branch's output, zero-initialized (as adaLN-Zero)
        self.register_buffer("readout", torch.full((D,), 0.05))  # fixed: no gradient, no update
        with torch.no_grad():
            self.emb.weight.mul_(0.05)
            self.emb.weight[RARE].zero_()
            self.out.weight.zero_()

    def forward(self, ids, side, m):
        h = self.emb(ids).mean(1) + self.gate * m[:, None] * self.out(self.ln(self.proj(side)))
        return h @ self.readout * T  # the log of the predicted count


def _build(opt: str, lr: float, gate: float):
    torch.manual_seed(0)
    model = RareParts(gate)
    cls = torch.optim.SGD if opt == "sgd" else torch.optim.Adam
    return model, cls(model.parameters(), lr=lr)


def build_sgd():
    return _build("sgd", 1e-2, 1.0)


def build_adam():
    return _build("adam", 2e-2, 64.0)


def step(model, optimizer, batch):
    ids, side, m, counts, weight = batch
    per_row = F.poisson_nll_loss(model(ids, side, m), counts, log_input=True, reduction="none")
    (per_row * weight).mean().backward()  # importance-weighted
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return per_row.mean().detach()  # logged: the plain mean


def batches(n: int, poison: int | None, symptom: int, part: str, value: float):
    """Steps 0..n-1. At `poison`, row POISON_ROW uses only `part` and is corrupt: "token" -- a
    bag of the rare token (whose embedding row is 0, so its prediction is exactly 0 and its
    loss exp(0) - count * 0 = 1 looks normal) with the corrupt count `value`; "branch" -- the
    side branch, with the importance weight `value`. At `symptom`, row 1 is an ordinary row
    that uses `part`."""
    g = torch.Generator().manual_seed(7)
    for s in range(n):
        ids = torch.randint(0, RARE, (B, T), generator=g)
        side = torch.randn(B, D, generator=g)
        counts = torch.poisson(torch.full((B,), 1.0), generator=g)
        m, weight = torch.zeros(B), torch.ones(B)
        if s == poison:
            ids[POISON_ROW] = RARE
            if part == "token":
                counts[POISON_ROW] = value
            else:
                m[POISON_ROW], weight[POISON_ROW], counts[POISON_ROW] = 1.0, value, 4.0  # (a count != exp(0))
        if s == symptom:
            if part == "token":
                ids[1] = RARE
            else:
                m[1] = 1.0
        yield (ids, side, m, counts, weight), [100 * s + r for r in range(B)]


def _record(run_dir, build, scenario_batches, **kw) -> list[float]:
    kw = {"ckpt_every": CKPT_EVERY, "health_every": 5, "keep_last": 10, **kw}
    return record_run(run_dir, build, step, scenario_batches, **kw)


def _first_bad(losses: list[float], after: int) -> int:
    """The first non-finite loss after `after`, else the largest (a finite spike)."""
    later = list(enumerate(losses))[after + 1 :]
    bad = [i for i, v in later if not math.isfinite(v)]
    return bad[0] if bad else max(later, key=lambda iv: iv[1])[0]


def _scenario(run_dir, build, poison, symptom, part, value, n=None) -> Earlier:
    losses = _record(run_dir, build, batches(n or symptom + 1, poison, symptom, part, value))
    return Earlier(poison, _first_bad(losses, poison), [POISON_ROW])


# --- the scenarios -------------------------------------------------------------------------------


def record_token_sgd(run_dir) -> Earlier:
    """SGD; the rare token's row poisoned at 37, used again at 42: across one checkpoint (40)."""
    return _scenario(run_dir, build_sgd, 37, 42, "token", 1e4)


def record_token_sgd_two(run_dir) -> Earlier:
    """The same across two checkpoints: poisoned at 27, used at 42 (30 and 40 are primed)."""
    return _scenario(run_dir, build_sgd, 27, 42, "token", 1e4)


def record_token_spike(run_dir) -> Earlier:
    """A smaller corrupt count: step 42's loss spikes, finite, and the run goes on (a transient
    symptom)."""
    return _scenario(run_dir, build_sgd, 37, 42, "token", SPIKE_COUNT, n=48)


def record_branch_sgd(run_dir) -> Earlier:
    """SGD; the side branch's zero-initialized output pushed by a corrupt weight at 36, next
    used at 43."""
    return _scenario(run_dir, build_sgd, 36, 43, "branch", 1e4)


def record_branch_spike(run_dir) -> Earlier:
    """The side branch, a smaller weight: a finite spike at 44."""
    return _scenario(run_dir, build_sgd, 38, 44, "branch", SPIKE_WEIGHT, n=50)


def record_branch_adam(run_dir) -> Earlier:
    """Adam, no corrupt value at all: the side branch is first used at 37, so its output's
    second moment is empty and its first update is a sign-like step of lr per element; the
    branch is next used at 42 (one checkpoint later)."""
    return _scenario(run_dir, build_adam, 37, 42, "branch", 1.0)


def record_branch_adam_two(run_dir) -> Earlier:
    """The same, first used at 26 and next at 41: across two checkpoints."""
    return _scenario(run_dir, build_adam, 26, 41, "branch", 1.0)


# --- a learning-rate schedule that restarts on resume ---------------------------------------------
# A linear regression trained with SGD and a step schedule (lr 0.5, x0.1 from step 20) whose
# data changes scale at step 25 (a curriculum: the decayed rate is what keeps the larger inputs
# stable). The run is resumed at step 30 by a script that restores the model and the optimizer
# itself but builds a fresh scheduler (before loading the optimizer's state, so step 30 still
# runs at the old rate): from step 31 the rate is 0.5 again, 20x the decayed one, and the error
# on the large inputs grows several-fold per step. No single step is to blame: the first step
# of the restarted schedule (31) is the cause; checkpoint 30 holds the earlier session's
# scheduler, not the one the resumed session ran with.

RESUME = 30


def build_restart():
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < 20 else 0.05)


def step_restart(model, optimizer, batch):
    x, y = batch
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def restart_batches(first: int, last: int):
    g = torch.Generator().manual_seed(11)
    w = torch.randn(8, 1, generator=g)
    for s in range(last + 1):
        x = torch.randn(B, 8, generator=g) * (1.0 if s < 25 else 1.5)
        y = x @ w + 0.01 * torch.randn(B, 1, generator=g)
        if s >= first:
            yield (x, y), [100 * s + r for r in range(B)]


def record_lr_restart(run_dir) -> Earlier:
    """Steps 0..29, then a resumed session whose scheduler restarted, to step 50 (the symptom:
    the largest loss, or the first non-finite one)."""
    import ckptlab

    model, opt, sched = build_restart()
    kw = {"ckpt_every": CKPT_EVERY, "health_every": 5, "keep_last": 10}
    losses = []
    with ckptlab.Recorder(
        run_dir, model, opt, step_fn=step_restart, build_fn=build_restart, scheduler=sched, **kw
    ) as rec:
        for batch, ids in restart_batches(0, RESUME - 1):
            losses.append(rec.step(batch, sample_ids=ids).item())
        rec.checkpoint()
    # The resumed script: the model and the optimizer restored by hand, the schedule built anew.
    model2, opt2, fresh = build_restart()
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(opt.state_dict())
    fresh_kw = {**kw, "resume": True, "restore": False}
    with ckptlab.Recorder(
        run_dir, model2, opt2, step_fn=step_restart, build_fn=build_restart, scheduler=fresh, **fresh_kw
    ) as rec:
        for batch, ids in restart_batches(RESUME, 50):
            try:
                losses.append(rec.step(batch, sample_ids=ids).item())
            except ckptlab.NonFiniteLoss:
                losses.append(math.nan)
                break
    return Earlier(RESUME + 1, _first_bad(losses, RESUME), [])
