"""A step that raised: where in the user's code, and whether it was the user's code at all.

The Recorder records a step that raised as an `exception` event; replay runs that step again
and, when it raises again, names what `describe` finds. An exception is the step's own (the
user's code, or torch under it) when, walking the traceback from the call of `step_fn`
inward, the stack leaves ckptlab and never comes back into it: ckptlab code running *under*
the user's (a hook of the probe) that raised is ckptlab's own failure, not the step's.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import types

import torch

from ckptlab.errors import CkptlabError
from ckptlab.training.wrappers import unwrap

TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
CKPTLAB_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the package
EXAMPLES_DIR = os.path.join(CKPTLAB_DIR, "examples") + os.sep  # user code, even though it ships with us
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
MAX_MESSAGE = 500
# Engines that run between the user's code and torch's ops once imported (DeepSpeed's ZeRO-3
# swaps torch.nn.functional.linear for its own `zero3_linear_wrap`): library, never the user's line.
_ENGINES = ("deepspeed",)
_engine_dirs: dict[str, str] = {}


def library(filename: str) -> bool:
    """torch's code, or an engine's that stands between the user's code and torch's ops."""
    if filename.startswith(TORCH_DIR):
        return True
    for name in _ENGINES:
        if name not in _engine_dirs and name in sys.modules:  # (imported by the user's code: look once)
            where = getattr(sys.modules[name], "__file__", None)
            _engine_dirs[name] = os.path.dirname(os.path.abspath(where)) + os.sep if where else "\0"
        if filename.startswith(_engine_dirs.get(name, "\0")):
            return True
    return False


def ours(filename: str) -> bool:
    """ckptlab's own code (not the examples, which are the user's)."""
    return filename.startswith(CKPTLAB_DIR) and not filename.startswith(EXAMPLES_DIR)


def call_through(fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, called by a ckptlab wrapper that stands between the user's code and
    the function it wraps (the probe's wrappers of torch's clipping, the per-op trace's dispatch
    modes, a closure handed on to the user's optimizer). An exception `fn` raises is the step's
    own, as it would be without the wrapper (`clip_grad_norm_(..., error_if_nonfinite=True)` on a
    NaN gradient, a shape error in the user's model while traced): `is_step_error` does not count
    this frame, nor the wrapper's that called it, as ckptlab's. An exception of the wrapper's
    own code (outside this call) stays ckptlab's."""
    return fn(*args, **kwargs)


class StageRefused(Exception):
    """A replayed step that a pipeline's stages did not run as asked: a batch whose rows do not
    split into the micro-batches the schedule's shapes were inferred for (refused on every rank
    alike, before any starts it), or another stage's own exception in a step they ran together.
    The step's own failure, as if step_fn had raised it (`is_step_error`): the experiment that
    asked for it fails, and the investigation goes on."""


def _frames(tb: types.TracebackType | None) -> list[types.FrameType]:
    out = []
    while tb is not None:
        out.append(tb.tb_frame)
        tb = tb.tb_next
    return out


def is_step_error(exc: BaseException) -> bool:
    """The exception came from the step itself (the user's code or torch under it), not from
    ckptlab: once its traceback leaves ckptlab's code it does not come back into it."""
    if isinstance(exc, CkptlabError) or not isinstance(exc, Exception):
        return False
    if isinstance(exc, StageRefused):
        return True
    frames = _frames(exc.__traceback__)
    mine = [ours(os.path.abspath(f.f_code.co_filename)) for f in frames]
    for i, f in enumerate(frames):  # a wrapper calling through to what it wraps: not ckptlab's
        if f.f_code is call_through.__code__:
            mine[i] = False
            if i:
                mine[i - 1] = False
    left = False
    for m in mine:
        if not m:
            left = True
        elif left:
            return False
    return left


def describe(exc: BaseException, model: torch.nn.Module | None = None) -> dict:
    """{"error": "Type: message", "type", "message", "source": "file.py:line" (the innermost
    frame in the user's code), "call": its function, "module": the model's submodule whose
    forward was running (by the model's own name, its wrappers unwrapped; "" the model
    itself), "phase": forward, backward or
    optimizer when the traceback tells}. Only the keys that are known."""
    message = " ".join(str(exc).split())[:MAX_MESSAGE]
    name = type(exc).__qualname__
    out: dict = {"error": f"{name}: {message}" if message else name, "type": name, "message": message}
    frames = _frames(exc.__traceback__)
    for f in reversed(frames):
        fn = os.path.abspath(f.f_code.co_filename)
        if not (ours(fn) or library(fn) or fn.startswith(_STDLIB_DIR) or fn.startswith("<")):
            out["source"] = f"{os.path.basename(fn)}:{f.f_lineno}"
            out["call"] = f.f_code.co_name
            break
    names = {id(m): n for n, m in unwrap(model).named_modules()} if model is not None else {}  # its own names
    for f in reversed(frames):
        module = f.f_locals.get("self") if f.f_code.co_name != "<module>" else None
        if isinstance(module, torch.nn.Module) and id(module) in names:
            out["module"] = names[id(module)]
            break
    codes = {f.f_code.co_name for f in frames}
    files = [os.path.abspath(f.f_code.co_filename) for f in frames]
    if any(fn.startswith(os.path.join(TORCH_DIR, "optim")) for fn in files):
        out["phase"] = "optimizer"
    elif any(fn.startswith(os.path.join(TORCH_DIR, "autograd")) for fn in files) or "backward" in codes:
        out["phase"] = "backward"
    elif "module" in out or "forward" in codes:
        out["phase"] = "forward"
    return out
