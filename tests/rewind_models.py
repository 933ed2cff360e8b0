"""Causes that lie before the replay window (docs/replay.md, "Earlier causes").

A poisoned embedding row: Poisson regression of a count from a bag of tokens, plain SGD. At
step 37 one row made only of the rare token carries a corrupt target (a count of 1e6): its
prediction is exactly 0 (the rare token's embedding row starts at 0), so its loss is exp(0) -
1e6 * 0 = 1, normal; but its gradient, exp(0) - 1e6, drives that embedding row far from 0.
Steps 38-41 never use the token. At step 42 an ordinary row made of it overflows exp(): the
loss is Inf. Replay of step 42 starts at checkpoint 40, whose state is already primed.

Build and step functions live at module level: replay imports them by name.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, B, T = 16, 4, 8, 6
RARE = VOCAB - 1
POISON_STEP, FAULT_STEP, POISON_ROW = 37, 42, 3


class BagOfTokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.head = nn.Linear(D, 1, bias=False)
        with torch.no_grad():
            self.emb.weight.mul_(0.1)
            self.emb.weight[RARE].zero_()

    def forward(self, ids):
        return self.head(self.emb(ids).sum(1)).squeeze(-1)  # the log of the predicted count


def build():
    torch.manual_seed(0)
    model = BagOfTokens()
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def step(model, optimizer, batch):
    ids, counts = batch
    loss = F.poisson_nll_loss(model(ids), counts, log_input=True)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def batches(n: int = 45, poison: bool = True):
    """(batch, sample_ids) for steps 0..n-1; sample ids are 100 * step + row. The rare token
    appears only in step 37's poisoned row and step 42's ordinary one."""
    g = torch.Generator().manual_seed(3)
    for s in range(n):
        ids = torch.randint(0, RARE, (B, T), generator=g)
        counts = torch.poisson(torch.full((B,), 2.0), generator=g)
        if s == POISON_STEP:
            ids[POISON_ROW] = RARE
            counts[POISON_ROW] = 1e6 if poison else 2.0
        if s == FAULT_STEP:
            ids[1] = RARE
        yield (ids, counts), [100 * s + r for r in range(B)]
