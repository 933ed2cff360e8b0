"""The classic word-language-model loop, without an optimizer object: an LSTM on sequence-first
`(bptt, batch)` chunks, its hidden state carried from step to step in buffers
(tests/carried_models.py), gradients clipped with `clip_grad_norm_`, and the weights updated
by hand, `p.data.add_(p.grad, alpha=-lr)`, with the learning rate read from the
`ckptlab.HandUpdate` the Recorder made (`Recorder(model, None, lr=...)`).

Build and step functions live at module level: replay imports them by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ckptlab
from tests.carried_models import VOCAB, CarriedLSTM, chunk  # noqa: F401 - chunk: the data, for the tests

LR = 1.0


def build():
    """The model alone: there is no optimizer to build (replay makes the HandUpdate)."""
    torch.manual_seed(0)
    return CarriedLSTM()


def _loss(model, batch):
    tokens, targets, scale = batch  # (T, B) ints, (T, B) ints, (B,) floats
    logits = model(tokens, scale)
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def step(model, update, batch):
    loss = _loss(model, batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-update.lr)
    model.zero_grad()
    return loss


def build_pair():
    """`(model, None)`: the other shape a build_fn of a hand-written update may return."""
    return build(), None


def step_own_lr(model, update, batch):
    """A learning rate the loop keeps to itself (ckptlab was not told it: unknown)."""
    loss = _loss(model, batch)
    loss.backward()
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-LR)
    model.zero_grad()
    return loss


def step_grads_dropped(model, update, batch):
    """No clipping, and the gradients dropped by hand (`p.grad = None`): nothing but the end
    of the backward pass can measure them."""
    loss = _loss(model, batch)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= update.lr * p.grad
            p.grad = None
    return loss


# --- the same loop with torch.optim.SGD, its learning rate spiked by a scheduler --------------

SPIKE, SPIKE_STEP = 100.0, 18  # the learning rate times SPIKE at step SPIKE_STEP only


def build_sgd():
    torch.manual_seed(0)
    model = CarriedLSTM()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, _spiky)


def _spiky(s: int) -> float:  # module level: a scheduler's lambda is rebuilt by build_sgd
    return SPIKE if s == SPIKE_STEP else 1.0


def step_sgd(model, optimizer, batch):
    loss = _loss(model, batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


# --- an optimizer that is not the one that steps ------------------------------------------------


def build_with_sgd():
    torch.manual_seed(0)
    model = CarriedLSTM()
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def step_own_optimizer(model, optimizer, batch):
    """A trainer's step that updates with an optimizer of its own making, not the one it is
    given: its momentum is in no checkpoint, so a replay from one cannot follow the record."""
    own = getattr(model, "_own_optimizer", None)
    if own is None:
        own = model._own_optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loss = _loss(model, batch)
    loss.backward()
    own.step()
    own.zero_grad(set_to_none=True)
    return loss


# --- a HandUpdate made by build_fn, with an LR scheduler ----------------------------------------


def build_scheduled():
    torch.manual_seed(0)
    model = CarriedLSTM()
    update = ckptlab.HandUpdate(model.parameters(), lr=LR)
    return model, update, torch.optim.lr_scheduler.LambdaLR(update, _halving)


def _halving(s: int) -> float:
    return 0.5 ** (s // 3)


class OwnLoopTrainer:
    """A trainer that owns its loop: it builds its optimizer inside `run()` and offers
    callbacks around each batch, the way such trainers let a Recorder in."""

    def __init__(self, model, on_batch_start, on_batch_end):
        self.model, self.on_batch_start, self.on_batch_end = model, on_batch_start, on_batch_end

    def run(self, steps: int) -> None:
        optimizer = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=0.9)  # its own
        for s in range(steps):
            batch = chunk(s)
            self.on_batch_start(s, batch)
            self.on_batch_end(s, step_sgd(self.model, optimizer, batch))
