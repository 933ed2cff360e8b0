"""A trainer that owns its loop, in the shape of karpathy/minGPT's `mingpt/trainer.py`: it builds
the optimizer (`model.configure_optimizers(config)`) and a DataLoader over its dataset (a
RandomSampler with replacement) inside `run()`, moves `(x, y)` to its device, runs forward,
`zero_grad`, backward, `clip_grad_norm_`, `optimizer.step()`, and offers one callback after each
step (`on_batch_end`, handed the trainer: `trainer.loss`, `trainer.iter_num`). Recorded with
ckptlab.integrations.owned_loop (tests/integrations/test_owned_loop.py); the model is a tiny sequence model with minGPT's interface
(`forward(x, targets) -> (logits, loss)`, `configure_optimizers`), on float inputs so that a NaN
can be planted in one sample. `step` and `build` live at module level: replay imports them.
"""

from __future__ import annotations

import time
from collections import defaultdict
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

SEQ, EMBD, HIDDEN, VOCAB = 6, 8, 16, 11
SAMPLES = 40
FAULT_SAMPLE = 24  # its input holds a NaN: read first at step 7, row 3 (the seeded sampler)

TRAIN_CONFIG = SimpleNamespace(
    device="cpu",
    num_workers=0,  # track_ids sees the samples read in this process
    max_iters=12,
    batch_size=4,
    learning_rate=3e-3,
    betas=(0.9, 0.95),
    weight_decay=0.1,
    grad_norm_clip=1.0,
)


class TinyLM(nn.Module):
    """minGPT's model interface on a small network: logits per position, loss when given targets."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(EMBD, HIDDEN)
        self.drop = nn.Dropout(0.1)  # on: replay must restore each step's RNG
        self.ln = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x, targets=None):
        logits = self.head(self.ln(self.drop(F.gelu(self.inp(x)))))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, train_config):
        """minGPT's split: weight decay on the Linear weights only."""
        decay = [p for n, p in self.named_parameters() if n.endswith("weight") and not n.startswith("ln")]
        no_decay = [p for n, p in self.named_parameters() if not (n.endswith("weight") and not n.startswith("ln"))]
        groups = [
            {"params": decay, "weight_decay": train_config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=train_config.learning_rate, betas=train_config.betas)


class Sequences(torch.utils.data.Dataset):
    """(x, y): inputs (SEQ, EMBD), next-token targets (SEQ,)."""

    def __init__(self, fault: bool = False):
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(SAMPLES, SEQ, EMBD, generator=g)
        self.y = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
        if fault:
            self.x[FAULT_SAMPLE, 2, 4] = float("nan")

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Trainer:
    """minGPT's Trainer, as structured there: callbacks by event name, everything else in run()."""

    def __init__(self, config, model, train_dataset):
        self.config, self.model, self.train_dataset = config, model.to(config.device), train_dataset
        self.optimizer = None
        self.callbacks = defaultdict(list)
        self.device = config.device
        self.iter_num, self.iter_time, self.iter_dt = 0, 0.0, 0.0

    def add_callback(self, onevent: str, callback):
        self.callbacks[onevent].append(callback)

    def trigger_callbacks(self, onevent: str):
        for callback in self.callbacks.get(onevent, []):
            callback(self)

    def run(self):
        model, config = self.model, self.config
        self.optimizer = model.configure_optimizers(config)
        sampler = RandomSampler(self.train_dataset, replacement=True, num_samples=int(1e10))
        train_loader = DataLoader(
            self.train_dataset,
            sampler=sampler,
            shuffle=False,
            batch_size=config.batch_size,
            num_workers=config.num_workers,
        )
        model.train()
        self.iter_num, self.iter_time = 0, time.time()
        data_iter = iter(train_loader)
        while True:
            try:
                batch = next(data_iter)
            except StopIteration:
                data_iter = iter(train_loader)
                batch = next(data_iter)
            batch = [t.to(self.device) for t in batch]
            x, y = batch
            logits, self.loss = model(x, y)
            model.zero_grad(set_to_none=True)
            self.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_norm_clip)
            self.optimizer.step()
            self.trigger_callbacks("on_batch_end")
            self.iter_num += 1
            now = time.time()
            self.iter_dt, self.iter_time = now - self.iter_time, now
            if config.max_iters is not None and self.iter_num >= config.max_iters:
                break


# --- what the user writes to record it --------------------------------------------------------


def step(model, optimizer, batch):
    """What Trainer.run() does with one batch."""
    x, y = batch
    _, loss = model(x, y)
    model.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN_CONFIG.grad_norm_clip)
    optimizer.step()
    return loss


def build():
    model = TinyLM()
    return model, model.configure_optimizers(TRAIN_CONFIG)
