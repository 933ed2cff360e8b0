"""The Hugging Face Trainer of tests/hf_ddp_models.py under FSDP2 on 2 processes (gloo), recorded
with ckptlab.integrations.transformers; the same planted NaN.

`fsdp_args()` asks for FSDP as a GPU run would (`fsdp="full_shard"`: FSDP2, transformers 5's
default, each GPT-2 block wrapped), but the Trainer runs FSDP only on accelerators: on the CPU
it prepares DDP, silently. `FSDP2OnCPU` forces it as one would to try it on a CPU: once the
Trainer has made its accelerator, the state's distributed type (the accelerator's, and the one
accelerate shares between its states) and the plugin the Trainer built from the arguments;
`train()` then shards the GPT-2 with `fully_shard`. (The arguments are made when used, not at
import: outside a distributed job the Trainer refuses `fsdp=`.)

`python -m torch.distributed.run --standalone --nproc_per_node=2 tests/hf_fsdp_models.py RUN`
records the run; every rank stops at the NaN's step (ckptlab.NonFiniteLoss) and prints it.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from accelerate import FullyShardedDataParallelPlugin
from accelerate.state import PartialState
from accelerate.utils import DistributedType
from transformers import GPT2LMHeadModel, Trainer

from ckptlab.integrations import transformers as ckt
from tests import hf_ddp_models as hd
from tests.hf_ddp_models import ACCUM, FAULT_MICRO, FAULT_RANK, FAULT_ROW, FAULT_SAMPLE, FAULT_STEP, WORLD
from tests.integrations import hf_models as hm

__all__ = ["ACCUM", "FAULT_MICRO", "FAULT_RANK", "FAULT_ROW", "FAULT_SAMPLE", "FAULT_STEP", "WORLD"]


def fsdp_args():
    return dataclasses.replace(hd.ARGS, fsdp="full_shard")


class FSDP2OnCPU(Trainer):
    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        assert plugin.fsdp_version == 2
        self.accelerator.state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.accelerator.state.fsdp_plugin = plugin
        self.is_fsdp_enabled = True


def build():
    torch.manual_seed(0)
    return ckt.build(GPT2LMHeadModel(hm.config()), fsdp_args(), trainer_cls=FSDP2OnCPU)


def main(run_dir: str) -> None:
    hd.main(run_dir, FSDP2OnCPU, build, fsdp_args())


if __name__ == "__main__":
    main(sys.argv[1])
