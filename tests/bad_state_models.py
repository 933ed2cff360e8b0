"""A model that starts with a bad weight: one row of its embedding table is NaN (a corrupt
pretrained table), harmless until a batch uses that token. Module level: replay imports it."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, B, T = 20, 8, 4, 5
BAD_TOKEN, FIRST_USE, ROW = 7, 12, 2


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.head = nn.Linear(D, 1)

    def forward(self, tokens):
        return self.head(self.emb(tokens).mean(1))


def build():
    torch.manual_seed(0)
    model = Bag()
    with torch.no_grad():
        model.emb.weight[BAD_TOKEN] = float("nan")  # the corrupt row it was loaded with
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def step(model, optimizer, batch):
    tokens, y = batch
    loss = F.mse_loss(model(tokens), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def batch(step_no: int):
    """Tokens that avoid BAD_TOKEN until FIRST_USE, where row ROW uses it."""
    g = torch.Generator().manual_seed(step_no)
    tokens = torch.randint(0, VOCAB - 1, (B, T), generator=g)
    tokens[tokens >= BAD_TOKEN] += 1  # never BAD_TOKEN
    if step_no == FIRST_USE:
        tokens[ROW, 3] = BAD_TOKEN
    return tokens, torch.randn(B, 1, generator=g)
