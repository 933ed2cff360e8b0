"""A tiny LightningModule and its data, with a NaN planted in one sample.

build/step functions live at module level: replay imports `build` by name.
"""

from __future__ import annotations

import logging
import warnings

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F

from ckptlab.integrations import lightning as ckl

BATCH = 4
FAULT_SAMPLE = 37  # the dataset index with the planted fault: row 1 of the batch at step 9


class Regression(torch.utils.data.Dataset):
    """x: (8,) features, y: (1,) target, idx: the dataset index (the sample id)."""

    def __init__(self, n: int = 64, fault: str | None = None, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x[:, :1] * 0.5 + 0.1 * torch.randn(n, 1, generator=g)
        if fault == "nan":
            self.x[FAULT_SAMPLE, 2] = float("nan")
        elif fault == "overflow":
            self.x[FAULT_SAMPLE] = 3e38  # finite, absurd: fc1's matmul sums to Inf
        elif fault == "fp16":
            self.x[FAULT_SAMPLE] = FP16_ROW_VALUE  # LitWide's fc1 overflows float16, not float32

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "idx": i}


class LitMLP(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.1)  # consumes the RNG: replay must restore it bit for bit
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self(batch["x"]), batch["y"])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self(batch["x"]), batch["y"]))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def build():
    torch.manual_seed(0)
    return ckl.build(LitMLP())


def trainer(root, **kw) -> pl.Trainer:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # no banners, tips, summaries
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*GPU available but not used.*")
    opts = dict(
        accelerator="cpu",
        devices=1,
        max_steps=12,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        val_check_interval=4,
        limit_val_batches=1,
        num_sanity_val_steps=0,
    )
    opts.update(kw)
    return pl.Trainer(**opts)


def loaders(fault: str | None = None):
    train = torch.utils.data.DataLoader(Regression(fault=fault), batch_size=BATCH, shuffle=False)
    val = torch.utils.data.DataLoader(Regression(16, seed=2), batch_size=BATCH)
    return train, val


class LitWide(LitMLP):
    """fc1's activations reach ~1e3 on typical rows: fine in float16 (max 65504), until a row
    ~150x larger than typical (finite, not absurd: FP16_ROW_VALUE) makes them ~1e5."""

    def __init__(self):
        pl.LightningModule.__init__(self)
        self.fc1 = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(32, 1)
        with torch.no_grad():
            self.fc1.weight.mul_(200.0)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))) / 1000.0)


FP16_ROW_VALUE = 400.0
# Too high for the first steps' scaled float16 gradients: the scaler skips them and backs off.
FP16_INIT_SCALE = 2.0**20


def build_fp16():
    torch.manual_seed(0)
    return ckl.build(LitWide(), precision="16-mixed")


def fp16_plugin():
    """precision="16-mixed" on the CPU: the Trainer flag turns it into bf16-mixed there (with a
    warning), the plugin with a CPU GradScaler is accepted and runs Lightning's own AMP code."""
    from lightning.pytorch.plugins import MixedPrecision

    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=FP16_INIT_SCALE))


# --- manual optimization: a GAN, D then G, each with its own optimizer --------------------------------


class LitGAN(pl.LightningModule):
    """pytorch/examples' DCGAN step, written for Lightning's manual optimization; G's learning
    rate jumps GAN_JUMP-fold at step GAN_FAULT (its scheduler, stepped by training_step)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Dropout(0.1), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        opt_d, opt_g = self.optimizers()
        real = batch["x"]
        noise = torch.randn(len(real), 4)  # the RNG: replay must restore it bit for bit
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        fake = self.G(noise)
        self.toggle_optimizer(opt_d)
        loss_d = F.binary_cross_entropy_with_logits(self.D(real), ones)
        loss_d = loss_d + F.binary_cross_entropy_with_logits(self.D(fake.detach()), zeros)
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        self.toggle_optimizer(opt_g)
        loss_g = F.binary_cross_entropy_with_logits(self.D(fake), ones)
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.lr_schedulers().step()
        self.log("loss_g", loss_g)
        return loss_d.detach() + loss_g.detach()

    def configure_optimizers(self):
        opt_d = torch.optim.Adam(self.D.parameters(), lr=2e-3, betas=(0.5, 0.999))
        opt_g = torch.optim.Adam(self.G.parameters(), lr=2e-3, betas=(0.5, 0.999))
        sched_g = torch.optim.lr_scheduler.LambdaLR(opt_g, lambda s: GAN_JUMP if s == GAN_FAULT else 1.0)
        return [opt_d, opt_g], [sched_g]


GAN_FAULT, GAN_JUMP = 9, 1e4


def build_gan():
    torch.manual_seed(0)
    return ckl.build(LitGAN())


class QuietGAN(LitGAN):
    """LitGAN's step as manual optimization is usually written: it returns nothing."""

    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)


def build_quiet_gan():
    torch.manual_seed(0)
    return ckl.build(QuietGAN())


# --- automatic optimization: a training_step that returns None on one batch ---------------------------

SKIPPED = 4  # the batch LitSkips returns None for (a checkpoint's step): Lightning runs no backward


class LitSkips(LitMLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)  # (its forward draws dropout's RNG all the same)
        return None if batch_idx == SKIPPED else loss


def build_skips():
    torch.manual_seed(0)
    return ckl.build(LitSkips())


class LitChecked(LitMLP):
    """LitMLP whose `on_after_backward` refuses a non-finite gradient, as training code does."""

    def on_after_backward(self):
        if any(p.grad is not None and not torch.isfinite(p.grad).all() for p in self.parameters()):
            raise FloatingPointError("non-finite gradient")


def build_checked():
    torch.manual_seed(0)
    return ckl.build(LitChecked())
