"""torch's FSDP1 (`FullyShardedDataParallel`), seen as the model's own parameters.

    units(model)          # the FSDP1 modules in it, by name
    refusal(model)        # why it is not recorded (use_orig_params=False), or None
    flat_params(model)    # what autograd accumulates into (the probe's backward-end signal)
    full_shapes(model)    # id(parameter) -> its shape in the model, not its shard's

FSDP1 concatenates each unit's parameters into one flat parameter and shards that. With
`use_orig_params=True` (the default of accelerate's, Lightning's and the HF Trainer's FSDP1)
the model keeps its own parameters as views into this rank's shard (1-D, the part of each
parameter that falls in the shard, maybe empty) and sets their `.grad` to the matching views
of the reduced gradient shard when the backward pass ends: every element of a parameter is in
exactly one rank's shard, so the ranks' squared norms add up to the global one, as under
FSDP2, and the model's names are the model's own once the wrapper's `_fsdp_wrapped_module.`
is left out (training/wrappers.py `unwrap`, `own_name`). Autograd accumulates into the flat parameter, never into the views, so a hook on
a view never fires: the probe listens on the flat parameters (FSDP1 queues its own callback,
which sets the views' gradients, when the backward begins: it runs before the probe's).

With `use_orig_params=False` the model's parameters are the flat shards themselves, one per
unit, named `_flat_param`: the record could not name a layer. It is refused.

Told apart by class name and attributes (`_flat_param`, its `_params` and `_shapes`: torch's
own bookkeeping, stable since 2.0), like the other engines in training/world.py.
"""

from __future__ import annotations

import torch

from ckptlab.training.wrappers import own_name


def is_fsdp1(module: object) -> bool:
    cls = type(module)
    return cls.__name__ == "FullyShardedDataParallel" and cls.__module__.startswith("torch.distributed.fsdp")


def units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if is_fsdp1(m)]


def refusal(model: torch.nn.Module) -> str | None:
    """One line for an FSDP1 model ckptlab cannot name the parameters of, or None."""
    for name, unit in units(model):
        flat = getattr(unit, "_flat_param", None)
        if flat is not None and getattr(flat, "_params", None) is None:
            where = f"module {own_name(name)}" if own_name(name) else "the model"
            return (
                f"cannot record this model: {where} is wrapped by FSDP1 (FullyShardedDataParallel) with "
                "use_orig_params=False, whose flat parameter shards hide the model's own parameters; "
                "wrap with use_orig_params=True, or shard with FSDP2's fully_shard"
            )
    return None


def flat_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """The flat parameters of the model's FSDP1 units (none: no FSDP1)."""
    out = []
    for _, unit in units(model):
        flat = getattr(unit, "_flat_param", None)
        if flat is not None and flat.requires_grad:
            out.append(flat)
    return out


def full_shapes(model: torch.nn.Module) -> dict[int, torch.Size]:
    """id(parameter) -> the parameter's own shape, for the parameters FSDP1 holds as views
    into a shard."""
    shapes: dict[int, torch.Size] = {}
    for flat in flat_params(model):
        for p, shape in zip(getattr(flat, "_params", None) or (), flat._shapes):  # type: ignore[attr-defined]
            shapes[id(p)] = torch.Size(shape)
    return shapes
