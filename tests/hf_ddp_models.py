"""A Hugging Face Trainer on 2 processes (DDP, gloo on the CPU), recorded with
ckptlab.integrations.transformers: a tiny GPT-2 (tests/integrations/hf_models.py) with
gradient accumulation, a NaN planted in one sample that rank 1 reads.

`python -m torch.distributed.run --standalone --nproc_per_node=2 tests/hf_ddp_models.py RUN`
records the run; every rank stops at the NaN's step (ckptlab.NonFiniteLoss) and prints it.

The Trainer's DataLoader, prepared by accelerate, hands each rank whole batches in turn (no
shuffling): batch b goes to rank b % 2, and optimizer step s on rank r is made of batches
2 * (ACCUM * s + m) + r, m < ACCUM.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from transformers import GPT2LMHeadModel, Trainer

import ckptlab
from ckptlab.integrations import transformers as ckt
from tests.integrations import hf_models as hm

WORLD, ACCUM = 2, 2
FAULT_STEP, FAULT_RANK, FAULT_MICRO, FAULT_ROW = 3, 1, 1, 1
FAULT_SAMPLE = (WORLD * (ACCUM * FAULT_STEP + FAULT_MICRO) + FAULT_RANK) * hm.BATCH + FAULT_ROW  # 61

ARGS = dataclasses.replace(hm.ARGS, gradient_accumulation_steps=ACCUM, eval_strategy="no", max_steps=6, warmup_steps=1)


class Sequences(hm.Sequences):
    """hm.Sequences with the NaN in FAULT_SAMPLE (hm's own planted sample moved)."""

    def __init__(self):
        super().__init__()
        self.x[FAULT_SAMPLE, 3, 5] = float("nan")


def build():
    torch.manual_seed(0)
    return ckt.build(GPT2LMHeadModel(hm.config()), ARGS)


def main(run_dir: str, trainer_cls: type = Trainer, build_fn=build, args=None) -> None:
    """Record the Trainer's run into `run_dir` (`trainer_cls`: the Trainer, or a subclass that
    `build_fn` builds again with the same `args`, ARGS unless given)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    trainer = trainer_cls(model=GPT2LMHeadModel(hm.config()), args=args or ARGS, train_dataset=Sequences())
    ckt.record(trainer, run_dir, build_fn=build_fn, sample_id_key="idx", ckpt_every=2)
    try:
        trainer.train()
    except ckptlab.NonFiniteLoss as e:
        print(f"rank {trainer.args.process_index} stopped at step {e.step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
