"""What every reader returns: a lazy state dict of tensor references.

A `TensorRef` knows a tensor's shape and dtype without reading it, and reads it whole
(`load`, a torch tensor) or as flat pieces (`segment`, a numpy array, then `release`) so that
a diff can stream a multi-GB tensor without holding it, and without torch for a file that
numpy can read (safetensors). `LazyStateDict` maps names to them like a state dict:
`sd["fc.weight"]` reads that tensor, `sd.info("fc.weight")` only looks.

Nothing here imports torch at import time: `ckptlab diff` of safetensors files never loads it.
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from pathlib import PurePosixPath, PureWindowsPath
from typing import TYPE_CHECKING

import numpy as np

from ckptlab import dtypes
from ckptlab.errors import CkptlabError, CorruptFileError, UnsafeFileError

if TYPE_CHECKING:
    import torch

MIN_TORCH = "2.10"  # older weights_only unpicklers have published CVEs (e.g. CVE-2025-32434)
# How far a stride-0 view (`expand`) may claim more bytes than its storage holds. Reading such a
# tensor costs its logical size, so a 1 KB file could otherwise ask for terabytes. Small
# expanded buffers stay readable; beyond this a view must be backed by its own bytes.
MAX_EXPANDED = 16 << 20


def require_safe_torch() -> None:
    """Refuse to unpickle anything with a torch whose weights_only loader is known unsafe."""
    import torch
    from torch.torch_version import TorchVersion

    if TorchVersion(torch.__version__) < MIN_TORCH:
        raise CkptlabError(
            f"torch {torch.__version__} is too old to load pickled checkpoints safely",
            hint=f"its weights_only loader has known CVEs; install torch>={MIN_TORCH}",
        )


def safe_member(folder: os.PathLike | str, name: str, *, what: str) -> str:
    """A file name that an index or metadata file points at, checked to stay in its folder:
    no absolute paths, no drive letters, no `..` (a crafted index must not read /etc/passwd)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise UnsafeFileError(f"{what} names an invalid file {name!r}", path=folder)
    for flavour in (PurePosixPath, PureWindowsPath):
        p = flavour(name)
        if p.is_absolute() or p.drive or ".." in p.parts:
            raise UnsafeFileError(f"{what} points outside its folder ({name!r})", path=folder)
    return name


def check_extent(t: torch.Tensor, *, name: str, path: os.PathLike | str) -> None:
    """CorruptFileError unless a loaded tensor is backed by its storage: every element it
    addresses lies inside the storage, and its logical size exceeds the storage's bytes (a
    stride-0 expansion) by at most MAX_EXPANDED. So reading it costs what the file holds."""
    import torch

    if t.layout != torch.strided or t.device.type == "meta":
        return
    numel = t.numel()
    if numel == 0:
        return
    itemsize = t.element_size()
    storage = t.untyped_storage().nbytes()
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    if any(s < 0 for s in t.stride()) or (last + 1) * itemsize > storage:
        raise CorruptFileError(
            f"tensor {name!r} ({list(t.shape)}, strides {list(t.stride())}) addresses bytes past its "
            f"storage of {storage} bytes",
            path=path,
        )
    logical = numel * itemsize
    if logical > storage and logical > MAX_EXPANDED:
        raise CorruptFileError(
            f"tensor {name!r} is a {logical}-byte expansion (stride 0) of {storage} stored bytes "
            f"(limit {MAX_EXPANDED}); refused: re-save it with .contiguous()",
            path=path,
        )


class TensorRef(ABC):
    """One stored tensor, before any of its data is read."""

    shape: tuple[int, ...]
    dtype: str  # its name, as torch names it without "torch.": "float32", "bfloat16" (ckptlab.dtypes)
    itemsize: int
    splittable = False  # can `segment` read a part without reading the whole?

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @abstractmethod
    def load(self) -> torch.Tensor:
        """The whole tensor, as a torch tensor (every reader implements this)."""

    def segment(self, start: int, count: int, scratch: np.ndarray | None = None) -> np.ndarray:
        """Flat elements [start, start + count) in row-major order, as a 1-D contiguous numpy
        array in the dtype's storage type (`dtypes.storage`: bfloat16 as its uint16 bits).

        `scratch` (uint8, at least count * itemsize bytes) may be used to hold the data; the
        result is then only valid until the scratch is reused.
        """
        return np.ascontiguousarray(dtypes.to_numpy(self.load())[1][start : start + count])

    def release(self, start: int, count: int) -> None:  # noqa: B027 - a no-op unless a reader maps memory
        """Done with elements [start, start + count): let their memory go (no-op by default)."""

    @property
    def identity(self) -> object:
        """Two refs with equal identity hold the same data (tied weights)."""
        return id(self)


class MemoryTensor(TensorRef):
    """A tensor already in memory (an in-memory state dict, a legacy .pt, a DCP chunk)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor.detach()
        self.shape = tuple(tensor.shape)
        self.dtype = dtypes.name_of(tensor.dtype)
        self.itemsize = tensor.element_size()
        self.splittable = tensor.is_contiguous() and tensor.device.type == "cpu"

    def load(self) -> torch.Tensor:
        return self.tensor

    def segment(self, start, count, scratch=None):
        if not self.splittable:
            return super().segment(start, count, scratch)
        return dtypes.to_numpy(self.tensor)[1][start : start + count]

    @property
    def identity(self):
        return storage_identity(self.tensor)


def storage_identity(t: torch.Tensor) -> tuple:
    """Equal for two tensors that view the same elements of the same storage."""
    if t.numel() == 0:
        return ("empty", id(t))
    return (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class LazyTensor(TensorRef):
    """A tensor that must be assembled to be read (e.g. from DCP chunks): read on `load`."""

    def __init__(self, shape, dtype: torch.dtype, loader: Callable[[], torch.Tensor]):
        self.shape = tuple(shape)
        self.dtype = dtypes.name_of(dtype)
        self.itemsize = dtype.itemsize
        self._loader = loader

    def load(self) -> torch.Tensor:
        return self._loader()


class LazyStateDict(Mapping):
    """A checkpoint's model weights as a name -> tensor mapping that reads nothing until asked.

    Tied weights are stored once: `aliases` maps each tied name to the stored name it shares
    data with (e.g. {"lm_head.weight": "wte.weight"}); both names are keys of the mapping.
    """

    def __init__(
        self,
        refs: dict[str, TensorRef],
        *,
        label: str,
        format: str,
        aliases: dict[str, str] | None = None,
        notes: list[str] | None = None,
        skipped: dict[str, str] | None = None,
        closers: list[Callable[[], None]] | None = None,
    ):
        self.refs = refs
        self.label = label  # the reference as the user gave it (RUN@STEP resolved)
        self.format = format  # "safetensors", "torch", "hf-sharded", "dcp", "ckptlab-run", "memory"
        self.aliases = {k: v for k, v in (aliases or {}).items() if v in refs and k not in refs}
        self.notes = notes or []  # what the reader decided on the way (which nested dict, ...)
        self.skipped = skipped or {}  # names that cannot be compared, and why
        self._closers = closers or []

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.info(name).load()

    def info(self, name: str) -> TensorRef:
        return self.refs[self.aliases.get(name, name)]

    def __iter__(self) -> Iterator[str]:
        yield from self.refs
        yield from self.aliases

    def __len__(self) -> int:
        return len(self.refs) + len(self.aliases)

    def __contains__(self, name: object) -> bool:
        return name in self.refs or name in self.aliases

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.refs.values())

    def close(self) -> None:
        while self._closers:
            self._closers.pop()()

    def __enter__(self) -> LazyStateDict:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"LazyStateDict({self.label!r}, format={self.format!r}, tensors={len(self.refs)}, tied={len(self.aliases)})"
        )


def split_tied(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """({name: tensor} with each storage once, {tied name: the first name of its storage})."""
    first: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[object, str] = {}
    for name, t in tensors.items():
        key = storage_identity(t)
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            first[name] = t
    return first, aliases


def expand_aliases(tensors: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """The inverse of `split_tied`: every tied name back, sharing its target's tensor."""
    full = dict(tensors)
    for name, target in aliases.items():
        full[name] = tensors[target]
    return full


def from_tensors(
    tensors: Mapping[str, torch.Tensor], *, label: str = "<memory>", format: str = "memory", notes=None
) -> LazyStateDict:
    """Wrap an in-memory state dict; names sharing storage become aliases of the first one."""
    import torch

    plain, skipped = {}, {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            continue
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            skipped[name] = f"a {t.layout if t.layout != torch.strided else t.device.type} tensor"
        else:
            plain[name] = t
    first, aliases = split_tied(plain)
    refs: dict[str, TensorRef] = {name: MemoryTensor(t) for name, t in first.items()}
    return LazyStateDict(refs, label=label, format=format, aliases=aliases, notes=notes, skipped=skipped)
