"""The recording process that tests/run/test_crash.py kills, and the batches it records.

    python -c "from tests.run import crash_worker; crash_worker.zygote()"

The zygote imports torch and ckptlab once (running no torch ops), then forks one recording
child per command, so each of the test's many kills costs a fork, not an interpreter start.

    stdin  (test -> zygote):  "go RUN_DIR SEED SITE"
    stdout (zygote, child):   "pid P" | "ready N" (first step of the session) |
                              "step N" (rec.step() for step N has returned) | "exit STATUS"

A child records up to STEPS steps into RUN_DIR (resuming it when it exists) and dies by
SIGKILL at a place chosen by SITE: "timer" (the test kills it from outside at a random
instant) or a site inside a write (see `_arm`), where it writes a random prefix of the bytes
it was about to write and then kills itself -- the exact state a kill during that write
leaves. "step N" is written only after `rec.step()` returned: those are the steps the test
holds the run to.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import traceback
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
import torch.nn as nn
import torch.nn.functional as F

from ckptlab.record import Recorder
from ckptlab.run import checkpoint, framelog, retention

STEPS = 14
CKPT_EVERY = 4
KEEP_LAST = 2
B, D = 64, 512  # a batch is ~0.2 MB; the model + AdamW state ~19 MB per checkpoint
SITES = ("timer", "batch-frame", "journal-frame", "ckpt-file", "ckpt-fsync", "ckpt-rename", "retention")


# --- what is recorded: deterministic in the step number, so the test can regenerate it ---------


def make_batch(step: int):
    """(batch, sample_ids) of step `step`: a nested batch of many dtypes, derived from `step` only."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(B, D, generator=g)
    y = torch.randn(B, 1, generator=g)
    batch = {
        "x": x,
        "y": y,
        "tokens": torch.randint(0, 50_000, (B, 32), generator=g),
        "mask": x[:, :8] > 0,
        "half": x[:4, :6].to(torch.bfloat16).t(),  # transposed view
        "names": np.array([f"doc-{step}-{i}" for i in range(3)]),
        "meta": (step, f"step {step}", None, 0.5),
    }
    return batch, [step * 1000 + r for r in range(B)]


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(model, optimizer, batch):
    loss = F.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


# --- the child -----------------------------------------------------------------------------


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(site: str, rng: random.Random) -> None:
    """Make the k-th occurrence of `site` (k random) die half-way through it."""
    if site == "timer":
        return
    seen = [0]
    k = rng.randint(1, STEPS + 4 if site.endswith("-frame") else 5)

    def due() -> bool:
        seen[0] += 1
        return seen[0] == k

    if site in ("batch-frame", "journal-frame"):
        folder = "batches" if site == "batch-frame" else "journal"
        write_all = framelog.FrameWriter._write_all

        def torn_write(self, data):  # also covers a segment's 16-byte file header
            if folder in self.path.parts and due():
                os.write(self._fd, bytes(data[: rng.randrange(len(data))]))
                _die()
            write_all(self, data)

        framelog.FrameWriter._write_all = torn_write
    elif site == "ckpt-file":  # a torn model/state file, or a torn COMMIT.json
        save_file = safetensors.torch.save_file

        def torn_save(tensors, filename, metadata=None):
            if due():
                data = safetensors.torch.save(tensors, metadata=metadata)
                Path(filename).write_bytes(data[: rng.randrange(len(data))])
                _die()
            save_file(tensors, filename, metadata=metadata)

        write_synced = checkpoint.write_synced

        def torn_commit(path, data):
            if due():
                Path(path).write_bytes(data[: rng.randrange(len(data))])
                _die()
            write_synced(path, data)

        safetensors.torch.save_file = torn_save
        checkpoint.write_synced = torn_commit
    elif site == "ckpt-fsync":  # before fsync of: model, state, the temp folder (checkpoints/'s: ckpt-rename, after)
        fsync_path = checkpoint.fsync_path

        def dying_fsync(path):
            if due():
                _die()
            fsync_path(path)

        checkpoint.fsync_path = dying_fsync
    elif site == "ckpt-rename":  # just before or just after the commit's rename
        rename = os.rename
        after = rng.random() < 0.5

        def dying_rename(src, dst, *a, **kw):
            if ".tmp-" in os.fspath(src) and due():
                if after:
                    rename(src, dst, *a, **kw)
                _die()
            rename(src, dst, *a, **kw)

        os.rename = dying_rename
    elif site == "retention":  # half-way through deleting a checkpoint folder

        def dying_retire(path):
            if due():
                doomed = path.with_name(f".deleting-{path.name}-0")
                os.rename(path, doomed)
                next(p for p in doomed.iterdir()).unlink()
                _die()
            return retire(path)

        retire = retention.retire_checkpoint
        retention.retire_checkpoint = dying_retire
    else:
        raise ValueError(site)


def _child(run_dir: str, seed: int, site: str) -> None:
    _arm(site, random.Random(seed))
    model, opt = build()
    rec = Recorder(
        run_dir, model, opt, step_fn=step, build_fn=build, ckpt_every=CKPT_EVERY, keep_last=KEEP_LAST, resume=True
    )
    _say(f"ready {rec.next_step}")
    for _ in range(STEPS):
        n = rec.next_step
        rec.step(*make_batch(n))
        _say(f"step {n}")
    rec.close()


def zygote() -> None:
    import torch._dynamo  # noqa: F401 - what a first optimizer pulls in (~1 s); an import, no ops

    for line in sys.stdin:
        _, run_dir, seed, site = line.split()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _child(run_dir, int(seed), site)
            except BaseException:  # noqa: BLE001 - a real failure: show it, exit non-zero
                traceback.print_exc()
                code = 3
            finally:
                sys.stderr.flush()
                os._exit(code)
        _say(f"pid {pid}")
        _, status = os.waitpid(pid, 0)
        _say(f"exit {status}")
