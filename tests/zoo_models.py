"""Ten more planted faults for the blame-accuracy zoo (tests/fault_zoo.py), in the style of
tests/fault_models.py: each `record_*` records a real run in `run_dir` (tiny models, 30-40 steps,
batches of 6 rows, sample id 100 * step + row) and returns its `Expected` (root step, symptom
step, module, rows, kind, op). The full ground truth, parameter and reproducibility included,
is in tests/fault_zoo.py.

Pathologies that are not one event by nature (a dead ReLU layer, a bad init, a corrupted
embedding row) are planted as the event that causes them, so that there is a root step to find;
each section's comment says what the ground truth is and why.

Build and step functions live at module level: replay imports them by name.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab
from tests import fault_models as fm
from tests.fault_models import MLP, Expected, TinyTransformer, _xy, build_sgd_mlp, ids, step_mlp, step_plain
from tests.fault_models import B as B

VOCAB = 32


_record = fm.record_pairs


def _symptom(losses: list[float], root: int) -> int:
    """The step a user asks about: the first non-finite loss at or after the root, else the
    root itself (a finite spike, seen on the loss or gradient-norm curve)."""
    return next((i for i, v in enumerate(losses) if i >= root and not math.isfinite(v)), root)


def _tokens(step: int, rows: int = B, t: int = 8, vocab: int = VOCAB - 1):
    g = torch.Generator().manual_seed(step)
    return torch.randint(1, vocab, (rows, t), generator=g), torch.randint(0, 2, (rows,), generator=g)


# --- 1. attention-logit growth in one head ---------------------------------------------------------
# A two-head attention whose logits are computed in float16 (as a fused half-precision kernel
# does). Head 1's query and key weights have grown large along one direction of the embedding
# space (the model is a "pretrained" start; the growth happened before this run), a direction
# only token 31 uses. Ordinary tokens give head 1 logits ~0; the first row holding token 31
# (step 19, row 2) gives a logit > 65504: the float16 matmul overflows to Inf, the softmax makes
# NaN. Ground truth: root 19, kind numeric (an op overflowed from finite inputs; the token id
# is valid), module `attn` (its q @ k^T), the row with the token.


class TwoHeadAttention(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.proj = nn.Linear(d, d)

    def forward(self, x):  # (B, T, d)
        b, t, d = x.shape
        q, k, v = (z(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (self.q, self.k, self.v))
        att = (q.half() @ k.half().transpose(-1, -2)).float() / math.sqrt(d // self.heads)  # (B, h, T, T)
        y = att.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class LogitLM(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.attn = TwoHeadAttention(d)
        self.head = nn.Linear(d, 2)

    def forward(self, tokens):
        x = self.wte(tokens)
        return self.head((x + self.attn(x)).mean(dim=1))


def build_logit_growth():
    torch.manual_seed(0)
    m = LogitLM()
    with torch.no_grad():
        u = torch.zeros(16)
        u[15] = 1.0  # the direction only token 31 uses
        m.wte.weight[:, 15] = 0.0
        m.wte.weight[31, 15] = 4.0
        grown = 120.0 * u.expand(8, 16)  # head 1 = output features 8..15
        m.attn.q.weight[8:] = grown
        m.attn.k.weight[8:] = grown
    return m, torch.optim.AdamW(m.parameters(), lr=3e-3)


def step_classify(model, opt, batch):
    loss = F.cross_entropy(model(batch["tokens"]), batch["label"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def record_attention_logit_growth(run_dir) -> Expected:
    def batches():
        for s in range(30):
            tokens, label = _tokens(s)
            if s == 19:
                tokens[2, 5] = 31  # a rare token
            yield {"tokens": tokens, "label": label}, ids(s)

    losses, _ = _record(run_dir, build_logit_growth, step_classify, batches())
    return Expected(19, _symptom(losses, 19), "attn", [2], kind="numeric")


# --- 2. a label out of range ------------------------------------------------------------------------
# A multi-label classifier trained with binary cross-entropy on {0, 1} targets. One row at step
# 22 carries 255, the "void" value of a segmentation mask, as a target: BCE accepts it and its
# gradient (sigmoid(x) - 255) is hundreds of times a normal row's, so the gradient norm spikes and the update
# wrecks the head. Ground truth: root 22, kind data (the bad value arrived in the batch), no
# module (nothing went non-finite in an op), the row with 255.


class MultiLabel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def build_multilabel():
    torch.manual_seed(0)
    m = MultiLabel()
    return m, torch.optim.SGD(m.parameters(), lr=0.2)


def step_bce(model, opt, batch):
    x, y = batch
    loss = F.binary_cross_entropy_with_logits(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def record_label_out_of_range(run_dir) -> Expected:
    def batches():
        for s in range(35):
            x, _ = _xy(s)
            y = (x[:, :4] > 0).float()  # learnable: the sign of the first four features
            if s == 22:
                y[2, 1] = 255.0  # the mask's void label, not a class
            yield (x, y), ids(s)

    losses, _ = _record(run_dir, build_multilabel, step_bce, batches())
    return Expected(22, _symptom(losses, 22), None, [2], kind="data")


# --- 3. a dead ReLU layer ----------------------------------------------------------------------------
# A regressor of a non-negative quantity (its readout weights are positive; fc1's biases start
# at 1.0 so that its ReLUs start alive), trained with plain SGD. At step 24 one row's target is
# -999, a missing-value sentinel: its error pushes the biases of fc1's active units far below
# fc1's typical pre-activation, and the ReLU layer dies: fc1 is active on ~96% of (unit, sample)
# pairs before, ~23% after, and the loss never recovers (the record function checks both).
# Visible as a loss and gradient spike at step 24, then a loss stuck ~40x higher. Ground truth:
# root 24, kind data, no module (nothing went non-finite), the row with the sentinel.


def build_positive_mlp():
    torch.manual_seed(0)
    m = MLP()
    with torch.no_grad():
        m.fc1.bias.fill_(1.0)
        m.fc2.weight.abs_()
    return m, torch.optim.SGD(m.parameters(), lr=1e-2)


def fc1_active(model, x) -> float:
    """The fraction of (unit, row) pairs where fc1's ReLU passes a gradient."""
    with torch.no_grad():
        return float((model.fc1(x) > 0).float().mean())


def record_dead_relu(run_dir) -> Expected:
    def batches():
        for s in range(35):
            x, y = _xy(s)
            y = y.abs()  # a non-negative quantity
            if s == 24:
                y[3] = -999.0  # "missing", written as a sentinel
            yield (x, y), ids(s)

    losses, model = _record(run_dir, build_positive_mlp, step_plain, batches())
    assert len(losses) == 35 and losses[-1] > 10 * losses[23], "the loss must not recover"
    assert fc1_active(model, torch.cat([_xy(s)[0] for s in range(35)])) < 0.3, "fc1 must die"
    return Expected(24, _symptom(losses, 24), None, [3], kind="data")


# --- 4. an exploding residual stream --------------------------------------------------------------------
# A frozen float16 backbone of eight residual blocks (x = x + fc(x)) without normalization:
# each block grows the stream ~2.5x, so a typical row reaches ~2.5e3 at the top, inside
# float16. At step 26 one row has features 200x its usual scale (well under the 1000x of the
# run's typical maximum that replay calls absurd): the stream passes 65504 in the residual add
# of block 6 (its fc still gives ~5e4). Ground truth: root 26, kind numeric, module
# `blocks.6`, op aten.add.Tensor, the row.


class ResBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(x)


class ResStream(nn.Module):
    def __init__(self, d: int = 16, depth: int = 8):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(ResBlock(d) for _ in range(depth))
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x).half()
        for block in self.blocks:
            h = block(h)
        return self.out(h.float() / 1000.0)


def build_res_stream():
    torch.manual_seed(0)
    m = ResStream()
    with torch.no_grad():
        for block in m.blocks:
            block.fc.weight.copy_(1.5 * torch.eye(16) + 0.05 * torch.randn(16, 16))
        m.blocks.half()
    trainable = [p for p in m.parameters() if p.dtype == torch.float32]  # the backbone is frozen
    return m, torch.optim.AdamW(trainable, lr=1e-3)


def record_exploding_residual(run_dir) -> Expected:
    def batches():
        for s in range(35):
            x, y = _xy(s)
            if s == 26:
                x[1] = x[1] * 200.0
            yield (x, y), ids(s)

    losses, _ = _record(run_dir, build_res_stream, step_mlp, batches())
    return Expected(26, _symptom(losses, 26), "blocks.6", [1], kind="numeric", op="aten.add.Tensor")


# --- 5. a bad learning-rate warmup -----------------------------------------------------------------------
# A linear warmup over 20 steps whose "after warmup" branch returns the warmup length instead
# of 1.0: at step 20 the learning rate jumps 20x and the AdamW updates blow the weights up.
# Ground truth: root 20, kind optimizer, no module, no sample.

WARMUP = 20


def _bad_warmup(step: int) -> float:
    return (step + 1) / WARMUP if step < WARMUP else WARMUP  # meant: 1.0


def build_bad_warmup():
    torch.manual_seed(0)
    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=5e-2)
    return m, opt, torch.optim.lr_scheduler.LambdaLR(opt, _bad_warmup)


def record_bad_lr_warmup(run_dir) -> Expected:
    losses, _ = _record(run_dir, build_bad_warmup, step_plain, ((_xy(s), ids(s)) for s in range(35)))
    healthy = sorted(losses[:WARMUP])[WARMUP // 2]
    symptom = next((i for i, v in enumerate(losses) if i >= WARMUP and not (v < 10 * healthy)), WARMUP)
    return Expected(WARMUP, symptom, None, [], kind="optimizer")


# --- 6. a bad weight init ----------------------------------------------------------------------------------
# A multi-task Poisson regressor: a shared trunk and one head per task, each head run only on
# its task's rows and giving a rate exp(fc(h)). Task 2's head was initialized with std 100
# (`normal_(w, 0, 100)`: a std meant for another parameterization) instead of 0.02. Tasks 0
# and 1 train fine; the first task-2 row arrives at step 24 (row 2), and its head's exp
# overflows to Inf.
# Ground truth: root 24, kind numeric, module `heads.2` (its exp), parameter `heads.2.fc.weight`
# (the bad init), the task-2 row.


class PoissonHead(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, 1)

    def forward(self, h):
        return self.fc(h).exp()  # the rate


class MultiTask(nn.Module):
    def __init__(self, d: int = 16, tasks: int = 3):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, d), nn.ReLU())
        self.heads = nn.ModuleList(PoissonHead(d) for _ in range(tasks))

    def forward(self, x, task):
        h = self.trunk(x)
        rate = torch.zeros(x.size(0), 1)
        for t, head in enumerate(self.heads):
            rows = task == t
            if rows.any():
                rate = rate.index_put((rows.nonzero()[:, 0],), head(h[rows]))
        return rate


def build_multitask():
    torch.manual_seed(0)
    m = MultiTask()
    with torch.no_grad():
        for head in m.heads[:2]:
            nn.init.normal_(head.fc.weight, 0.0, 0.02)
        nn.init.normal_(m.heads[2].fc.weight, 0.0, 100.0)  # meant: 0.02
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def step_poisson(model, opt, batch):
    rate = model(batch["x"], batch["task"])
    loss = (rate - batch["count"] * torch.log(rate + 1e-8)).mean()  # Poisson NLL
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def record_bad_weight_init(run_dir) -> Expected:
    def batches():
        for s in range(35):
            x, _ = _xy(s)
            g = torch.Generator().manual_seed(500 + s)
            task = torch.randint(0, 2, (B,), generator=g)
            if s >= 24:
                task[2] = 2  # the third task joins the mix
            count = torch.poisson(torch.exp(0.5 * x[:, :1]), generator=g)
            yield {"x": x, "task": task, "count": count}, ids(s)

    losses, _ = _record(run_dir, build_multitask, step_poisson, batches())
    return Expected(24, _symptom(losses, 24), "heads.2", [2], kind="numeric", op="aten.exp.default")


# --- 7. a padding mask bug ------------------------------------------------------------------------------
# The tiny transformer of fault_models.py, with the padding mask passed inverted at the call
# site (`ids != 0` where the model wants True = padding): each query attends only to padding.
# Every batch so far has padding in every row, so training runs (and learns little); the first
# row without padding (step 15, row 0) has every key masked and its softmax is NaN. Ground
# truth: root 15, kind numeric, module `blocks.0.attn` (its softmax), the full-length row.


def step_inverted_mask(model, opt, batch):
    tokens, label = batch["ids"], batch["label"]
    logits = model(tokens, tokens != 0)  # meant: tokens == 0 (True = padding)
    loss = F.cross_entropy(logits, label)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def build_mask_bug():
    torch.manual_seed(0)
    m = TinyTransformer()
    return m, torch.optim.AdamW(m.parameters(), lr=3e-3)


def record_padding_mask_bug(run_dir) -> Expected:
    def batches():
        for s in range(30):
            tokens, label = _tokens(s)
            g = torch.Generator().manual_seed(700 + s)
            lengths = torch.randint(3, 8, (B,), generator=g)  # 3..7 of 8 positions: always padded
            if s == 15:
                lengths[0] = 8  # a full-length sequence
            tokens[torch.arange(8) >= lengths[:, None]] = 0
            yield {"ids": tokens, "label": label}, ids(s)

    losses, _ = _record(run_dir, build_mask_bug, step_inverted_mask, batches())
    return Expected(15, _symptom(losses, 15), "blocks.0.attn", [0], kind="numeric", op="aten._softmax.default")


# --- 8. a division by a zero length ---------------------------------------------------------------------------
# A token tagger whose step_fn averages each row's token losses over its labelled tokens
# (`sum / count`, per row, then the mean of rows). At step 18 row 5 has no labelled token (all
# -100): 0 / 0 = NaN, in step_fn itself. Ground truth: root 18, kind numeric, module None (the
# division runs outside any module), op aten.div.Tensor, the unlabelled row.


class Tagger(nn.Module):
    def __init__(self, d: int = 16, tags: int = 4):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.mix = nn.Linear(d, d)
        self.out = nn.Linear(d, tags)

    def forward(self, tokens):
        return self.out(torch.tanh(self.mix(self.wte(tokens))))  # (B, T, tags)


def build_tagger():
    torch.manual_seed(0)
    m = Tagger()
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def step_row_mean(model, opt, batch):
    logits, tags = model(batch["tokens"]), batch["tags"]
    token_loss = F.cross_entropy(logits.transpose(1, 2), tags, ignore_index=-100, reduction="none")  # (B, T)
    labelled = (tags != -100).float()
    row_loss = (token_loss * labelled).sum(1) / labelled.sum(1)  # a row with no labels: 0 / 0
    loss = row_loss.mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def record_zero_length_division(run_dir) -> Expected:
    def batches():
        for s in range(30):
            tokens, _ = _tokens(s)
            tags = tokens % 4
            g = torch.Generator().manual_seed(900 + s)
            tags[torch.rand(B, 8, generator=g) < 0.3] = -100  # unlabelled tokens
            tags[:, 0] = tokens[:, 0] % 4  # every row has a label ...
            if s == 18:
                tags[5] = -100  # ... but this one
            yield {"tokens": tokens, "tags": tags}, ids(s)

    losses, _ = _record(run_dir, build_tagger, step_row_mean, batches())
    return Expected(18, _symptom(losses, 18), None, [5], kind="numeric", op="aten.div.Tensor")


# --- 9. a corrupted embedding row ----------------------------------------------------------------------------
# A bag-of-tokens classifier. After step 12, outside the training step, one element of the
# embedding row of token 30 turns NaN (a memory bit flip; token 30 is rare). The weights are
# measured every step (health_every=1), so the record shows the non-finite weight from step 13;
# the loss goes NaN at step 16, the first batch holding token 30. Replay re-runs the recorded
# computation, which never wrote that NaN: the fault does not reproduce. Ground truth: root 13
# (the first step that ran with the corrupted row), not reproducible, kind none, parameter
# `wte.weight`, no sample.


class BagOfTokens(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.head = nn.Linear(d, 2)

    def forward(self, tokens):
        return self.head(self.wte(tokens).mean(dim=1))


def build_bag_of_tokens():
    torch.manual_seed(0)
    m = BagOfTokens()
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def record_corrupted_embedding_row(run_dir) -> Expected:
    model, opt = build_bag_of_tokens()
    with ckptlab.Recorder(
        run_dir, model, opt, step_fn=step_classify, build_fn=build_bag_of_tokens, ckpt_every=10, health_every=1
    ) as rec:
        for s in range(30):
            tokens, label = _tokens(s, vocab=30)  # ids 1..29: token 30 is rare
            if s == 16:
                tokens[3, 2] = 30
            try:
                rec.step({"tokens": tokens, "label": label}, sample_ids=ids(s))
            except ckptlab.NonFiniteLoss:
                break
            if s == 12:
                with torch.no_grad():
                    model.wte.weight[30, 7] = float("nan")  # a bit flip in memory, not in step_fn
    return Expected(13, 16, None, [], kind="none")


# --- 10. a duplicated sample hammering one step -------------------------------------------------------------
# A regressor trained with plain SGD. Sample 1503 is a hard outlier (target 3, several times the
# typical |y|, not absurd); at step 15 it is one row in six and the step is healthy (no
# anomaly). At step 22 a sampler bug fills the whole batch with it (six copies, sample ids
# [1503] * 6): the step's gradient is that one sample's, and the gradient norm spikes ~25x.
# No row stands out from the others. Ground truth: root 22, kind data, no module, sample 1503.

HAMMER = 1503


def record_duplicated_sample(run_dir) -> Expected:
    x15, y15 = _xy(15)
    y15[3] = 3.0  # the outlier

    def batches():
        for s in range(35):
            if s == 15:
                yield (x15, y15), ids(s)
            elif s == 22:
                yield (x15[3:4].repeat(B, 1), y15[3:4].repeat(B, 1)), [HAMMER] * B
            else:
                yield _xy(s), ids(s)

    losses, _ = _record(run_dir, build_sgd_mlp, step_plain, batches())
    return Expected(22, _symptom(losses, 22), None, list(range(B)), kind="data")
