"""Where torch is about to change the gradients: the points at which the probe (probe.py)
takes a step's pre-clip gradient norms, with no call from the user's loop.

    grad_points.install()            # once per process (the probe's constructor calls it)
    grad_points.enter(probe)         # a probe inside a step: measured before a change
    grad_points.leave(probe)         # its step ended (or failed, or the probe closed)

Torch's clipping functions (`clip_grad_norm_`, `clip_grad_value_`, `get_total_norm`,
`clip_grads_with_norm_`) all start by grouping the tensors with a helper that they look up in
their own module at call time; wrapping that name catches them however the user imported them
(`from torch.nn.utils import clip_grad_norm_` before ckptlab included). `GradScaler.unscale_`
and `zero_grad` (of an optimizer or a module: a loop that drops a bad step) are wrapped on
their classes. Each wrapper costs one truthiness test of `LIVE` outside a step (a plain list:
a WeakSet's Python-level methods cost tens of microseconds a step, right after its compute).

`clip_grad_norm_` also reuses the probe's norms: its total is the norm of the per-tensor
norms, which are the very numbers the probe has just taken (the same kernel on the same
unchanged tensors: the same bits), so on the CPU with float32 gradients it stacks the probe's
instead of computing them again. Anywhere else (another dtype or device, several groups, a
gradient the probe did not measure or that changed since) torch's own code runs. Where torch's
internals differ from what is wrapped here, nothing is wrapped: the probe's note of the
gradients then keeps its numbers right, at the cost of measuring every backward.
"""

from __future__ import annotations

import functools
import operator

import torch

from ckptlab.training.crash import call_through
from ckptlab.training.norms import out_of_sight

_PLAIN, _FLOAT32 = {torch.Tensor}, {torch.float32}
_DTYPE, _IS_CPU = operator.attrgetter("dtype"), operator.attrgetter("is_cpu")

LIVE: list = []  # probes inside a step (one per recorded model: `enter` to `leave`)
_MARK = "__ckptlab_measures__"


def enter(probe) -> None:
    """`probe`'s step began: it measures before torch changes the gradients."""
    if not any(p is probe for p in LIVE):
        LIVE.append(probe)


def leave(probe) -> None:
    """`probe`'s step ended, failed, or the probe was closed."""
    for i, p in enumerate(LIVE):
        if p is probe:
            del LIVE[i]
            return


def before_grads_change() -> None:
    """Torch is about to clip, unscale or zero gradients: every live probe measures them first."""
    for probe in LIVE:
        if probe._note is not None:  # (else nothing to measure: skip the call)
            probe._measure_point()


def _measuring_first(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if LIVE:
            before_grads_change()
        return call_through(fn, *args, **kwargs)

    setattr(wrapper, _MARK, True)
    return wrapper


def _total_norm_reusing(fn):
    """`clip_grad._get_total_norm`, reusing the live probe's norms where they are the same bits."""

    @functools.wraps(fn)
    def wrapper(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        if LIVE and foreach is not False and float(norm_type) == 2.0 and isinstance(tensors, (list, tuple)):
            before_grads_change()
            for probe in LIVE:
                norms = reusable_norms(probe.measured, tensors)
                if norms is not None:
                    with torch.no_grad():
                        total = torch.linalg.vector_norm(norms, 2.0)
                    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
                        return call_through(fn, tensors, norm_type, error_if_nonfinite, foreach)  # torch's own error
                    return total
        return call_through(fn, tensors, norm_type, error_if_nonfinite, foreach)

    setattr(wrapper, _MARK, True)
    return wrapper


def reusable_norms(measured, tensors) -> torch.Tensor | None:
    """A probe's norms (`measured`: the gradients it just measured, their versions, their
    norms, and those stacked) of exactly `tensors` (any order), unchanged since, on the CPU
    in float32, as one vector: what `clip_grad_norm_` would stack, the same bits. None when
    anything differs."""
    if measured is None or len(tensors) != len(measured[0]) or not tensors:
        return None
    grads, versions, norms, stacked = measured
    device = grads[0].device
    if device.type != "cpu":
        return None
    if (  # the usual case, in a few calls: the very tensors measured, in order, unchanged
        all(map(operator.is_, tensors, grads))
        and [t._version for t in tensors] == versions
        and set(map(type, tensors)) == _PLAIN
        and set(map(_DTYPE, tensors)) == _FLOAT32
        and all(map(_IS_CPU, tensors))
    ):
        return stacked
    at = {id(g): k for k, g in enumerate(grads)}
    order = []
    for t in tensors:
        k = at.get(id(t))
        if k is None or grads[k] is not t or t._version != versions[k]:
            return None
        if type(t) is not torch.Tensor or t.dtype != torch.float32 or t.device != device:
            return None
        order.append(k)
    if order == list(range(len(grads))):  # (the usual order: the vector the probe stacked)
        return stacked
    return torch.stack([norms[k] for k in order])


@functools.cache
def install() -> None:
    """Wrap the points above, once per process."""
    from torch.nn.utils import clip_grad

    for name, wrap in (
        ("_group_tensors_by_device_and_dtype", _measuring_first),
        ("_get_total_norm", _total_norm_reusing),
    ):
        fn = getattr(clip_grad, name, None)
        if callable(fn) and not getattr(fn, _MARK, False):
            setattr(clip_grad, name, wrap(fn))
    for cls, name in (
        (getattr(torch.amp, "GradScaler", None), "unscale_"),
        (torch.optim.Optimizer, "zero_grad"),
        (torch.nn.Module, "zero_grad"),
    ):
        method = getattr(cls, name, None)
        if callable(method) and not getattr(method, _MARK, False):
            setattr(cls, name, _measuring_first(method))


def install_zero(cls: type) -> None:
    """A DeepSpeed ZeRO optimizer's class (training/zero.py `ENGINE_WORK`). Its `step` begins
    with the step's final gradients, averaged over the ranks and not yet clipped, in DeepSpeed's
    buffers (gone when it ends): the live probe on its engine measures them there
    (`before_zero_step`). Its handling of each gradient (copied into a bucket of
    `reduce_bucket_size` elements, 5e8 by default, and reduced) is the engine's work, as DDP's
    reducer's is: a traced replay does not see it (out_of_sight), where it would summarize the
    whole bucket at every copy into it."""
    from ckptlab.training.zero import ENGINE_WORK

    method = getattr(cls, "step", None)
    if callable(method) and not getattr(method, _MARK, False):

        @functools.wraps(method)
        def step(self, *args, **kwargs):
            for probe in LIVE:
                probe.before_zero_step(self)
            return call_through(method, self, *args, **kwargs)

        setattr(step, _MARK, True)
        setattr(cls, "step", step)  # noqa: B010 - (a class attribute, for every instance)
    for name in ENGINE_WORK:
        work = getattr(cls, name, None)
        if callable(work) and not getattr(work, _MARK, False):
            hidden = out_of_sight(work)
            setattr(hidden, _MARK, True)
            setattr(cls, name, hidden)
