"""A word-level LSTM language model trained on sequence-first `(bptt, batch)` chunks, its
hidden state carried from step to step (truncated backpropagation through time), as in the
classic word language model examples. The carried state lives in the model as buffers, so
checkpoints hold it and replay carries it exactly as the run did.

Build and step functions live at module level: replay imports them by name.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, BPTT, B, H = 50, 6, 4, 16


class CarriedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, H)
        self.rnn = nn.LSTM(H, H)  # sequence-first: (T, B, H)
        self.out = nn.Linear(H, VOCAB)
        self.register_buffer("h", torch.zeros(1, B, H))  # the carried state: in state_dict,
        self.register_buffer("c", torch.zeros(1, B, H))  # so in every checkpoint

    def forward(self, tokens, scale):
        x = self.emb(tokens) * scale[None, :, None]  # scale: per column (sample), 1.0 normally
        y, (h, c) = self.rnn(x, (self.h.clone(), self.c.clone()))  # (the copies below change h, c)
        self.h.copy_(h.detach())  # carried to the next step, cut from this step's graph
        self.c.copy_(c.detach())
        return self.out(y)


def build():
    torch.manual_seed(0)
    model = CarriedLSTM()
    return model, torch.optim.SGD(model.parameters(), lr=0.5)


def step(model, optimizer, batch):
    tokens, targets, scale = batch  # (T, B) ints, (T, B) ints, (B,) floats
    logits = model(tokens, scale)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def chunk(step_no: int, bad_step: int | None = None, bad_col: int = 0):
    """Step `step_no`'s chunk of a fixed token stream, sequence-first; at `bad_step`, column
    `bad_col`'s scale is NaN (a corrupt sample weight)."""
    g = torch.Generator().manual_seed(step_no)
    stream = torch.randint(0, VOCAB, (BPTT + 1, B), generator=g)
    scale = torch.ones(B)
    if step_no == bad_step:
        scale[bad_col] = float("nan")
    return stream[:-1], stream[1:], scale


# --- sequence-first without carried state: rows are columns of every (T, B, ...) tensor ------


class SeqFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(H, H)  # (T, B, H) in and out
        self.out = nn.Linear(H, VOCAB)

    def forward(self, x):
        return self.out(self.rnn(x)[0])


def build_seq_first():
    torch.manual_seed(0)
    model = SeqFirst()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def step_seq_first(model, optimizer, batch):
    x, targets = batch  # (T, B, H) floats, (T, B) ints: the sample is dimension 1
    loss = F.cross_entropy(model(x).reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def seq_first_chunk(step_no: int, bad_step: int, bad_col: int):
    g = torch.Generator().manual_seed(step_no)
    x = torch.randn(BPTT, B, H, generator=g)
    targets = torch.randint(0, VOCAB, (BPTT, B), generator=g)
    if step_no == bad_step:
        x[3, bad_col, 5] = float("nan")
    return x, targets
