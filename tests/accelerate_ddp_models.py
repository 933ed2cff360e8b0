"""The run_clm_no_trainer.py-shaped accelerate loop of tests/accelerate_models.py on 2
processes (`torchrun --nproc_per_node=2`, accelerate's multi-CPU DDP over gloo), recorded with
ckptlab.integrations.accelerate; a NaN planted in one sample that rank 1 reads.

`python -m torch.distributed.run --standalone --nproc_per_node=2 tests/accelerate_ddp_models.py RUN`
records one epoch; every rank stops at the NaN's step (ckptlab.NonFiniteLoss) and prints it.

The DataLoader is not shuffled here, so that the fault's place is plain: accelerate's prepared
DataLoader hands each rank whole batches in turn, batch b to rank b % 2, and optimizer step s on
rank r is made of batches 2 * (ACCUM * s + m) + r, m < ACCUM.
"""

from __future__ import annotations

import math
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import GPT2LMHeadModel, default_data_collator

import ckptlab
from ckptlab.integrations import accelerate as cka
from tests import accelerate_models as am

WORLD, ACCUM, SAMPLES = 2, am.ACCUM, 64  # 16 batches: 8 a rank, 4 optimizer steps
FAULT_STEP, FAULT_RANK, FAULT_MICRO, FAULT_ROW = 3, 1, 1, 1
FAULT_SAMPLE = (WORLD * (ACCUM * FAULT_STEP + FAULT_MICRO) + FAULT_RANK) * am.BATCH + FAULT_ROW  # 61


def prepared(accelerator):
    """The example's model, optimizer and LR schedule (laid out over the DataLoader's length
    before `prepare`, as the example does), prepared: the model wrapped in DDP."""
    set_seed(am.SEED)
    model = GPT2LMHeadModel(am.config())
    optimizer = am.optimizer_for(model)
    lr_scheduler = am.scheduler_for(optimizer, accelerator, math.ceil(SAMPLES / am.BATCH))
    return accelerator.prepare(model, optimizer, lr_scheduler)


def build():
    accelerator = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True)
    return cka.build(accelerator, am.train_step, *prepared(accelerator))


def main(run_dir: str, accelerator: Accelerator | None = None, build_fn=build) -> None:
    """Record the loop into `run_dir` (`accelerator`: accelerate's multi-CPU DDP unless given,
    `build_fn`: the one that makes it again)."""
    torch.set_num_threads(1)
    accelerator = accelerator or Accelerator(gradient_accumulation_steps=ACCUM, cpu=True)
    model, optimizer, lr_scheduler = prepared(accelerator)
    dataset = am.Sequences(SAMPLES)
    dataset.x[FAULT_SAMPLE, 3, 5] = float("nan")
    loader = DataLoader(
        ckptlab.with_sample_ids(dataset, key="sample_id"), collate_fn=default_data_collator, batch_size=am.BATCH
    )
    loader = accelerator.prepare(loader)
    rec = cka.record(
        run_dir, accelerator, model, optimizer, lr_scheduler,
        body=am.train_step, build_fn=build_fn, sample_id_key="sample_id", ckpt_every=2,
    )  # fmt: skip
    with rec:
        try:
            for batch in loader:
                rec.micro_batch(batch)
        except ckptlab.NonFiniteLoss as e:
            print(f"rank {accelerator.process_index} stopped at step {e.step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
