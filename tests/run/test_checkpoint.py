"""run/checkpoint.py: the committed files, their hashes, and an exact training-state round trip."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import safetensors.torch
import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab
from ckptlab.errors import IntegrityError
from ckptlab.run.checkpoint import list_checkpoints
from ckptlab.training.state import capture_rng, load_model, load_train_state, restore_rng
from tests import models
from tests.run.bits import assert_same


# A step that draws from every RNG ckptlab restores: torch (dropout), numpy and python random.
def build_noisy():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=100)
    return model, opt, sched


def step_noisy(model, optimizer, batch, scaler=None):
    x, y = batch
    x = x + 0.01 * float(np.random.rand()) + 0.01 * random.random()
    loss = F.mse_loss(model(x), y)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss


def step_scaled(model, optimizer, batch):
    return step_noisy(model, optimizer, batch, SCALER[0])


SCALER: list = [None]


@pytest.mark.parametrize("with_scaler", [False, True])
def test_training_state_round_trips_exactly(run_dir, with_scaler):
    """Restore checkpoint 5 into a fresh build and re-run steps 5..9: the same losses, bit for bit,
    and the same optimizer/scheduler/scaler/RNG state at the end."""
    batches = list(models.mlp_batches(10))
    model, opt, sched = build_noisy()
    SCALER[0] = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3) if with_scaler else None
    step_fn = step_scaled if with_scaler else step_noisy
    random.seed(1)
    np.random.seed(1)
    with ckptlab.Recorder(
        run_dir, model, opt, step_fn=step_fn, build_fn=build_noisy, scheduler=sched, scaler=SCALER[0], ckpt_every=5
    ) as rec:
        losses = [rec.step(b).item() for b, _ in batches]
    final = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "rng": capture_rng()}
    if with_scaler:
        final["scaler"] = SCALER[0].state_dict()

    run = ckptlab.open_run(run_dir)
    ckpt = run.checkpoint(5)
    model2, opt2, sched2 = build_noisy()
    SCALER[0] = torch.amp.GradScaler("cpu") if with_scaler else None
    load_model(model2, *ckpt.load_model())
    state = ckpt.load_state()
    load_train_state(state, opt2, sched2, SCALER[0])
    restore_rng(state["rng"])
    assert state["env"]["num_threads"] == torch.get_num_threads()
    replayed = []
    for n in range(5, 10):
        batch, _ = run.batch(n)
        replayed.append(step_fn(model2, opt2, batch).item())
        sched2.step()
    assert replayed == losses[5:] == run.metrics().loss[5:].tolist()
    assert_same(model2.state_dict(), final["model"])
    assert_same(opt2.state_dict(), final["opt"])
    assert_same(sched2.state_dict(), final["sched"])
    assert_same(capture_rng(), final["rng"])
    if with_scaler:
        assert_same(SCALER[0].state_dict(), final["scaler"])


def test_commit_files_are_standard_and_hashed(run_dir):
    models.record_run(run_dir, models.build_lm, models.step_lm, models.lm_batches(3), ckpt_every=2)
    ckpt_dir = run_dir / "checkpoints" / "step-000000002"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["COMMIT.json", "model.safetensors", "state.safetensors"]
    commit = json.loads((ckpt_dir / "COMMIT.json").read_text())
    assert commit["step"] == 2 and commit["format_version"] == 1 and commit["healthy"] is True
    for name, meta in commit["files"].items():
        assert meta["bytes"] == (ckpt_dir / name).stat().st_size and len(meta["sha256"]) == 64
    # Plain safetensors reads the model; the tied lm_head is stored once, named in metadata.
    plain = safetensors.torch.load_file(ckpt_dir / "model.safetensors")
    assert "lm_head.weight" not in plain and "wte.weight" in plain
    with safetensors.safe_open(ckpt_dir / "model.safetensors", "pt") as f:
        assert json.loads(f.metadata()["ckptlab.aliases"]) == {"lm_head.weight": "wte.weight"}


def test_verify_names_the_tampered_file(run_dir):
    models.record_run(run_dir, models.build_mlp, models.step_mlp, models.mlp_batches(2), ckpt_every=5)
    path = run_dir / "checkpoints" / "step-000000000" / "state.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # one bit, same size: only the hash can tell
    path.write_bytes(bytes(data))
    (ckpt,), problems = list_checkpoints(run_dir)
    assert problems == []
    with pytest.raises(IntegrityError, match="state.safetensors: sha256 does not match"):
        ckpt.verify()
    with pytest.raises(IntegrityError):
        ckpt.load_state()  # verified by default before use
