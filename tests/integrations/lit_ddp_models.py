"""A Lightning DDP run on 2 CPU processes (gloo), with a NaN planted in one sample of rank 1's data.

`python -m tests.integrations.lit_ddp_models RUN_DIR ACCUMULATE [popen|spawn]` trains LitMLP
(tests/integrations/lit_models.py) under `Trainer(devices=2, strategy=DDPStrategy(
process_group_backend="gloo"))` with ckptlab's callback. Lightning's "ddp" starts rank 1 by
running this same command again (so the test runs it in a subprocess, not in pytest). With
"popen" every rank stops at the NaN step (NonFiniteLoss, decided on every rank's loss) and
prints `rank R stopped at step S`; "spawn" is strategy="ddp_spawn", with precision="bf16-mixed" (see `main`).
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch

import ckptlab
from ckptlab.integrations import lightning as ckl
from tests.integrations import lit_models as lm

# The DistributedSampler (no shuffle) gives rank r the samples r, r+2, r+4, ...: sample 45 is
# rank 1's 23rd, row 2 of its batch 5 (batches of 4).
FAULT_SAMPLE, FAULT_RANK, FAULT_BATCH, FAULT_ROW = 45, 1, 5, 2


class Regression(lm.Regression):
    def __init__(self):
        super().__init__()
        self.x[FAULT_SAMPLE, 2] = float("nan")


class Data(pl.LightningDataModule):
    """The loader made on each rank once its process group is up: a DistributedSampler without
    shuffling (Lightning's own would shuffle), so where the fault lands is plain to see."""

    def train_dataloader(self):
        data = Regression()
        sampler = torch.utils.data.DistributedSampler(data, shuffle=False)
        return torch.utils.data.DataLoader(data, batch_size=lm.BATCH, sampler=sampler)


def sample_ids(batch: int, rank: int) -> list[int]:
    """The ids in rank `rank`'s batch number `batch`."""
    return [2 * (lm.BATCH * batch + r) + rank for r in range(lm.BATCH)]


def main(run_dir: str, accumulate: int, start_method: str = "popen") -> None:
    """Train until the NaN step. "popen" (strategy="ddp") runs this script again for rank 1,
    and every rank raises NonFiniteLoss there; "spawn" (strategy="ddp_spawn") spawns both ranks
    from this process, which a rank's exception would end with the other one killed: those
    ranks record the NaN step (on_nonfinite="record") and stop after it (max_steps)."""
    from lightning.pytorch.strategies import DDPStrategy

    torch.set_num_threads(1)
    spawn = start_method == "spawn"
    cb = ckl.CkptlabCallback(
        run_dir, build_fn=lm.build, sample_ids="idx", ckpt_every=2, on_nonfinite="record" if spawn else "raise"
    )
    trainer = lm.trainer(
        run_dir + "-trainer",
        callbacks=[cb],
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo", start_method=start_method),
        accumulate_grad_batches=accumulate,
        max_steps=FAULT_BATCH // accumulate + 1,
        precision="bf16-mixed" if spawn else "32-true",
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    torch.manual_seed(0)
    try:
        trainer.fit(lm.LitMLP(), datamodule=Data())
    except ckptlab.NonFiniteLoss as e:
        print(f"rank {trainer.global_rank} stopped at step {e.step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
