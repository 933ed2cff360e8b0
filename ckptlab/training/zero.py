"""DeepSpeed's engine with ZeRO (stages 1, 2 and 3): what ckptlab reads from it and sets in it.

    engine = engine_of(model)                    # the DeepSpeedEngine a model is or wraps, or None
    why = problem(engine)                        # what is not recorded of it (one line), or None
    grads = local_grads(engine, params)          # this rank's part of the step's averaged gradient
    weights = local_weights(engine, params)      # this rank's part of the fp32 master weights
    snap = snapshot(world, step, engine, ...)    # collective: the whole state, on rank 0
    load_whole(engine, tensors, optimizer_state, counters)   # the whole state -> this rank's parts

ZeRO gives each data-parallel rank a part of the training state: of the optimizer's state
(stage 1), of the gradients too (2), of the parameters too (3). Each rank's torch optimizer
steps flat fp32 partitions (one per parameter group), not the model's parameters, and the
reduced gradient lives in DeepSpeed's buffers from the end of the backward pass until its
optimizer's `step` has used it (`p.grad` is None by then). So:

- gradient norms: at the start of the ZeRO optimizer's step (training/grad_points.py wraps it:
  the gradients are final, averaged over the ranks, not yet clipped), each parameter's part
  on this rank. The ranks' squared norms add up to the exact global norm, as FSDP2's shards
  do (World.combine); weights are measured the same way, on the fp32 masters.
- replay's snapshots hold the whole state, gathered through DeepSpeed's own API
  (`safe_get_full_fp32_param`, `safe_get_full_optimizer_state`): the fp32 master weights
  under the model's own names, the optimizer state in torch's format for those parameters
  (what a torch optimizer over `engine.module.parameters()` would hold). `load_whole` puts
  such a state into an engine of any world size (a replay's process group of one included).
  Checkpoints are not gathered: each rank writes its own partitions (training/zero_parts.py),
  read back whole into the same form. (Runs recorded by earlier versions hold checkpoints of
  the gathered state, as model.safetensors and state.safetensors; they load as snapshots do.)

DeepSpeed is never imported here before the user has: only a model that holds an engine
(told apart by class name) reaches the functions that import it. The attributes of DeepSpeed's
optimizers read here (`bit16_groups`, `fp16_groups`, `_hp_mapping`) are those of its 0.19
series, which the `deepspeed` extra pins.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from ckptlab.errors import RecordError
from ckptlab.io.base import split_tied
from ckptlab.run import codec
from ckptlab.run.checkpoint import CapturedState
from ckptlab.training.wrappers import module_chain, unwrap

ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"
_PIPELINE = "deepspeed.runtime.pipe.engine.PipelineEngine"
# The ZeRO optimizer's handling of each gradient in the backward pass (stage 1/2, stage 3, both):
# the engine's own work, hidden from a traced replay (training/grad_points.py `install_zero`).
ENGINE_WORK = (
    "process_gradients",
    "reduce_ready_partitions_and_remove_grads",
    "update_hook_state_and_maybe_run_epilogue",
    "independent_gradient_partition_epilogue",
    "reduce_ipg_grads",
)
COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")  # the engine's own step counts


def _is(obj: Any, qualname: str) -> bool:
    return any(f"{c.__module__}.{c.__qualname__}" == qualname for c in type(obj).__mro__)


def is_deepspeed(obj: Any) -> bool:
    """A DeepSpeed object (an engine, a ZeRO optimizer, a module of its own), by class name."""
    return any(c.__module__.startswith("deepspeed.") for c in type(obj).__mro__)


def engine_of(model: Any) -> Any:
    """The DeepSpeedEngine that `model` is or wraps (through Fabric's module, say), or None."""
    if not isinstance(model, torch.nn.Module):
        return None
    return next((m for m in module_chain(model) if _is(m, ENGINE)), None)


def destroy_process_group() -> None:
    """Destroy the default process group; through DeepSpeed's comm when an engine used it, which
    forgets the groups it made in it (a clone of the world group, say): an engine built in a
    later group would use them, and fail ("Group ... is not registered")."""
    import sys

    comm = sys.modules.get("deepspeed.comm")
    if comm is not None and comm.is_initialized():
        comm.destroy_process_group()
    else:
        torch.distributed.destroy_process_group()


def stage(engine: Any) -> int:
    return int(engine.zero_optimization_stage())


def problem(engine: Any) -> str | None:
    """What ckptlab does not record of this engine, as one line naming it, or None."""
    name = type(engine).__name__
    what = None
    if _is(engine, _PIPELINE):
        what = "DeepSpeed's pipeline engine: a stage holds part of the model and sees part of each step"
    elif stage(engine) not in (1, 2, 3):
        what = "a DeepSpeed engine without ZeRO (zero_optimization stage 0)"
    elif engine.fp16_enabled() or engine.bfloat16_enabled():
        what = "a DeepSpeed engine in fp16 or bf16 (its loss scaler and low-precision copies are not recorded yet)"
    elif _offloaded(engine.zero_offload_optimizer()) or _offloaded(engine.zero_offload_param()):
        what = "a DeepSpeed engine with ZeRO-Offload (offload_optimizer, offload_param)"
    elif parts(engine.optimizer) is None or not hasattr(getattr(engine.optimizer, "optimizer", None), "param_groups"):
        what = "a DeepSpeed engine without a ZeRO optimizer (deepspeed.initialize was given none)"
    if what is None:
        return None
    return (
        f"cannot record {what} ({name}); ckptlab records DeepSpeed's ZeRO stages 1, 2 and 3 in fp32, "
        "with a torch optimizer or DeepSpeed's Adam"
    )


def _offloaded(offload: Any) -> bool:
    """An offload config that moves something (accelerate's DeepSpeedPlugin writes one with
    device "none" for each)."""
    device = getattr(offload, "device", None)
    return offload is not None and str(getattr(device, "value", device)) != "none"


def optimizer_problem(engine: Any, optimizer: Any) -> str | None:
    """The optimizer given with an engine must be the engine's ZeRO optimizer (the second value
    deepspeed.initialize returns): the one whose groups say which parameters it trains."""
    if optimizer is engine.optimizer:
        return None
    return (
        f"the optimizer given ({type(optimizer).__name__}) is not the DeepSpeed engine's "
        f"({type(engine.optimizer).__name__}): pass the optimizer deepspeed.initialize returned"
    )


def parts(optimizer: Any) -> list[tuple[torch.Tensor, int, list[torch.nn.Parameter]]] | None:
    """A ZeRO optimizer's flat partitions on this rank, each with the index of its torch
    optimizer's group that steps it and the model parameters it holds parts of (stage 1/2:
    one per group; stage 3: sub-groups of `sub_group_size` elements); None for any other
    optimizer. Stage 3 hands each partition to its torch optimizer only while it steps it."""
    if not is_deepspeed(optimizer):
        return None
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):  # stage 3
        to_group = optimizer.sub_group_to_group_id
        return [
            (flat, int(to_group[i]), list(members))
            for i, (flat, members) in enumerate(zip(optimizer.fp32_partitioned_groups_flat, optimizer.fp16_groups))
        ]
    if hasattr(optimizer, "single_partition_of_fp32_groups"):  # stages 1 and 2
        return [
            (flat, i, list(members))
            for i, (flat, members) in enumerate(zip(optimizer.single_partition_of_fp32_groups, optimizer.bit16_groups))
        ]
    return None


def model_groups(optimizer: Any) -> list[list[torch.nn.Parameter]] | None:
    """A ZeRO optimizer's groups of model parameters (its torch optimizer's group i trains the
    parameters of group i); None for any other optimizer."""
    found = parts(optimizer)
    if found is None:
        return None
    held: list[list[torch.nn.Parameter]] = [[] for _ in optimizer.optimizer.param_groups]
    for _, g, members in found:
        held[g].extend(members)
    return held


def groups(engine: Any) -> list[list[torch.nn.Parameter]]:
    """The model's parameters in each group of the engine's ZeRO optimizer."""
    held = model_groups(engine.optimizer)
    assert held is not None, "problem() refuses an engine without a ZeRO optimizer"
    return held


def managed(p: torch.Tensor) -> bool:
    """A parameter a ZeRO optimizer holds (its torch optimizer holds flat partitions instead)."""
    return hasattr(p, "_hp_mapping") or hasattr(p, "ds_id")


def shape_of(p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape; ZeRO-3 keeps its whole shape in `ds_shape` (its data is a stub)."""
    return tuple(getattr(p, "ds_shape", None) or p.shape)


# --- this rank's parts (the probe's measurements) -------------------------------------------------


def local_grads(engine: Any, params: Sequence[Any]) -> list[torch.Tensor | None]:
    """Each parameter's part of the averaged gradient on this rank (None: none here, or no
    gradient). Valid between the backward pass and the ZeRO optimizer's step."""
    if stage(engine) == 3:
        zero = engine.optimizer
        return [zero.get_local_fp32_grad_for_param(p) if p.requires_grad else None for p in params]
    out: list[torch.Tensor | None] = []
    for p in params:
        mapping = getattr(p, "_hp_mapping", None)
        try:
            out.append(None if mapping is None else mapping.get_lp_grad_fragment(p._index_in_param_group))
        except ValueError:  # ("Gradients are only available immediately after backward ...")
            out.append(None)
    return out


def local_weights(engine: Any, params: Sequence[Any]) -> list[torch.Tensor]:
    """Each parameter's part of the fp32 master weights on this rank (empty: none here)."""
    empty = torch.zeros(0)
    if stage(engine) == 3:
        zero = engine.optimizer
        parts = [zero.get_local_fp32_param(p) if p.requires_grad else None for p in params]
    else:
        parts = [m.get_hp_fragment() if (m := getattr(p, "_hp_mapping", None)) is not None else None for p in params]
    return [empty if t is None else t.detach() for t in parts]


# --- the whole state (collective) -------------------------------------------------------------


def _full(p: torch.nn.Parameter, key: str | None = None) -> torch.Tensor:
    """The whole fp32 master weight (key None) or optimizer state `key` of `p`, on every rank
    (collective: DeepSpeed's all-reduce or all-gather of the ranks' parts)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    value = safe_get_full_fp32_param(p) if key is None else safe_get_full_optimizer_state(p, key)
    if value is None:  # a frozen parameter: no master; ZeRO-3 keeps only a part of it
        with _gathered([p]):
            return p.detach().to("cpu", copy=True)
    # (DeepSpeed's result is a buffer of its own, not the live state: no copy on the CPU)
    return value.detach().to("cpu").reshape(shape_of(p))


@contextlib.contextmanager
def _gathered(params: list[torch.nn.Parameter], modifier: int | None = None):
    """ZeRO-3 parameters whole for the block (DeepSpeed's GatheredParameters; with `modifier`
    what that rank writes into them is partitioned again at the end); others as they are."""
    if not any(hasattr(p, "ds_id") for p in params):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier):
        yield


def whole_state(engine: Any, keep: bool) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(model tensors by state-dict name, the optimizer state in torch's format for the model's
    parameters, the engine's counters). Collective; with `keep` False (every rank but the one
    that writes) the parts are taken part in and dropped."""
    zero = engine.optimizer
    inner = zero.optimizer
    _link_states(zero)
    target = unwrap(engine)
    named = list(target.named_parameters())
    index = {id(p): i for i, (_, p) in enumerate(named)}
    state: dict[int, dict] = {}
    for flat, _, members in _parts(engine):
        own = inner.state.get(flat, {})
        per_element = [k for k, v in own.items() if torch.is_tensor(v) and v.shape == flat.shape]
        scalars = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in own.items() if k not in per_element}
        for p in members:
            gathered = {k: _full(p, k) for k in per_element}
            if keep and own:
                state[index[id(p)]] = {**scalars, **gathered}
    param_groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [index[id(p)] for p in members]}
        for group, members in zip(inner.param_groups, groups(engine))
    ]
    full = {}
    for _, p in named:
        whole = _full(p)  # (collective: every rank takes part; the writer alone keeps it)
        if keep:
            full[id(p)] = whole
    tensors: dict[str, torch.Tensor] = {}
    if keep:
        for name, t in target.state_dict(keep_vars=True).items():
            if isinstance(t, torch.Tensor):
                tensors[name] = full[id(t)] if id(t) in full else t.detach().to("cpu", copy=True)
    return tensors, {"state": state, "param_groups": param_groups}, counters(engine)


def check_step_boundary(engine: Any, step: int) -> None:
    """RecordError when `step` would begin inside DeepSpeed's gradient accumulation: the
    gradients accumulated so far are in no checkpoint or snapshot."""
    if _accumulating(engine):
        raise RecordError(
            f"step {step} begins inside DeepSpeed's gradient accumulation (micro-step {engine.micro_steps} of "
            f"{engine.gradient_accumulation_steps()}): the gradients accumulated so far would be lost",
            hint="run every micro-batch of an optimizer step (engine.backward and engine.step each) in one step_fn call",
        )


def counters(engine: Any) -> dict[str, int]:
    """The engine's own step counts (`COUNTERS`)."""
    return {k: int(getattr(engine, k, 0)) for k in COUNTERS}


def snapshot(world, step: int, engine: Any, train_state: dict, info: dict | None = None) -> CapturedState | None:
    """The whole training state at `step`, on rank 0 (None elsewhere); collective. `train_state`:
    the scheduler, scaler, RNG and env (training/state.py capture_train_state, no optimizer).
    Every rank's RNG states go in as `rng_by_rank`, as FSDP2's snapshots carry them."""
    check_step_boundary(engine, step)
    rngs = world.gather_objects(train_state["rng"])
    tensors, optimizer, steps = whole_state(engine, keep=world.is_main)
    if not world.is_main:
        return None
    state = {**train_state, "optimizer": optimizer, "deepspeed": steps, "rng_by_rank": rngs}
    spec, state_tensors = codec.encode(state, prefix="state")
    first, aliases = split_tied(tensors)
    captured = CapturedState(step, first, aliases, spec, state_tensors, dict(info or {}))
    captured.release()  # copies: nothing to wait for
    return captured


def _accumulating(engine: Any) -> bool:
    """Whether gradients of micro-batches before the next one wait for an optimizer step. The
    engine counts its micro-steps (one per engine.step) unless its user sets the boundary
    (accelerate, for the HF Trainer: engine.step after the last micro-batch alone): then the
    last backward said whether it was one."""
    told = getattr(engine, "_is_gradient_accumulation_boundary", None)
    if told is not None:
        return not told
    k = engine.gradient_accumulation_steps()
    return k > 1 and engine.micro_steps % k != 0


def load_whole(engine: Any, tensors: dict[str, torch.Tensor], optimizer: dict, counts: dict | None) -> None:
    """Load the whole state (`whole_state`'s) into a live engine of any world size: each rank
    takes its parts of the fp32 masters and the optimizer state, and the model's own (stage
    3: partitioned) parameters are set from the masters."""
    target = unwrap(engine)
    named = list(target.named_parameters())
    missing = sorted(set(target.state_dict()) - set(tensors))
    if missing or len(optimizer.get("param_groups", [])) != len(engine.optimizer.optimizer.param_groups):
        raise ValueError(
            f"the checkpoint does not fit this DeepSpeed engine (missing {missing[:3]}, "
            f"{len(optimizer.get('param_groups', []))} optimizer groups)"
        )
    saved = {int(k): v for k, v in optimizer.get("state", {}).items()}
    _make_state(engine, saved, optimizer["param_groups"], named)
    by_id = {id(p): i for i, (_, p) in enumerate(named)}
    for name, p in named:
        if not managed(p):
            continue
        _set_full(p, tensors[name])
        for key, value in saved.get(by_id[id(p)], {}).items():
            if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) == shape_of(p):
                _set_full(p, value, key)
    with torch.no_grad():
        for name, p in named:  # the model's copies (ZeRO-3: partitioned again on leaving the block)
            with _gathered([p], modifier=0):
                p.data.copy_(tensors[name].reshape(p.shape))
        for name, b in target.named_buffers():
            if name in tensors:
                b.copy_(tensors[name])
    for k, v in (counts or {}).items():
        if k in COUNTERS:
            setattr(engine, k, int(v))


def _set_full(p: Any, value: torch.Tensor, key: str | None = None) -> None:
    """This rank's part of `p`'s fp32 master (key None) or optimizer state `key`, from the whole
    value. ZeRO-3 parts are cut here: DeepSpeed's own whole-value setter cuts past the end of a
    parameter it padded (one of 1 element on 2 ranks: a part of 1 element each)."""
    from deepspeed.utils import (
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_optimizer_state,
    )

    if not hasattr(p, "ds_id"):
        return safe_set_full_fp32_param(p, value) if key is None else safe_set_full_optimizer_state(p, value, key)
    group = p.ds_process_group
    n, rank = p.ds_tensor.numel(), torch.distributed.get_rank(group=group)
    padded = torch.zeros(n * torch.distributed.get_world_size(group=group), dtype=value.dtype)
    padded[: value.numel()] = value.flatten()
    part = padded[n * rank : n * (rank + 1)].to(p.ds_tensor.device)
    return safe_set_local_fp32_param(p, part) if key is None else safe_set_local_optimizer_state(p, part, key)


def _make_state(engine: Any, saved: dict[int, dict], param_groups: list[dict], named: list) -> None:
    """The torch optimizer's state for this rank's flat partitions, shaped as they are here
    (zeros, and the scalars such as Adam's `step`: the saved values go in part by part after),
    or none when none was saved; its groups' hyperparameters the saved ones; then ZeRO-1/2's
    links from each parameter to its part of that state, made anew."""
    inner = engine.optimizer.optimizer
    at = {id(p): j for j, (_, p) in enumerate(named)}
    for flat, _, members in _parts(engine):
        first = saved.get(at[id(members[0])]) if members else None
        inner.state.pop(flat, None)
        if first is not None:
            shape = shape_of(members[0])
            inner.state[flat] = {
                k: torch.zeros_like(flat)
                if torch.is_tensor(v) and v.dim() > 0 and tuple(v.shape) == shape
                else v.detach().clone()
                if torch.is_tensor(v)
                else v
                for k, v in first.items()
            }
    for group, saved_group in zip(inner.param_groups, param_groups):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    _link_states(engine.optimizer)


def _link_states(zero: Any) -> None:
    """ZeRO-1/2: link each parameter to its part of the optimizer state (again), which
    `safe_get_full_optimizer_state` reads. DeepSpeed 0.19 links them once, after its first
    group's first step: the parameters of the groups after it (the Trainer's AdamW has two:
    with and without weight decay) stay linked to no state ("exp_avg not found in optimizer
    state fragment"). Before the first step there is nothing to link: DeepSpeed links them at
    its step. Stage 3 reads the state without links."""
    if not hasattr(zero, "_hp_optimizer_states_linked"):
        return
    zero._hp_optimizer_states_linked = False
    if all(zero.optimizer.state.get(flat) for flat in zero.single_partition_of_fp32_groups):
        zero._lazy_init_hp_params_optimizer_state()


def _parts(engine: Any) -> list[tuple[torch.Tensor, int, list[torch.nn.Parameter]]]:
    found = parts(engine.optimizer)
    assert found is not None, "problem() refuses an engine without a ZeRO optimizer"
    return found
