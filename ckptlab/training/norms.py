"""The probe's device arithmetic: batched float32 norms, non-finite counts, and a step's numbers
moved to the host without waiting for the device (training/probe.py measures with these,
training/health.py reads what they copied)."""

from __future__ import annotations

import contextlib
import functools
import operator

import torch

_IS_SPARSE = operator.attrgetter("is_sparse")
_DTYPE = operator.attrgetter("dtype")
_FLOAT32 = {torch.float32}


def batched_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """float32 L2 norm of each tensor: one batched kernel per device and dtype where possible
    (sparse gradients one by one, from their values)."""
    if not tensors:
        return []
    if any(map(_IS_SPARSE, tensors)):
        return [
            torch.linalg.vector_norm(t.coalesce().values() if t.is_sparse else t, dtype=torch.float32) for t in tensors
        ]
    # On the CPU, float32 tensors without dtype=: the same bits, ~30% less kernel time (a GPU
    # launches either way: no loop over the tensors there)
    if tensors[0].device.type == "cpu" and set(map(_DTYPE, tensors)) == _FLOAT32:
        return list(torch._foreach_norm(tensors, 2))
    return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))


def on_one_device(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors on one device (a model spread over devices): the first accelerator's."""
    first = next((t.device for t in tensors if t.device.type != "cpu"), tensors[0].device)
    return [t if t.device == first else t.to(first, non_blocking=True) for t in tensors]


def count_nonfinite(g: torch.Tensor) -> int:
    if g.is_sparse:
        g = g.coalesce().values()
    return int((~torch.isfinite(g)).sum())


def to_host(pieces: list[torch.Tensor]) -> tuple[torch.Tensor, object]:
    """A step's numbers (1-d tensors) as one float32 vector on the host, and the CUDA event after
    whose completion it may be read (None on the CPU: nothing to wait for)."""
    # Gather on the device (a loss returned as a float, or a CPU scale, moves up: never a
    # non-blocking copy down into memory that is read before it lands).
    on = on_one_device(pieces)
    first = on[0].device
    values = torch.cat([p if p.dtype == torch.float32 else p.float() for p in on])
    if first.type == "cpu":  # already where it is read (no `.cpu()` call: it would return it)
        return values, None
    if first.type != "cuda":
        return values.cpu(), None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)  # on `first`'s current stream
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(first))
    return host, event


def unseen():
    """A context in which the probe's own ops run out of sight of the user's dispatch modes
    (replay's tracer, a FlopCounterMode): what the probe measures is not the step's work, and
    where it measures (the end of a backward, or the clip) depends on what it learned of the
    loop, which two runs of one step need not share. Torch's own modes (fake tensors,
    proxies, functionalization) stay."""
    if not torch._C._len_torch_dispatch_stack():
        return contextlib.nullcontext()
    return _without_user_modes()


def out_of_sight(method):
    """`method` run in `unseen()`. With no dispatch mode on the stack (every recorded step
    but a traced replay's) it is called straight away: the probe's hooks run several times a
    step, and a context manager entered for nothing costs more than the check."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if not torch._C._len_torch_dispatch_stack():
            return method(*args, **kwargs)
        with _without_user_modes():
            return method(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def _without_user_modes():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

    stack = _get_current_dispatch_mode_stack()
    if any(getattr(mode, "is_infra_mode", lambda: True)() for mode in stack):
        yield
        return
    popped = [_pop_mode() for _ in stack]
    try:
        yield
    finally:
        for mode in reversed(popped):
            _push_mode(mode)


def scale_now(scaler) -> torch.Tensor | None:
    """The GradScaler's scale as a 0-d float32 tensor (its own, on its device: reading it
    as a float would sync), or None without an enabled scaler."""
    if scaler is None or not scaler.is_enabled():
        return None
    get = getattr(scaler, "_get_scale_async", None)
    scale = get() if get is not None else None
    if scale is None:  # not yet created (before the first scale()) or an old scaler
        return torch.tensor(float(scaler.get_scale()))
    return scale.detach().reshape(()).float().clone()
