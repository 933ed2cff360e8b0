"""DeepSpeed ZeRO checkpoints written per rank: each rank's partitions of the fp32 master
weights and of the optimizer state, through DCP, under the model's own names.

    tree, main = partition_tree(world, engine)     # this rank's parts, as DCP's state dict
    optimizer = torch_format(engine, optim)        # a name-keyed optimizer state -> zero.load_whole's

A ZeRO optimizer's flat fp32 partition on a rank holds, of each parameter it touches, one
contiguous range of that parameter's elements in row-major order: stages 1 and 2 cut each
group's parameters, laid end to end, into equal parts; stage 3 cuts each parameter into equal
parts, the last one padded (training/zero.py). A range of a row-major tensor is a few boxes (a
partial row, whole rows, a partial row; recursively, inside a row), and DCP stores a tensor as
boxes ("chunks", each with its offsets in the whole tensor) written by whichever rank holds
them. So each rank's ranges go into DCP as a ShardedTensor of those boxes, views of its
partitions (DCP's staging copies them), with the parameter's whole shape. The folder is then
an ordinary DCP checkpoint of the model's state dict and the optimizer's state keyed by
parameter name, as FSDP2's are: `diff RUN@S`, rollback and the exports read it whole as any
sharded checkpoint (run/checkpoint.py `Checkpoint.load_sharded`), and `torch_format` with
training/zero.py `load_whole` puts that whole state into an engine of any world size (a replay
on the recorded world size, or in a process group of one).

Nothing is gathered: each rank writes what it holds (1/world of the weights and optimizer
state), as FSDP2's ranks do. Buffers and frozen parameters, whole on every rank under stages 1
and 2, go in as plain tensors (DCP writes each once); ZeRO-3 partitions frozen parameters too,
which are gathered for the write (they are few, and have no optimizer state).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

from ckptlab.training.wrappers import unwrap
from ckptlab.training.zero import _gathered, _parts, groups, managed, shape_of, stage

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in the whole tensor


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The boxes that make up elements start..stop-1 of a row-major tensor of `shape`, in that
    order; each box is one contiguous run of those elements."""
    if start >= stop:
        return []
    if not shape:  # (a 0-dim tensor: its one element)
        return [((), ())]
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row
    inner = shape[1:]
    if first == last:  # inside one row
        return [((first, *o), (1, *s)) for o, s in boxes(inner, start - first * row, stop - first * row)]
    out: list[Box] = []
    lo, hi = first, last + 1
    if start % row:  # the end of a partial first row
        out += [((first, *o), (1, *s)) for o, s in boxes(inner, start % row, row)]
        lo += 1
    if stop % row:
        hi -= 1
    if hi > lo:  # whole rows
        out.append(((lo, *(0,) * len(inner)), (hi - lo, *inner)))
    if stop % row:  # the start of a partial last row
        out += [((last, *o), (1, *s)) for o, s in boxes(inner, 0, stop % row)]
    return out


def fragments(engine: Any) -> dict[int, list[tuple[int, int, int, int]]]:
    """This rank's ranges of each parameter it holds a part of: id(parameter) -> [(index of its
    flat partition in training/zero.py `parts`, where the range starts in that partition,
    where in the parameter's elements, how many elements)]."""
    zero = engine.optimizer
    found: dict[int, list[tuple[int, int, int, int]]] = {}
    if stage(engine) == 3:  # each parameter cut into equal parts (`partition_numel`), the last padded
        for p in unwrap(engine).parameters():
            if not p.requires_grad or not hasattr(p, "ds_id"):
                continue
            flat, offset, n = zero.grad_position[zero.get_param_id(p)]
            whole: int = getattr(p, "ds_numel")  # noqa: B009 - (DeepSpeed's attributes: no stubs)
            start = torch.distributed.get_rank(group=getattr(p, "ds_process_group")) * n  # noqa: B009
            if whole > start:
                found[id(p)] = [(int(flat), int(offset), start, min(n, whole - start))]
        return found
    for index, (_, _, members) in enumerate(_parts(engine)):  # stages 1, 2: DeepSpeed's own mapping
        for p in members:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is not None and mapping.lp_fragment_address.numel:
                lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
                found.setdefault(id(p), []).append((index, int(hp.start), int(lp.start), int(lp.numel)))
    return found


def _sharded(shape: tuple[int, ...], pieces: list[tuple[int, torch.Tensor]], everyone: list, copy: bool) -> Any:
    """A ShardedTensor of `shape` whose local shards are this rank's ranges (where each starts
    in the whole tensor's elements, its flat values) cut into boxes, copies of them with
    `copy`; `everyone`: every rank's ranges, (rank, start, numel), which together cover it."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    rank = torch.distributed.get_rank()
    shards = []
    for start, values in pieces:
        at = 0
        for offsets, sizes in boxes(shape, start, start + values.numel()):
            n = math.prod(sizes)
            where = ShardMetadata(list(offsets), list(sizes), f"rank:{rank}/cpu")
            box = values.detach()[at : at + n].view(sizes)
            shards.append(Shard(box.clone() if copy else box, where))
            at += n
    every = [
        ShardMetadata(list(offsets), list(sizes), f"rank:{r}/cpu")
        for r, start, numel in everyone
        for offsets, sizes in boxes(shape, start, start + numel)
    ]
    meta = ShardedTensorMetadata(every, torch.Size(shape), TensorProperties(dtype=pieces[0][1].dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)


_EVERYONE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _ranges(world, engine: Any) -> tuple[dict, dict[int, list]]:
    """(this rank's `fragments`, every rank's ranges of each parameter: id -> [(rank, start,
    numel)]). The ranks' ranges are gathered once per engine (collective, that first time):
    ZeRO partitions the parameters when the engine is built, for good."""
    mine = fragments(engine)
    if engine not in _EVERYONE:
        order = {id(p): i for i, p in enumerate(unwrap(engine).parameters())}
        ranks = world.gather_objects({order[k]: [(s, n) for _, _, s, n in v] for k, v in mine.items()})
        params = list(unwrap(engine).parameters())
        _EVERYONE[engine] = {
            id(params[i]): [(r, s, n) for r, got in enumerate(ranks) for s, n in got.get(i, [])]
            for i in range(len(params))
        }
    return mine, _EVERYONE[engine]


def partition_tree(world, engine: Any, *, copy: bool = True) -> tuple[dict, dict]:
    """(DCP's state dict of this rank's parts: {"model": {name: ...}, "optim": {"state":
    {name: {key: ...}}}}, what rank 0 puts in the main state file: the optimizer's
    `param_groups` with parameter names, and `optimizer_scalars`). With `copy`, the tree is a
    copy of this rank's parts (1/world of the state: what a background write needs); else
    views of the live state, to be written before the next step. Each box is copied on its
    own: DCP's staging (`async_save`) deep-copies a ShardedTensor's shards, and a view's deep
    copy is its whole storage, the flat partition, once per shard (ZeRO-3 on the 25M-parameter
    MLP of scripts/bench_sharded_ckpt.py: 18 s). Collective: every rank calls it at once."""
    inner = engine.optimizer.optimizer
    target = unwrap(engine)
    flats = [flat for flat, _, _ in _parts(engine)]
    ranges, everyone = _ranges(world, engine)
    model: dict[str, Any] = {}
    for name, t in target.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            continue
        if managed(t) and t.requires_grad:
            if id(t) in ranges:  # (a rank may hold no part of a small parameter)
                mine = [(s, flats[f].narrow(0, o, n)) for f, o, s, n in ranges[id(t)]]
                model[name] = _sharded(shape_of(t), mine, everyone[id(t)], copy)
        else:  # a buffer or a frozen parameter: whole (ZeRO-3's, gathered on every rank)
            with _gathered([t] if isinstance(t, torch.nn.Parameter) else []):
                model[name] = t.detach().to("cpu", copy=True)
    names = {id(p): name for name, p in target.named_parameters()}
    state, scalars = _optimizer_state(engine, ranges, everyone, names, copy)
    param_groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in members]}
        for group, members in zip(inner.param_groups, groups(engine))
    ]
    every: dict[str, dict] = {}
    for part in world.gather_objects(scalars):
        every.update(part)
    return {"model": model, "optim": {"state": state}}, {"param_groups": param_groups, "optimizer_scalars": every}


def _optimizer_state(engine: Any, ranges: dict, everyone: dict, names: dict, copy: bool) -> tuple[dict, dict]:
    """(this rank's optimizer state for DCP: {name: {key: its ranges, or a 0-dim tensor}}, the
    state's other values, {name: {key: value}}: FusedAdam's `step` is a Python int, which DCP
    would pickle, and which ckptlab reads only from its own state file)."""
    inner = engine.optimizer.optimizer
    flats = [flat for flat, _, _ in _parts(engine)]
    target = unwrap(engine)
    state: dict[str, dict] = {}
    scalars: dict[str, dict] = {}
    for p_id, found in ranges.items():
        flat = flats[found[0][0]]
        name = names[p_id]
        for key, value in inner.state.get(flat, {}).items():
            if torch.is_tensor(value) and value.shape == flat.shape:  # per element: this rank's ranges
                mine = [(s, inner.state[flats[f]][key].narrow(0, o, n)) for f, o, s, n in found]
                shape = shape_of(target.get_parameter(name))
                state.setdefault(name, {})[key] = _sharded(shape, mine, everyone[p_id], copy)
            elif torch.is_tensor(value):  # a scalar of the partition (AdamW's `step`): the same on every rank
                state.setdefault(name, {})[key] = value.detach().clone()
            else:
                scalars.setdefault(name, {})[key] = value
    return state, scalars


def torch_format(engine: Any, optimizer: dict) -> dict:
    """A name-keyed optimizer state (`Checkpoint.load_sharded`'s) in torch's format for the
    model's parameters, keyed by their index in `named_parameters()`: training/zero.py's."""
    index = {name: i for i, (name, _) in enumerate(unwrap(engine).named_parameters())}
    return {
        "state": {index[name]: value for name, value in optimizer.get("state", {}).items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in optimizer["param_groups"]],
    }
