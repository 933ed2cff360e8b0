"""A torch.compile'd model for the compile tests. The backend is "aot_eager": AOTAutograd's
joint forward/backward graphs, run by eager kernels. Inductor works too, but compiling with a
C compiler takes ~20 s per graph on a CI machine; the graphs (and so the hooks, the replay and
the eager trace) are the same.
"""

from __future__ import annotations

import torch

from tests.models import MLP, step_mlp  # noqa: F401 - step_mlp is these runs' step_fn


def build_compiled():
    torch.manual_seed(0)
    model = MLP()
    return torch.compile(model, backend="aot_eager"), torch.optim.AdamW(model.parameters(), lr=1e-2)


def step_compiled(model, optimizer, batch):
    return step_mlp(model, optimizer, batch)


# The module-level name holds the compiled function: replay finds it again by that name.
step_compiled = torch.compile(step_compiled, backend="eager")
