"""An accelerate training loop in the shape of transformers'
examples/pytorch/language-modeling/run_clm_no_trainer.py, on a tiny GPT-2 (built from a config:
no downloads), on the CPU, recorded with ckptlab.integrations.accelerate.

As in the example: `Accelerator(gradient_accumulation_steps=k)`, the AdamW of two parameter
groups (no weight decay on biases and LayerNorm weights), `get_scheduler("linear", ...)` laid
out over the optimizer steps of all epochs, `accelerator.prepare(model, optimizer,
train_dataloader, eval_dataloader, lr_scheduler)`, a shuffled DataLoader with
`default_data_collator`, and the body under `with accelerator.accumulate(model)`:
`accelerator.backward`, `accelerator.clip_grad_norm_` when the gradients sync, the optimizer,
scheduler and zero_grad of accelerate's wrappers; an evaluation after each epoch.

The samples carry `inputs_embeds` (float) rather than token ids, so that a NaN can be planted
in one sample's input. `train_step` and `build` live at module level: replay imports them.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator, get_scheduler  # noqa: E402

import ckptlab  # noqa: E402
from ckptlab.integrations import accelerate as cka  # noqa: E402

BATCH, SEQ, EMBD, VOCAB = 4, 8, 32, 64
ACCUM = 2  # micro-batches per optimizer step
SAMPLES = 36  # 9 batches an epoch: steps of 2, 2, 2, 2 and 1 (accelerate syncs at the dataloader's end)
EPOCHS = 2
WARMUP = 3
MAX_GRAD_NORM = 1.0
SEED = 0
FAULT_SAMPLE = 14  # its NaN input: where the seeded shuffle puts it (tests/integrations/test_accelerate_loop.py)
LR_SPIKE_STEP = 17  # the optimizer step whose learning rate a buggy schedule multiplies by LR_SPIKE
LR_SPIKE = 1e4


def config() -> GPT2Config:
    # dropout stays on (0.1): replay must restore the RNG of every micro-batch bit for bit
    return GPT2Config(
        n_layer=1, n_embd=EMBD, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0
    )


class Sequences(torch.utils.data.Dataset):
    """Dict items, as a tokenized dataset's: inputs_embeds (SEQ, EMBD) float, labels (SEQ,)."""

    def __init__(self, n: int = SAMPLES, fault: bool = False, seed: int = 3):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, SEQ, EMBD, generator=g)
        self.labels = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        if fault:
            self.x[FAULT_SAMPLE, 3, 5] = float("nan")

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"inputs_embeds": self.x[i], "labels": self.labels[i]}


def optimizer_for(model) -> torch.optim.Optimizer:
    no_decay = ["bias", "ln_"]  # GPT-2's LayerNorms are ln_1, ln_2, ln_f
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
            "weight_decay": 0.1,
        },
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=3e-3)


def scheduler_for(optimizer, accelerator, batches_per_epoch: int, *, lr_spike: bool = False):
    num_update_steps_per_epoch = math.ceil(batches_per_epoch / ACCUM)
    max_train_steps = EPOCHS * num_update_steps_per_epoch
    if lr_spike:  # a schedule with a bug at one step
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: LR_SPIKE if step == LR_SPIKE_STEP else 1.0)
    return get_scheduler(
        name="linear",
        optimizer=optimizer,
        num_warmup_steps=WARMUP * accelerator.num_processes,
        num_training_steps=max_train_steps * accelerator.num_processes,
    )


def train_step(accelerator, model, optimizer, lr_scheduler, batch):
    """The example's loop body, on one batch of the dataloader."""
    with accelerator.accumulate(model):
        outputs = model(**batch)
        loss = outputs.loss
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
    return loss


def build(*, lr_spike: bool = False):
    accelerator = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True)
    model = GPT2LMHeadModel(config())
    optimizer = optimizer_for(model)
    lr_scheduler = scheduler_for(optimizer, accelerator, math.ceil(SAMPLES / BATCH), lr_spike=lr_spike)
    return cka.build(accelerator, train_step, *accelerator.prepare(model, optimizer, lr_scheduler))


def build_lr_spike():
    return build(lr_spike=True)


def main(run_dir, *, fault: bool = False, lr_spike: bool = False, epochs: int = EPOCHS, **options) -> int:
    """The example's main(), recorded: returns the optimizer steps completed. `fault`: a NaN in
    sample FAULT_SAMPLE's input; `lr_spike`: the learning rate of step LR_SPIKE_STEP multiplied
    by LR_SPIKE."""
    accelerator = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True)
    set_seed(SEED)
    model = GPT2LMHeadModel(config())
    train_dataset = ckptlab.with_sample_ids(Sequences(fault=fault), key="sample_id")
    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=default_data_collator, batch_size=BATCH)
    eval_dataloader = DataLoader(Sequences(8, seed=4), collate_fn=default_data_collator, batch_size=BATCH)
    optimizer = optimizer_for(model)
    lr_scheduler = scheduler_for(optimizer, accelerator, len(train_dataloader), lr_spike=lr_spike)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    rec = cka.record(
        run_dir,
        accelerator,
        model,
        optimizer,
        lr_scheduler,
        body=train_step,
        build_fn=build_lr_spike if lr_spike else build,
        sample_id_key="sample_id",
        **options,
    )
    completed_steps = 0
    with rec:
        for _epoch in range(epochs):
            model.train()
            for _step, batch in enumerate(train_dataloader):
                rec.micro_batch(batch)  # was: the body itself
                if accelerator.sync_gradients:
                    completed_steps += 1
            model.eval()
            losses = []
            for batch in eval_dataloader:
                with torch.no_grad():
                    losses.append(model(**batch).loss)
            rec.log_validation(val_loss=float(torch.stack(losses).mean()))
    return completed_steps
