"""Loops with several optimizers: a DCGAN-shaped GAN (tiny MLPs D and G in one container
module, Adam for each, BCE losses, a step_fn that updates D then G); one optimizer with two
parameter groups whose second group's learning rate jumps; and the MNIST example's per-epoch
StepLR.

build/step functions live at module level: replay imports them by name.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

LATENT, DIM, B = 4, 6, 6  # batches of 6 rows, sample ids 100 * step + row: the zoo's (tests/fault_zoo.py)
FAULT = 21  # G's scheduler multiplies its learning rate by JUMP at this step only
JUMP = 1e4
STEPS = 26


class GAN(nn.Module):
    """D and G in one module: the model holds every trained parameter."""

    def __init__(self):
        super().__init__()
        self.G = nn.Sequential(nn.Linear(LATENT, 16), nn.ReLU(), nn.Linear(16, DIM))
        self.D = nn.Sequential(nn.Linear(DIM, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))


def _g_schedule(step: int) -> float:
    return JUMP if step == FAULT else 1.0  # a schedule with a bug at one step


def _optimizers(m: GAN):
    opt_d = torch.optim.Adam(m.D.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(m.G.parameters(), lr=2e-3, betas=(0.5, 0.999))
    return opt_d, opt_g


def build():
    """The dict form: {"d": ..., "g": ...}, G's scheduler with the planted jump."""
    torch.manual_seed(0)
    m = GAN()
    opt_d, opt_g = _optimizers(m)
    return m, {"d": opt_d, "g": opt_g}, {"d": None, "g": torch.optim.lr_scheduler.LambdaLR(opt_g, _g_schedule)}


def build_list():
    """The list form, a scheduler for each: D's decays a little every step, G's jumps."""
    torch.manual_seed(0)
    m = GAN()
    opt_d, opt_g = _optimizers(m)
    scheds = [
        torch.optim.lr_scheduler.ExponentialLR(opt_d, 0.97),
        torch.optim.lr_scheduler.LambdaLR(opt_g, _g_schedule),
    ]
    return m, [opt_d, opt_g], scheds


def _gan_step(model, opt_d, opt_g, batch):
    """pytorch/examples' DCGAN step: D on real and fake, then G through D."""
    real, noise = batch
    ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
    opt_d.zero_grad()
    fake = model.G(noise)
    loss_d = F.binary_cross_entropy_with_logits(model.D(real), ones)
    loss_d = loss_d + F.binary_cross_entropy_with_logits(model.D(fake.detach()), zeros)
    loss_d.backward()
    opt_d.step()
    opt_g.zero_grad()  # (D's gradients from G's loss are left: zeroed at the next step)
    loss_g = F.binary_cross_entropy_with_logits(model.D(fake), ones)
    loss_g.backward()
    opt_g.step()
    return loss_d.detach() + loss_g.detach()


def step(model, optimizers, batch):
    return _gan_step(model, optimizers["d"], optimizers["g"], batch)


def step_list(model, optimizers, batch):
    opt_d, opt_g = optimizers
    return _gan_step(model, opt_d, opt_g, batch)


# --- the trap: the Recorder given D's optimizer only, G's kept by the loop ----------------------------


def build_d_only():
    torch.manual_seed(0)
    m = GAN()
    opt_d, opt_g = _optimizers(m)
    m.opt_g = opt_g  # (the loop keeps G's optimizer to itself)
    return m, opt_d


def step_d_only(model, opt_d, batch):
    return _gan_step(model, opt_d, model.opt_g, batch)


def batch(s: int):
    g = torch.Generator().manual_seed(1000 + s)
    real = torch.randn(B, DIM, generator=g) * 0.5 + 1.0
    return real, torch.randn(B, LATENT, generator=g)


def ids(s: int) -> list[int]:
    return [100 * s + r for r in range(B)]


def record_gan_lr_jump(run_dir):
    """The zoo's scenario (tests/fault_zoo.py): the dict form, checkpoints every 10 steps; the
    symptom is the loss spike G's update at FAULT causes (the first loss 10x the first one)."""
    from tests.fault_models import Expected, record_pairs

    losses, _ = record_pairs(run_dir, build, step, ((batch(s), ids(s)) for s in range(STEPS)))
    symptom = next(s for s, v in enumerate(losses) if s >= FAULT and not v < 10 * losses[0])
    return Expected(FAULT, symptom, None, [], kind="optimizer")


# --- one optimizer, two parameter groups; only the second's learning rate jumps ---------------------

GROUP_FAULT = 18


class TwoPart(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(DIM, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def _head_schedule(step: int) -> float:
    return JUMP if step == GROUP_FAULT else 1.0


def build_groups():
    torch.manual_seed(0)
    m = TwoPart()
    opt = torch.optim.Adam([{"params": m.body.parameters()}, {"params": m.head.parameters()}], lr=1e-3)
    return m, opt, torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0, _head_schedule])


def step_groups(model, opt, batch):
    x, _ = batch
    loss = F.mse_loss(model(x), x[:, :1])
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


# --- the MNIST example: StepLR(step_size=1, gamma=0.7), stepped by the loop after each epoch ----------

EPOCH = 4  # steps an epoch
GAMMA = 0.7
BASE_LR = 0.1


def build_epochs():
    torch.manual_seed(0)
    m = TwoPart()
    opt = torch.optim.SGD(m.parameters(), lr=BASE_LR)
    return m, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA)
