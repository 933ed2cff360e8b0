"""A Lightning Fabric training loop in the shape of litgpt's pretrain script (`litgpt/pretrain.py`,
`fit`), on a tiny GPT in litgpt's layout (built here: litgpt is not imported), on the CPU,
recorded with ckptlab.integrations.fabric.

As in the script: `fabric.setup(model, optimizer)`, every iteration one micro-batch with the
learning rate set by hand first from the loop's state (`lr = get_lr(...)`, then every param
group's "lr"), `is_accumulating = iter_num % accum != 0`, the forward and `fabric.backward(loss
/ accum)` under `fabric.no_backward_sync(model, enabled=is_accumulating)`, and when the step
completes `fabric.clip_gradients(model, optimizer, max_norm=...)`, `optimizer.step()`,
`optimizer.zero_grad()`. The data loader is not shuffled, so where a fault lands is plain:
micro-batch j (counting from 0 over the iterations) holds samples BATCH * j .. BATCH * j + 3, a
cycle over the dataset later.

The clipping passes `error_if_nonfinite=False`: Fabric's default (True) makes torch raise on
the NaN step inside the clipping (`train_step_default_clip`, the same loop with the default: a
step that raised, which replay traces to the NaN as well). The
samples carry float embeddings rather than token ids (litgpt's `wte` is an Embedding; here a
Linear of them), so that a NaN can be planted in one sample's input. `train_step` and `build`
live at module level: replay imports them.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

import ckptlab
from ckptlab.integrations import fabric as ckf

BATCH, SEQ, FEATURES, VOCAB = 4, 8, 8, 32  # micro_batch_size, tokens, input features, vocabulary
N_EMBD, N_HEAD, N_LAYER = 16, 2, 2
ACCUM = 2  # micro-batches per optimizer step (litgpt: gradient_accumulation_iters)
SAMPLES = 64  # 16 micro-batches: 8 optimizer steps a pass, cycled
LR, MIN_LR, WARMUP_ITERS = 3e-3, 3e-4, 6
MAX_NORM = 1.0
SEED = 0
# The NaN: step FAULT_STEP's micro-batch FAULT_MICRO, row FAULT_ROW.
FAULT_STEP, FAULT_MICRO, FAULT_ROW = 5, 1, 1
FAULT_SAMPLE = (ACCUM * FAULT_STEP + FAULT_MICRO) * BATCH + FAULT_ROW  # 45
LR_FAULT_STEP, LR_FAULT = 18, 1e4  # the optimizer step whose hand-set learning rate a bug multiplies


# --- the model: litgpt's GPT, in its module names --------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.proj = nn.Linear(N_EMBD, N_EMBD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, N_HEAD, C // N_HEAD).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class GptNeoxMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(N_EMBD, 4 * N_EMBD)
        self.proj = nn.Linear(4 * N_EMBD, N_EMBD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm_1 = nn.LayerNorm(N_EMBD)
        self.attn = CausalSelfAttention()
        self.norm_2 = nn.LayerNorm(N_EMBD)
        self.mlp = GptNeoxMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x))
        return x + self.mlp(self.norm_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(N_EMBD, VOCAB, bias=False)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Linear(FEATURES, N_EMBD),
                h=nn.ModuleList(Block() for _ in range(N_LAYER)),
                ln_f=nn.LayerNorm(N_EMBD),
            )
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)


def get_lr(learning_rate: float, it: int, warmup_iters: int, max_iters: int, min_lr: float) -> float:
    """litgpt's schedule: linear warm-up, then cosine decay to min_lr."""
    lr = learning_rate * min(it / warmup_iters, 1.0) if warmup_iters else learning_rate
    if it > warmup_iters:
        ratio = (it - warmup_iters) / max(1, max_iters - warmup_iters)
        lr = min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (learning_rate - min_lr)
    return lr


class Sequences(torch.utils.data.Dataset):
    """Items (embeddings (SEQ, FEATURES) float, targets (SEQ,) token ids)."""

    def __init__(self, n: int = SAMPLES, nan_sample: int | None = None, seed: int = 3):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, SEQ, FEATURES, generator=g)
        self.y = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        if nan_sample is not None:
            self.x[nan_sample, 3, 5] = float("nan")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


# --- the loop ----------------------------------------------------------------------------------


def train_step(fabric, model, optimizer, batch, is_accumulating):
    """litgpt's fit loop body on one micro-batch."""
    input_ids, targets = batch
    with fabric.no_backward_sync(model, enabled=is_accumulating):
        logits = model(input_ids)
        loss = chunked_cross_entropy(logits, targets)
        fabric.backward(loss / ACCUM)
    if not is_accumulating:
        fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM, error_if_nonfinite=False)
        optimizer.step()
        optimizer.zero_grad()
    return loss


def train_step_default_clip(fabric, model, optimizer, batch, is_accumulating):
    """`train_step` clipping with Fabric's default, `error_if_nonfinite=True`: torch raises on
    the NaN step, inside the clipping (the step's own exception, traced to where the NaN came
    from)."""
    input_ids, targets = batch
    with fabric.no_backward_sync(model, enabled=is_accumulating):
        loss = chunked_cross_entropy(model(input_ids), targets)
        fabric.backward(loss / ACCUM)
    if not is_accumulating:
        fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return loss


def made():
    """The model and optimizer, made as the script makes them."""
    model = GPT()
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, betas=(0.9, 0.95))


def fabric_for(devices: int = 1):
    if devices == 1:
        return L.Fabric(accelerator="cpu", devices=1, precision="32-true")
    return L.Fabric(accelerator="cpu", devices=devices, strategy="ddp", precision="32-true")


def build():
    fabric = fabric_for()
    return ckf.build(fabric, train_step, *made())


def build_default_clip():
    return ckf.build(fabric_for(), train_step_default_clip, *made())


def fit(fabric, rec, model, optimizer, loader, *, max_steps: int, lr_fault: bool = False) -> None:
    """litgpt's `fit`: the learning rate set by hand every iteration, micro-batches until
    `max_steps` optimizer steps (the loader cycled)."""
    state = {"iter_num": 0, "step_count": 0}
    max_iters = max_steps * ACCUM
    while state["step_count"] < max_steps:
        for ids, train_data in loader:
            if state["step_count"] >= max_steps:
                break
            lr = get_lr(LR, state["iter_num"], WARMUP_ITERS, max_iters, MIN_LR)
            if lr_fault and state["step_count"] == LR_FAULT_STEP:
                lr *= LR_FAULT  # the bug: one step's rate
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr
            state["iter_num"] += 1
            is_accumulating = state["iter_num"] % ACCUM != 0
            rec.micro_batch(train_data, ids, is_accumulating=is_accumulating)  # was: train_step itself
            if not is_accumulating:
                state["step_count"] += 1


def main(
    run_dir, *, nan: bool = False, lr_fault: bool = False, max_steps: int = 8, default_clip: bool = False, **options
) -> None:
    """The script's main(), recorded on one process. `nan`: a NaN in sample FAULT_SAMPLE's
    input; `lr_fault`: step LR_FAULT_STEP's learning rate multiplied by LR_FAULT;
    `default_clip`: Fabric's default clipping (`train_step_default_clip`)."""
    fabric = fabric_for()
    fabric.launch()
    fabric.seed_everything(SEED)  # the same initial weights on every rank
    model, optimizer = fabric.setup(*made())
    data = Sequences(nan_sample=FAULT_SAMPLE if nan else None)
    loader = fabric.setup_dataloaders(
        torch.utils.data.DataLoader(ckptlab.with_sample_ids(data), batch_size=BATCH, shuffle=False)
    )
    body, build_fn = (train_step_default_clip, build_default_clip) if default_clip else (train_step, build)
    with ckf.record(run_dir, fabric, model, optimizer, body=body, build_fn=build_fn, **options) as rec:
        fit(fabric, rec, model, optimizer, loader, max_steps=max_steps, lr_fault=lr_fault)
