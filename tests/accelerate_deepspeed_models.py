"""The run_clm_no_trainer.py-shaped accelerate loop of tests/accelerate_models.py with
accelerate's `DeepSpeedPlugin(zero_stage=3)` and the example's torch AdamW, on 2 processes
(`torchrun --nproc_per_node=2`, gloo on the CPU), recorded with ckptlab.integrations.accelerate;
two faults far apart.

`python -m torch.distributed.run --standalone --nproc_per_node=2 tests/accelerate_deepspeed_models.py RUN`
records STEPS optimizer steps, a checkpoint every 3. Rank 1 meets a NaN in FAULT_SAMPLE at step
FAULT_STEP (DeepSpeed finds the gradients non-finite and skips that update, accelerate's
scheduler its step; training goes on: on_nonfinite="record"), and the loop sets the learning
rate to LR_FAULT before step LR_STEP alone (the scheduler sets it back after it; the next
step's loss explodes).

On the CPU the Accelerator needs gloo named (`InitProcessGroupKwargs(backend="gloo")`; without
it accelerate counts one process while DeepSpeed's group has two), and no `cpu=True` (with it
accelerate drops the DeepSpeed plugin and runs DDP). The DataLoader is not shuffled: accelerate's
prepared DataLoader hands each rank whole batches in turn, batch b to rank b % 2, and optimizer
step s on rank r is made of batches 2 * (ACCUM * s + m) + r, m < ACCUM.
"""

from __future__ import annotations

import math
import os
import sys

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import InitProcessGroupKwargs, set_seed
from torch.utils.data import DataLoader
from transformers import GPT2LMHeadModel, default_data_collator

import ckptlab
from ckptlab.integrations import accelerate as cka
from tests import accelerate_models as am

WORLD, ACCUM, STEPS = 2, am.ACCUM, 9
SAMPLES = WORLD * ACCUM * STEPS * am.BATCH  # one epoch
FAULT_STEP, FAULT_RANK, FAULT_MICRO, FAULT_ROW = 3, 1, 1, 1
FAULT_SAMPLE = (WORLD * (ACCUM * FAULT_STEP + FAULT_MICRO) + FAULT_RANK) * am.BATCH + FAULT_ROW  # 61
LR_STEP, LR_FAULT = 7, 1e4


def accelerator() -> Accelerator:
    import deepspeed

    # The CPU accelerator builds its shared-memory all-reduce (~1 min of gcc on first use) when
    # the engine starts; it serves inference only, and gloo runs training's collectives.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    plugin = DeepSpeedPlugin(zero_stage=3, gradient_accumulation_steps=ACCUM, gradient_clipping=am.MAX_GRAD_NORM)
    # (the example's prepare takes it from its DataLoader; build_fn prepares none)
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = am.BATCH
    return Accelerator(
        gradient_accumulation_steps=ACCUM,
        deepspeed_plugin=plugin,
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
    )


def prepared(acc: Accelerator):
    """The example's model, optimizer and LR schedule, prepared: the model in DeepSpeed's
    engine, the optimizer its ZeRO-3 optimizer (in accelerate's wrapper)."""
    set_seed(am.SEED)
    model = GPT2LMHeadModel(am.config())
    optimizer = am.optimizer_for(model)
    lr_scheduler = am.scheduler_for(optimizer, acc, math.ceil(SAMPLES / am.BATCH))
    return acc.prepare(model, optimizer, lr_scheduler)


def build():
    acc = accelerator()
    return cka.build(acc, am.train_step, *prepared(acc))


def main(run_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    acc = accelerator()
    model, optimizer, lr_scheduler = prepared(acc)
    dataset = am.Sequences(SAMPLES)
    dataset.x[FAULT_SAMPLE, 3, 5] = float("nan")
    loader = DataLoader(
        ckptlab.with_sample_ids(dataset, key="sample_id"), collate_fn=default_data_collator, batch_size=am.BATCH
    )
    loader = acc.prepare(loader)
    rec = cka.record(
        run_dir, acc, model, optimizer, lr_scheduler, body=am.train_step, build_fn=build,
        sample_id_key="sample_id", ckpt_every=3, on_nonfinite="record", on_anomaly=None,
    )  # fmt: skip
    with rec:
        for batch in loader:
            if rec.next_step == LR_STEP and not rec.rec.in_step:  # the loop's bug, before the step's first micro-batch
                for group in optimizer.param_groups:
                    group["lr"] = LR_FAULT
            rec.micro_batch(batch)
    print(f"rank {acc.process_index} recorded {rec.next_step} steps", flush=True)
    # gloo can abort a process at exit after its work is done: leave at a barrier, without the
    # interpreter's teardown.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
