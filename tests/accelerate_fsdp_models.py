"""The accelerate loop of tests/accelerate_ddp_models.py under accelerate's FSDP2 on 2 processes
(gloo), recorded with ckptlab.integrations.accelerate; the same planted NaN.

accelerate runs FSDP only on accelerators: on the CPU an `Accelerator(fsdp_plugin=...)` silently
prepares DDP instead. `accelerator()` forces FSDP2 as one would to try it on a CPU: the state's
distributed type (the accelerator's, and the one accelerate shares between its states) and the
plugin, set after the Accelerator is made and before `prepare`, which then shards the GPT-2
with `fully_shard` (its embeddings and final norm in one FSDP2 unit, as accelerate groups them).

`python -m torch.distributed.run --standalone --nproc_per_node=2 tests/accelerate_fsdp_models.py RUN`
records one epoch; every rank stops at the NaN's step (ckptlab.NonFiniteLoss) and prints it.
"""

from __future__ import annotations

import sys

from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.state import PartialState
from accelerate.utils import DistributedType

from ckptlab.integrations import accelerate as cka
from tests import accelerate_ddp_models as adm
from tests import accelerate_models as am
from tests.accelerate_ddp_models import ACCUM, FAULT_MICRO, FAULT_RANK, FAULT_ROW, FAULT_SAMPLE, FAULT_STEP, WORLD

__all__ = ["ACCUM", "FAULT_MICRO", "FAULT_RANK", "FAULT_ROW", "FAULT_SAMPLE", "FAULT_STEP", "WORLD", "am"]


def accelerator() -> Accelerator:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    acc = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True, fsdp_plugin=plugin)
    acc.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    return acc


def build():
    acc = accelerator()
    return cka.build(acc, am.train_step, *adm.prepared(acc))


def main(run_dir: str) -> None:
    adm.main(run_dir, accelerator(), build)


if __name__ == "__main__":
    main(sys.argv[1])
