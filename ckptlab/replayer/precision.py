"""The precision counterfactual: a module run in float32 for one replayed step.

    with in_float32(model, "blocks.3.attn"):   # that module as if it were written in float32
        ...

The trace (trace.py) already re-runs the origin op alone in float32. This answers the user's
question one level up: keep this module (or the whole model) in float32, does the fault go
away? While the module's forward runs: autocast is off, its float16/bfloat16 parameters and
buffers are float32 copies, its floating inputs are widened, and every reduced-precision cast
or dtype its code asks for (`x.half()`, `.to(torch.bfloat16)`, `dtype=torch.float16`) gives
float32 instead. Its outputs go on in the dtype its inputs had (the rest of the model was
written for it), so a value too large for that dtype still overflows after the module: then
only a wider part (the whole model, whose outputs stay float32) helps. The backward follows
the forward's dtypes.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from ckptlab.training.crash import call_through
from ckptlab.training.wrappers import unwrap

REDUCED = (torch.float16, torch.bfloat16)
_NARROWING = {torch.Tensor.half, torch.Tensor.bfloat16}


def _widen(x):
    if isinstance(x, torch.Tensor) and x.dtype in REDUCED:
        return x.float()
    if isinstance(x, torch.dtype) and x in REDUCED:
        return torch.float32
    return x


class _Float32Only(TorchFunctionMode):
    """Reduced-precision casts and dtypes become float32 (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NARROWING:
            return args[0].float() if args[0].is_floating_point() else args[0]
        args, kwargs = tree_map(_widen_dtype, (args, kwargs))
        return call_through(func, *args, **kwargs)


def _widen_dtype(x):
    return torch.float32 if isinstance(x, torch.dtype) and x in REDUCED else x


def _tensors(tree) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map(lambda x: found.append(x) if isinstance(x, torch.Tensor) else None, tree)
    return found


@contextlib.contextmanager
def in_float32(model: torch.nn.Module, path: str):
    """Inside: `path` ("" for the whole model) runs as if written in float32. Restored after."""
    module = unwrap(model).get_submodule(path) if path else unwrap(model)
    kept = []
    for t in [*module.parameters(), *module.buffers()]:
        if t.dtype in REDUCED:
            kept.append((t, t.data))
            t.data = t.data.float()
    own = module.__dict__.get("forward")  # an instance's own forward (rare), else the class's
    # accelerate's prepare (the HF Trainer with bf16/fp16) wraps the forward in an autocast of
    # its own, which would turn reduced precision back on inside ours; it keeps the forward it
    # wrapped as `_original_forward`.
    forward = module.__dict__.get("_original_forward", module.forward)
    device = next((t.device.type for t in module.parameters()), "cpu")

    def widened(*args, **kwargs):
        narrow = next(
            (x.dtype for x in _tensors((args, kwargs)) if x.dtype in REDUCED),
            None,
        )
        with torch.autocast(device, enabled=False), _Float32Only():
            args, kwargs = tree_map(_widen, (args, kwargs))
            out = call_through(forward, *args, **kwargs)  # (the user's forward: its exception is its own)
        if narrow is None or not path:
            return out
        # A module inside a reduced-precision model hands its outputs on in the dtype it was
        # given (what follows it was written for that dtype): a value too large for it
        # overflows there, and only a wider part of the model helps.
        return tree_map(lambda x: x.to(narrow) if isinstance(x, torch.Tensor) and x.dtype == torch.float32 else x, out)

    module.forward = widened
    try:
        yield module
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own
        for t, data in kept:
            t.data = data
