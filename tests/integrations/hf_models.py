"""A tiny GPT-2 (built from a config: no downloads) and its data, with a fault planted in one
sample. `build` lives at module level: replay imports it by name.

The samples carry `inputs_embeds` (float) rather than token ids, so that a NaN or an absurd
value can be planted in one sample's input.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from ckptlab.integrations import transformers as ckt  # noqa: E402

hf_logging.set_verbosity_error()

BATCH, SEQ, EMBD, VOCAB = 4, 8, 32, 64
MAX_STEPS = 12
FAULT_SAMPLE = 37  # row 1 of the batch at step 9 (no shuffling: the sampler is sequential)

ARGS = TrainingArguments(
    output_dir=os.path.join(tempfile.gettempdir(), "ckptlab-hf-test"),  # nothing is saved there
    max_steps=MAX_STEPS,
    per_device_train_batch_size=BATCH,
    per_device_eval_batch_size=BATCH,
    learning_rate=3e-3,
    warmup_steps=3,
    max_grad_norm=1.0,
    lr_scheduler_type="linear",
    eval_strategy="steps",
    eval_steps=4,
    logging_strategy="no",
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    disable_tqdm=True,
    dataloader_num_workers=0,
    seed=0,
    train_sampling_strategy="sequential",
)


def config() -> GPT2Config:
    # dropout stays on (0.1): replay must restore the RNG of every step bit for bit
    return GPT2Config(
        n_layer=1, n_embd=EMBD, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0
    )


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)  # the same initial weights every time
    return GPT2LMHeadModel(config())


def build():
    torch.manual_seed(0)
    return ckt.build(GPT2LMHeadModel(config()), ARGS)


# Gradient accumulation across an epoch's end (tests/integrations/test_transformers.py): the LR
# schedule is laid out over max_steps, as in the recorded Trainer.
EPOCH_ARGS = dataclasses.replace(ARGS, gradient_accumulation_steps=3, eval_strategy="no", max_steps=8)


class UnnormalizedTrainer(Trainer):
    """A Trainer that takes its model not to normalize the loss by num_items_in_batch: it then
    divides each micro-batch's loss by the step's micro-batch count."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model_accepts_loss_kwargs = False


def build_epoch():
    return ckt.build(model(), EPOCH_ARGS)


def build_epoch_unnormalized():
    return ckt.build(model(), EPOCH_ARGS, trainer_cls=UnnormalizedTrainer)


class Sequences(torch.utils.data.Dataset):
    """inputs_embeds: (SEQ, EMBD) float, labels: (SEQ,) token ids, idx: the sample id."""

    def __init__(self, n: int = 64, fault: str | None = None, seed: int = 3):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, SEQ, EMBD, generator=g)
        self.labels = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        if fault == "nan":
            self.x[FAULT_SAMPLE, 3, 5] = float("nan")
        elif fault == "overflow":
            self.x[FAULT_SAMPLE] = 3e38  # finite, absurd: the first op that scales it overflows

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"inputs_embeds": self.x[i], "labels": self.labels[i], "idx": i}


# --- mixed precision ---------------------------------------------------------------------------
#
# accelerate keeps one AcceleratorState per process, fixed by the first Trainer made after
# TrainingArguments set up their device (which resets it). A script trains with one precision;
# these tests mix them in one process, so each Trainer gets a fresh copy of its arguments.


def fresh(args: TrainingArguments) -> TrainingArguments:
    return dataclasses.replace(args)


# bf16=True: accelerate wraps the model's forward in CPU bfloat16 autocast.
BF16_ARGS = dataclasses.replace(ARGS, bf16=True, eval_strategy="no", gradient_accumulation_steps=2)


def build_bf16():
    return ckt.build(model(), fresh(BF16_ARGS))


# Too high for the first steps' scaled float16 gradients: the scaler skips them and backs off.
FP16_INIT_SCALE = 2.0**20
FP16_ARGS = dataclasses.replace(ARGS, fp16=True, eval_strategy="no")


class CpuFp16Trainer(Trainer):
    """fp16=True as accelerate runs it on a GPU, here on the CPU: float16 autocast around the
    model's forward, a GradScaler scaling the backward, unscaling in clip_grad_norm_ and
    stepping in the accelerated optimizer. On the CPU accelerate leaves fp16=True without
    either (native_amp False, no scaler: the run is float32); these two attributes are the
    only difference, and torch's CPU autocast and GradScaler("cpu") run the same logic."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.accelerator.native_amp = True
        self.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=FP16_INIT_SCALE)


def build_fp16():
    return ckt.build(model(), fresh(FP16_ARGS), trainer_cls=CpuFp16Trainer)


# A non-fused AdamW: the GradScaler skips its step, accelerate reports the skip and the Trainer
# then leaves the LR schedule where it was (the default fused AdamW steps, skipping the update
# itself: accelerate does not see the skip, the schedule moves on).
FP16_UNFUSED_ARGS = dataclasses.replace(FP16_ARGS, optim="adamw_torch", max_steps=4)


def build_fp16_unfused():
    return ckt.build(model(), fresh(FP16_UNFUSED_ARGS), trainer_cls=CpuFp16Trainer)
