"""Steps that raise, for tests/test_replay_crash.py (module level: replay imports them by name)."""

import os

from . import models

FLAKY_ENV = "CKPTLAB_TEST_FLAKY_STEP"  # set while recording only: a crash replay cannot repeat


def step_needs_four_rows(model, optimizer, batch):
    x, y = batch
    if x.shape[0] != 4:
        raise RuntimeError(f"expected 4 rows, got {x.shape[0]}")
    return models.step_mlp(model, optimizer, batch)


def step_flaky(model, optimizer, batch):
    x, _ = batch
    if os.environ.get(FLAKY_ENV) and float(x[0, 0]) == float(os.environ[FLAKY_ENV]):
        raise OSError("transient: the NFS mount went away")
    return models.step_mlp(model, optimizer, batch)
