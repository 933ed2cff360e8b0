"""A tiny GPT-style language model with a padding mask: the model of the bundled sample run.

Its attention masks padded keys with -inf before the softmax, the way many hand-written
attention layers do. That is correct for every sequence with at least one real token, and
NaN for an empty one (every key masked): the bug the sample run (`sample_ckpts/tinylm-nan`)
hits at step 5431, when the data pipeline yields an empty document. The loss of that step is
still finite (the empty row's positions are all ignored targets), but its gradients are NaN:
the weights go NaN, and the loss at step 5432.

    model, optimizer, scheduler = build()
    loss = step(model, optimizer, {"ids": ids})   # ids: int64 (B, T+1), 0 = padding
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, CTX, WIDTH, LAYERS, HEADS = 64, 32, 32, 2, 2
PAD = 0


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, pad):  # x (B, T, C), pad (B, T): True where the token is padding
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, H, T, hs)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))  # (B, H, T, T)
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)
        att = att.masked_fill(causal | pad[:, None, None, :], float("-inf"))
        att = att.softmax(dim=-1)  # an all-padding row: every key masked -> NaN
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, pad):
        x = x + self.attn(self.ln1(x), pad)
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(CTX, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH, HEADS) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT

    def forward(self, ids):  # (B, T)
        pad = ids == PAD
        x = self.wte(ids) + self.wpe(torch.arange(ids.size(1)))  # (B, T, C)
        for block in self.blocks:
            x = block(x, pad)
        return self.lm_head(self.ln_f(x))  # (B, T, VOCAB)


def build():
    torch.manual_seed(1337)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    return model, optimizer, scheduler


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 200)


def step(model, optimizer, batch):
    ids = batch["ids"]  # (B, T+1)
    logits = model(ids[:, :-1])
    targets = ids[:, 1:].masked_fill(ids[:, 1:] == PAD, -100)  # no loss on padding
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def document(doc_id: int) -> torch.Tensor:
    """Document `doc_id` of a synthetic corpus: random tokens (1..63) followed by the same
    tokens again (a copy task attention can learn), 8..CTX+1 tokens long, right-padded with
    PAD to CTX+1 tokens. Distinct documents practically never coincide (63**4 prefixes)."""
    g = torch.Generator().manual_seed(doc_id)
    half = int(torch.randint(4, (CTX + 1) // 2 + 1, (1,), generator=g))
    prefix = torch.randint(1, VOCAB, (half,), generator=g)
    ids = torch.full((CTX + 1,), PAD, dtype=torch.long)
    ids[: 2 * half] = torch.cat([prefix, prefix])
    return ids
