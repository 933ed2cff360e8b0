"""A build_fn/step_fn that print every way a user's code can: `print`, `sys.stdout.write`,
`os.write(1, ...)`, C's printf, a subprocess and a DataLoader worker (which inherit fd 1).
For `--json`: none of it may reach stdout. Module level: replay imports them by name.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from torch.utils.data import DataLoader, Dataset

from tests.models import MLP, step_mlp

MARKS = (
    "noisy print in build_fn",
    "noisy sys.stdout in build_fn",
    "noisy fd1 in build_fn",
    "noisy print in step_fn",
    "noisy sys.stdout in step_fn",
    "noisy fd1 in step_fn",
    "noisy subprocess",
    "noisy worker print",
    "noisy worker fd1",
)
C_MARK = "noisy C printf"  # where the C library can be called (not Windows)

_loaders: list[DataLoader] = []  # kept: the persistent worker outlives the step (and the JSON)


class ChattyItems(Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> int:
        print(f"noisy worker print {i}", flush=True)
        os.write(1, f"noisy worker fd1 {i}\n".encode())
        return i


def chatter(where: str) -> None:
    print(f"noisy print in {where}")
    sys.stdout.write(f"noisy sys.stdout in {where}\n")
    os.write(1, f"noisy fd1 in {where}\n".encode())


def build():
    chatter("build_fn")
    try:
        import ctypes

        ctypes.CDLL(None).printf(f"{C_MARK}\n".encode())  # buffered by C when stdout is not a terminal
    except (OSError, AttributeError, TypeError):
        pass
    torch.manual_seed(0)
    model = MLP()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model, optimizer, batch):
    chatter("step_fn")
    if not _loaders:  # once per process: children are slow to start
        subprocess.run([sys.executable, "-c", "print('noisy subprocess')"], check=True)
        loader = DataLoader(
            ChattyItems(), num_workers=1, persistent_workers=True, generator=torch.Generator().manual_seed(0)
        )
        list(loader)
        _loaders.append(loader)
    return step_mlp(model, optimizer, batch)
