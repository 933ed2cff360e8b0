"""Lightning's ModelParallelStrategy on CPU processes (gloo), recorded with ckptlab's callback:
FSDP2 in `configure_model` on 2 processes ("fsdp": data_parallel_size=2, tensor_parallel_size=1;
bf16-mixed, accumulate_grad_batches=2), and FSDP2 x TP on 4 ("fsdp_tp": 2 x 2, tensor
parallelism inside each pair of processes; 32-true, one batch a step).

    python -m torch.distributed.run --standalone --nproc_per_node=N tests/integrations/lit_mp_models.py RUN fsdp|fsdp_tp

One run holds two faults far apart: the LR scheduler multiplies step LR_STEP's learning rate
by LR_SPIKE (the update explodes), then at NAN_STEP data-parallel rank NAN_DATA_RANK meets a
NaN in row NAN_ROW of its batch (its last micro-batch, with accumulation; under TP, both
processes of its group) and every rank stops there (NonFiniteLoss), printing `rank R stopped
at step S`.
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

import ckptlab
from ckptlab.integrations import lightning as ckl
from tests.integrations import lit_models as lm
from tests.models import MLP

LR_STEP, LR_SPIKE = 6, 30.0
NAN_STEP, NAN_ROW, NAN_DATA_RANK = 12, 2, 1
STEPS, DATA_PARALLEL = 15, 2
TENSOR_PARALLEL = {"fsdp": 1, "fsdp_tp": 2}
ACCUMULATE = {"fsdp": 2, "fsdp_tp": 1}
PRECISION = {"fsdp": "bf16-mixed", "fsdp_tp": "32-true"}
WORLD = {kind: DATA_PARALLEL * tp for kind, tp in TENSOR_PARALLEL.items()}


def sample_id(kind: str, step: int, data_rank: int, row: int, micro: int = 0) -> int:
    """The dataset index in row `row` of micro-batch `micro` of data-parallel rank `data_rank`'s
    step `step`: a DistributedSampler without shuffling gives rank d the indices d, d + 2, ..."""
    batch = ACCUMULATE[kind] * step + micro
    return DATA_PARALLEL * (lm.BATCH * batch + row) + data_rank


def nan_micro(kind: str) -> int:
    return ACCUMULATE[kind] - 1  # the step's last micro-batch


def nan_sample(kind: str) -> int:
    return sample_id(kind, NAN_STEP, NAN_DATA_RANK, NAN_ROW, nan_micro(kind))


class Regression(lm.Regression):
    def __init__(self, kind: str):
        super().__init__(n=DATA_PARALLEL * lm.BATCH * ACCUMULATE[kind] * STEPS)
        self.x[nan_sample(kind), 3] = float("nan")


def _spike(step: int) -> float:
    return LR_SPIKE if step == LR_STEP else 1.0


class LitSharded(pl.LightningModule):
    """The MLP of tests/models.py, sharded by FSDP2 in configure_model (fc1 its own unit, then
    the whole), as Lightning's ModelParallelStrategy examples do; with `tp`, fc1 column-wise
    and fc2 row-wise on the mesh's tensor_parallel dimension first."""

    def __init__(self, tp: bool = False):
        super().__init__()
        self.model, self.tp = MLP(), tp

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        dp = self.device_mesh["data_parallel"]
        if self.tp:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
            parallelize_module(self.model, self.device_mesh["tensor_parallel"], plan)
        fully_shard(self.model.fc1, mesh=dp)
        fully_shard(self.model, mesh=dp)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.model(batch["x"]), batch["y"])

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _spike)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def build_fsdp():
    torch.manual_seed(0)
    return ckl.build(LitSharded())


def build_fsdp_tp():
    torch.manual_seed(0)
    return ckl.build(LitSharded(tp=True), tensor_parallel_size=TENSOR_PARALLEL["fsdp_tp"])


BUILDS = {"fsdp": build_fsdp, "fsdp_tp": build_fsdp_tp}


class Data(pl.LightningDataModule):
    """Each data-parallel rank's loader, made once the strategy's mesh is up: the strategy's
    sampler options (the processes of one TP group get one batch), without shuffling."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def train_dataloader(self):
        data = Regression(self.kind)
        sampler = torch.utils.data.DistributedSampler(
            data, shuffle=False, **self.trainer.strategy.distributed_sampler_kwargs
        )
        return torch.utils.data.DataLoader(data, batch_size=lm.BATCH, sampler=sampler)


def main(run_dir: str, kind: str) -> None:
    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy

    torch.set_num_threads(1)
    cb = ckl.CkptlabCallback(run_dir, build_fn=BUILDS[kind], sample_ids="idx", ckpt_every=5, on_anomaly=None)
    strategy = ModelParallelStrategy(
        data_parallel_size=DATA_PARALLEL, tensor_parallel_size=TENSOR_PARALLEL[kind], process_group_backend="gloo"
    )
    trainer = lm.trainer(
        run_dir + "-trainer",
        callbacks=[cb],
        devices=WORLD[kind],
        strategy=strategy,
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE[kind],
        precision=PRECISION[kind],
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    stopped = STEPS
    try:
        trainer.fit(LitSharded(tp=kind == "fsdp_tp"), datamodule=Data(kind))
    except ckptlab.NonFiniteLoss as e:
        stopped = e.step
    print(f"rank {trainer.global_rank} stopped at step {stopped}", flush=True)
    # gloo's worker threads can abort the interpreter's exit (pytorch/pytorch#190489): leave
    # once every rank is done, without the shutdown that races them.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
