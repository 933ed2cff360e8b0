"""The litgpt-shaped Fabric loop of tests/fabric_models.py on 2 processes (`torchrun
--nproc_per_node=2`, Fabric's strategy="ddp" on the CPU: gloo), recorded with
ckptlab.integrations.fabric; a NaN planted in one sample that rank 1 reads.

`python -m torch.distributed.run --standalone --nproc_per_node=2 tests/fabric_ddp_models.py RUN`
records one pass over the data; every rank stops at the NaN's step (ckptlab.NonFiniteLoss,
decided on every rank's loss) and prints it.

`fabric.setup_dataloaders` gives each rank a DistributedSampler without shuffling (the loader's
own is sequential): rank r reads samples r, r + 2, ..., so row i of its micro-batch j is sample
2 * (BATCH * j + i) + r, and micro-batch j is micro-batch j % ACCUM of step j // ACCUM.
"""

from __future__ import annotations

import sys

import torch

import ckptlab
from ckptlab.integrations import fabric as ckf
from tests import fabric_models as fm

WORLD = 2
FAULT_STEP, FAULT_RANK, FAULT_MICRO, FAULT_ROW = 3, 1, 1, 1
FAULT_SAMPLE = WORLD * (fm.BATCH * (fm.ACCUM * FAULT_STEP + FAULT_MICRO) + FAULT_ROW) + FAULT_RANK  # 59


def build():
    fabric = fm.fabric_for(WORLD)
    return ckf.build(fabric, fm.train_step, *fm.made())


def main(run_dir: str) -> None:
    torch.set_num_threads(1)
    fabric = fm.fabric_for(WORLD)
    fabric.launch()  # under torchrun: joins its processes
    fabric.seed_everything(fm.SEED)
    model, optimizer = fabric.setup(*fm.made())
    data = fm.Sequences(nan_sample=FAULT_SAMPLE)
    loader = fabric.setup_dataloaders(
        torch.utils.data.DataLoader(ckptlab.with_sample_ids(data), batch_size=fm.BATCH, shuffle=False)
    )
    with ckf.record(run_dir, fabric, model, optimizer, body=fm.train_step, build_fn=build, ckpt_every=2) as rec:
        try:
            fm.fit(fabric, rec, model, optimizer, loader, max_steps=FAULT_STEP + 1)
        except ckptlab.NonFiniteLoss as e:
            print(f"rank {fabric.global_rank} stopped at step {e.step}", flush=True)
    # Fabric leaves its process group to the interpreter's exit, where gloo's teardown can abort
    # on a busy machine (as replay's ranks can: ckptlab/replayer/distributed.py): torn down here,
    # as tests/dist_models.py does.
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
