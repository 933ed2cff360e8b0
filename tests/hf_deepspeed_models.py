"""A Hugging Face Trainer with `deepspeed=` a ZeRO-2 config and the Trainer's torch AdamW, on 2
processes (gloo on the CPU), recorded with ckptlab.integrations.transformers: the tiny GPT-2 of
tests/integrations/hf_models.py with gradient accumulation, two faults far apart.

`python -m torch.distributed.run --standalone --nproc_per_node=2 tests/hf_deepspeed_models.py RUN`
records STEPS optimizer steps, a checkpoint every 3. Rank 1 meets a NaN in FAULT_SAMPLE at step
FAULT_STEP (DeepSpeed finds the gradients non-finite and skips that update, the Trainer its LR
step; training goes on: on_nonfinite="record"), and a callback sets the learning rate to
LR_FAULT before step LR_STEP alone (the Trainer's scheduler sets it back after it; the next
step's loss explodes).

The Trainer's DataLoader, prepared by accelerate, hands each rank whole batches in turn (no
shuffling): batch b goes to rank b % 2, and optimizer step s on rank r is made of batches
2 * (ACCUM * s + m) + r, m < ACCUM.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
from transformers import GPT2LMHeadModel, Trainer, TrainerCallback

from ckptlab.integrations import transformers as ckt
from tests.integrations import hf_models as hm

WORLD, ACCUM, STEPS = 2, 2, 9
FAULT_STEP, FAULT_RANK, FAULT_MICRO, FAULT_ROW = 3, 1, 1, 1
FAULT_SAMPLE = (WORLD * (ACCUM * FAULT_STEP + FAULT_MICRO) + FAULT_RANK) * hm.BATCH + FAULT_ROW  # 61
LR_STEP, LR_FAULT = 7, 1e4

# The Trainer fills the "auto" values from its arguments. No train_batch_size: it would hold
# the world size, and replay explains the root step in a process group of one.
ZERO2 = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 2},
}


def args():
    """The run's TrainingArguments, made where they are used: with `deepspeed=` they set up
    accelerate's distributed state as they are made (in the replay's process group, then)."""
    made = dataclasses.replace(
        hm.ARGS,
        deepspeed=ZERO2,
        use_cpu=False,  # (with use_cpu=True accelerate drops DeepSpeed and runs DDP)
        gradient_accumulation_steps=ACCUM,
        eval_strategy="no",
        max_steps=STEPS,
        warmup_steps=1,
    )
    _count_processes()
    return made


def _count_processes() -> None:
    """accelerate's state counts the processes of DeepSpeed's group, as it does on GPUs. On a
    machine without one it finds no backend of its own and counts 1 process (while DeepSpeed's
    gloo group has 2): every rank would read the whole dataset and the DeepSpeed config's
    batch sizes would not add up."""
    import torch.distributed as dist
    from accelerate.state import PartialState

    if dist.is_initialized():
        rank, local = dist.get_rank(), int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        PartialState._shared_state.update(
            num_processes=dist.get_world_size(), process_index=rank, local_process_index=local
        )


def _no_shm_op() -> None:
    import deepspeed

    # The CPU accelerator builds its shared-memory all-reduce (~1 min of gcc on first use) when
    # the engine starts; it serves inference only, and gloo runs training's collectives.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def build():
    _no_shm_op()
    torch.manual_seed(0)
    return ckt.build(GPT2LMHeadModel(hm.config()), args())


class LearningRateBug(TrainerCallback):
    """The loop's bug: the learning rate of step LR_STEP is LR_FAULT."""

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step == LR_STEP:
            for group in optimizer.param_groups:
                group["lr"] = LR_FAULT


def main(run_dir: str) -> None:
    import torch.distributed as dist

    _no_shm_op()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dataset = hm.Sequences(WORLD * ACCUM * STEPS * hm.BATCH)
    dataset.x[FAULT_SAMPLE, 3, 5] = float("nan")
    trainer = Trainer(
        model=GPT2LMHeadModel(hm.config()), args=args(), train_dataset=dataset, callbacks=[LearningRateBug()]
    )
    ckt.record(
        trainer, run_dir, build_fn=build, sample_id_key="idx", ckpt_every=3, on_nonfinite="record", on_anomaly=None
    )
    trainer.train()
    print(f"rank {trainer.args.process_index} recorded {trainer.state.global_step} steps", flush=True)
    # gloo can abort a process at exit after its work is done: leave at a barrier, without the
    # interpreter's teardown.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
