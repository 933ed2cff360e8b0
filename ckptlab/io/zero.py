"""DeepSpeed ZeRO checkpoint folders (`engine.save_checkpoint(dir)`), read in one process.

    dir/latest                                       the last tag saved ("global_step500")
    dir/<tag>/mp_rank_00_model_states.pt             stages 1/2: the module's state dict, param_shapes
    dir/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt   stage 3: one per rank (stub parameters,
                                                     the rank's parts of the frozen ones)
    dir/<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt   each rank's flat fp32 partitions

The weights read are the fp32 masters, gathered from every rank's partitions as DeepSpeed's
`zero_to_fp32` gathers them (stages 1/2: each group's partitions end to end, the parameters in
order with their alignment padding; stage 3: each parameter cut into equal parts, the last
padded), plus the module's buffers and its frozen parameters (stages 1/2: whole in the module's
state dict; stage 3: gathered from every rank's `frozen_param_fragments`). Every file goes
through torch.load(weights_only=True): the optimizer files also hold three small DeepSpeed
objects (its loss scaler, its stage enum, a fragment address), which weights_only's allowlist
builds as inert stand-ins of ckptlab's (`STAND_INS`), never as DeepSpeed's classes: nothing in
a file runs. Model-parallel checkpoints (mp_rank_01 and up) are not read.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from ckptlab.errors import CorruptFileError, UnknownFormatError
from ckptlab.io.base import LazyTensor, MemoryTensor, TensorRef, check_extent
from ckptlab.io.files import open_regular
from ckptlab.io.torch_file import load_pickled

OPTIM = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
MODEL = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")


class DeepSpeedObject:
    """What an object of DeepSpeed's in an optimizer file is built as: its fields, no behaviour."""


STAND_INS = (
    (DeepSpeedObject, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DeepSpeedObject, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (DeepSpeedObject, "deepspeed.utils.tensor_fragment.fragment_address"),
    (int, "deepspeed.runtime.zero.config.ZeroStageEnum"),  # (an IntEnum: its value)
)


def find_zero(path: Path) -> Path | None:
    """The tag folder of a DeepSpeed checkpoint at `path`: the folder itself when it holds the
    ranks' optimizer files, or the one its `latest` file names; None when neither."""
    if any(OPTIM.fullmatch(p.name) for p in path.iterdir()):
        return path
    latest = path / "latest"
    if not latest.is_file():
        return None
    with open_regular(latest) as f:
        tag = f.read(256).decode("utf-8", "replace").strip()
    folder = path / tag
    if not tag or "/" in tag or tag in (".", "..") or not folder.is_dir():
        raise CorruptFileError(f"its `latest` file names {tag!r}, which is no folder here", path=path)
    return folder if any(OPTIM.fullmatch(p.name) for p in folder.iterdir()) else None


def open_zero(folder: Path) -> tuple[dict[str, TensorRef], list[str]]:
    """(refs, notes): the fp32 master weights, the frozen parameters and the buffers of a ZeRO
    checkpoint."""
    optim_files = _by_rank(folder, OPTIM)
    model_files = sorted(p for p in folder.iterdir() if MODEL.fullmatch(p.name))
    if not model_files:
        raise CorruptFileError("a DeepSpeed checkpoint without its *_model_states.pt file", path=folder)
    model, notes = load_pickled(_regular(model_files[0]))
    states = []
    for path in optim_files:
        obj, more = load_pickled(_regular(path), STAND_INS)
        notes += more
        states.append(_field(obj, "optimizer_state_dict", dict, path))
    stage = _field(states[0], "zero_stage", int, optim_files[0])
    shapes = _param_shapes(model, model_files[0])
    if stage in (1, 2):
        refs = _stage12(folder, states, shapes)
    elif stage == 3:
        refs = _stage3(folder, states, shapes)
    else:
        raise UnknownFormatError(
            f"a DeepSpeed checkpoint of ZeRO stage {stage}, which ckptlab does not read", path=folder
        )
    module = model.get("module") if isinstance(model.get("module"), dict) else {}
    if stage == 3:
        refs.update(_frozen3(folder, model, model_files[0], refs, len(states), notes))
    for name, t in module.items():
        if name in refs or not isinstance(t, torch.Tensor):
            continue
        check_extent(t, name=name, path=model_files[0])
        refs[name] = MemoryTensor(t)  # buffers, and the frozen parameters of stages 1/2 (whole)
    notes.append(
        f"DeepSpeed ZeRO-{stage} checkpoint: fp32 master weights gathered from {len(states)} ranks' partitions"
    )
    return refs, notes


def _frozen3(
    folder: Path, first: Any, first_path: Path, trained: dict, world: int, notes: list[str]
) -> dict[str, TensorRef]:
    """A ZeRO-3 checkpoint's frozen parameters (`frozen_param_shapes` in rank 0's model file,
    `first`): each cut into `world` equal parts, the last padded, rank r's part in its own model
    file's `frozen_param_fragments`."""
    shapes = first.get("frozen_param_shapes") if isinstance(first, dict) else None
    if shapes is None:
        return {}
    if not isinstance(shapes, dict):
        raise CorruptFileError("frozen_param_shapes is not a {name: shape} map", path=first_path)
    if not shapes:
        return {}
    files = _by_rank(folder, MODEL, "model")
    if len(files) != world:
        raise CorruptFileError(f"{len(files)} ranks' model files for {world} ranks' optimizer files", path=folder)
    fragments = []
    for path in files:
        obj = first
        if path != first_path:
            obj, more = load_pickled(_regular(path))
            notes += more
        fragments.append(_field(obj, "frozen_param_fragments", dict, path))
    refs: dict[str, TensorRef] = {}
    for name, shape in shapes.items():
        dims = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else None
        if (
            not isinstance(name, str)
            or name in trained
            or dims is None
            or not all(isinstance(d, int) and d >= 0 for d in dims)
        ):
            raise CorruptFileError(f"frozen_param_shapes holds a malformed entry for {name!r}", path=first_path)
        numel = math.prod(dims)
        part = math.ceil(numel / world)
        parts = [
            _flat(f.get(name), f"rank {r}'s part of the frozen {name!r}", files[r]) for r, f in enumerate(fragments)
        ]
        if any(p.numel() != part or p.dtype != parts[0].dtype for p in parts):
            raise CorruptFileError(
                f"the ranks' parts of the frozen {name!r} do not make its shape {list(dims)}", path=folder
            )
        refs[name] = LazyTensor(dims, parts[0].dtype, _gathered(parts, 0, part, numel, dims))
    return refs


def _regular(path: Path) -> Path:
    """`path`, checked to be a regular file before torch.load opens it (a FIFO would hang it)."""
    with open_regular(path):
        return path


def _by_rank(folder: Path, pattern: re.Pattern, kind: str = "optimizer") -> list[Path]:
    found: dict[int, Path] = {}
    for p in folder.iterdir():
        m = pattern.fullmatch(p.name)
        if m is None or m.group(1) is None:
            continue
        if int(m.group(2)) != 0:
            raise UnknownFormatError(
                f"a model-parallel DeepSpeed checkpoint ({p.name}): ckptlab reads data-parallel ZeRO ones (mp_rank_00)",
                path=folder,
            )
        found[int(m.group(1))] = p
    if sorted(found) != list(range(len(found))):
        raise CorruptFileError(f"the ranks' {kind} files are {sorted(found)}: some are missing", path=folder)
    return [found[r] for r in range(len(found))]


def _field(obj: Any, key: str, kind: type, path: Path) -> Any:
    value = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise CorruptFileError(f"not a DeepSpeed ZeRO checkpoint file: no {key} ({kind.__name__})", path=path)
    return value


def _param_shapes(model: Any, path: Path) -> list[dict[str, tuple[int, ...]]]:
    """The trainable parameters' names and shapes, group by group, in the partitions' order."""
    groups = _field(model, "param_shapes", list, path)
    out = []
    for group in groups:
        if not isinstance(group, dict):
            raise CorruptFileError("param_shapes is not a list of {name: shape}", path=path)
        shapes = {}
        for name, shape in group.items():
            dims = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else None
            if not isinstance(name, str) or dims is None or not all(isinstance(d, int) and d >= 0 for d in dims):
                raise CorruptFileError(f"param_shapes holds a malformed entry for {name!r}", path=path)
            shapes[name] = dims
        out.append(shapes)
    return out


def _flat(value: Any, what: str, path: Path) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or not value.dtype.is_floating_point:
        raise CorruptFileError(f"{what} is not a flat floating tensor", path=path)
    check_extent(value, name=what, path=path)
    return value


def _stage12(folder: Path, states: list[dict], shapes: list[dict]) -> dict[str, TensorRef]:
    """Each group's partitions end to end (rank 0's first); its parameters in order, each
    followed by its alignment padding when the checkpoint records it."""
    refs: dict[str, TensorRef] = {}
    for g, group in enumerate(shapes):
        parts = []
        for r, st in enumerate(states):
            flats = _field(st, "single_partition_of_fp32_groups", list, folder)
            if g >= len(flats):
                raise CorruptFileError(f"rank {r}'s optimizer file has no partition of group {g}", path=folder)
            parts.append(_flat(flats[g], f"rank {r}'s partition of group {g}", folder))
        paddings = states[0].get("param_alignment_paddings")
        pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) else [0] * len(group)
        available = sum(p.numel() for p in parts)
        offset = 0
        for (name, shape), pad in zip(group.items(), pads):
            numel = math.prod(shape)
            if not isinstance(pad, int) or offset + numel > available:
                raise CorruptFileError(f"the partitions of group {g} do not hold {name!r}", path=folder)
            refs[name] = LazyTensor(shape, parts[0].dtype, _joined(parts, offset, numel, shape))
            offset += numel + pad
    return refs


def _stage3(folder: Path, states: list[dict], shapes: list[dict]) -> dict[str, TensorRef]:
    """Each rank's sub-groups end to end; each parameter cut into `world` equal parts (the
    last padded), its part at the same offset in every rank's."""
    world = len(states)
    flats = []
    for r, st in enumerate(states):
        groups = [_flat(t, f"rank {r}'s fp32 partition", folder) for t in _field(st, "fp32_flat_groups", list, folder)]
        flats.append(groups[0] if len(groups) == 1 else torch.cat(groups))
    refs: dict[str, TensorRef] = {}
    offset = 0
    for group in shapes:
        for name, shape in group.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            if any(offset + part > f.numel() for f in flats):
                raise CorruptFileError(f"the ranks' partitions do not hold {name!r}", path=folder)
            refs[name] = LazyTensor(shape, flats[0].dtype, _gathered(flats, offset, part, numel, shape))
            offset += part
    return refs


def _joined(parts: list[torch.Tensor], offset: int, numel: int, shape: tuple[int, ...]):
    """The elements offset..offset+numel of the partitions laid end to end (reading only the
    ranks' partitions that hold some of them)."""

    def load() -> torch.Tensor:
        pieces, start = [], 0
        for part in parts:
            lo, hi = max(offset, start), min(offset + numel, start + part.numel())
            if lo < hi:
                pieces.append(part.narrow(0, lo - start, hi - lo))
            start += part.numel()
        return torch.cat(pieces).reshape(shape) if pieces else torch.empty(shape, dtype=parts[0].dtype)

    return load


def _gathered(flats: list[torch.Tensor], offset: int, part: int, numel: int, shape: tuple[int, ...]):
    def load() -> torch.Tensor:
        return torch.cat([f.narrow(0, offset, part) for f in flats]).narrow(0, 0, numel).reshape(shape).clone()

    return load
