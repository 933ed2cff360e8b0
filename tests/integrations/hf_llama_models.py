"""A tiny Llama (built from a config: no downloads) trained by the Hugging Face Trainer with
gradient accumulation on padded token rows, and a corrupt pretrained embedding row that one
sample reads. `build` lives at module level: replay imports it by name.

The run, as a user would produce it: micro-batches of 4 rows, 2 of them an optimizer step (8
sample ids a step, numbered across the micro-batches), rows right-padded with PAD (attention
mask 0, labels -100 there). Row BAD_TOKEN of `embed_tokens` is NaN from the start (a corrupt
row of a pretrained table), harmless until a sample reads the token: sample FAULT_SAMPLE does,
at position FAULT_POSITION, in micro-batch FAULT_MICRO of step FAULT_STEP. Every checkpoint
from step 0 on holds the NaN row, so a replay of that step starts from a bad state.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from ckptlab.integrations import transformers as ckt  # noqa: E402

hf_logging.set_verbosity_error()

MICRO, ACCUM, SEQ, VOCAB, HIDDEN = 4, 2, 10, 64, 32
ROWS = MICRO * ACCUM  # sample ids a step
PAD, BAD_TOKEN = 0, 13
FAULT_STEP, FAULT_MICRO, FAULT_ROW, FAULT_POSITION = 9, 1, 2, 5
FAULT_SAMPLE = FAULT_STEP * ROWS + FAULT_MICRO * MICRO + FAULT_ROW  # 78 (the sampler is sequential)
FAULT_LENGTH = 8  # the faulty sample is padded too: positions 8, 9
SHORT = 3  # the real tokens of the rows at the start of each step: healthy, padded over most positions

ARGS = TrainingArguments(
    output_dir=os.path.join(tempfile.gettempdir(), "ckptlab-hf-llama-test"),  # nothing is saved there
    max_steps=12,
    per_device_train_batch_size=MICRO,
    gradient_accumulation_steps=ACCUM,
    learning_rate=3e-3,
    warmup_steps=2,
    max_grad_norm=1.0,
    lr_scheduler_type="linear",
    eval_strategy="no",
    logging_strategy="no",
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    disable_tqdm=True,
    dataloader_num_workers=0,
    seed=0,
    train_sampling_strategy="sequential",
)


def fresh_args() -> TrainingArguments:
    """A copy of ARGS whose device setup resets accelerate's one-per-process AcceleratorState:
    another test file run before in this process may have fixed it to another precision."""
    return dataclasses.replace(ARGS)


def config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same initial weights every time
    m = LlamaForCausalLM(config())
    with torch.no_grad():
        m.model.embed_tokens.weight[BAD_TOKEN] = float("nan")  # the corrupt row it was loaded with
    return m


def build():
    return ckt.build(model(), fresh_args())


class PaddedTokens(torch.utils.data.Dataset):
    """input_ids, attention_mask, labels: (SEQ,) rows right-padded with PAD; idx: the sample id.
    Tokens avoid PAD and BAD_TOKEN but where the fault is planted."""

    def __init__(self, n: int = 12 * ROWS, seed: int = 5):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, VOCAB - 1, (n, SEQ), generator=g)
        self.ids[self.ids >= BAD_TOKEN] += 1  # never BAD_TOKEN
        lengths = torch.randint(SEQ // 2, SEQ + 1, (n,), generator=g)
        lengths[::ROWS] = SHORT  # row 0 of every step: mostly padding
        lengths[FAULT_SAMPLE] = FAULT_LENGTH
        self.ids[FAULT_SAMPLE, FAULT_POSITION] = BAD_TOKEN
        self.mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        self.ids[self.mask == 0] = PAD

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].masked_fill(self.mask[i] == 0, -100)
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": labels, "idx": i}
