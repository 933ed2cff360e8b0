"""Hugging Face sharded checkpoints: a folder with `model.safetensors.index.json` (or
`pytorch_model.bin.index.json`) whose "weight_map" names the shard holding each tensor.

    {"metadata": {"total_size": 123}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors", ...}}

Shard names come from a file anyone can edit, so each is checked to stay inside the folder
before it is opened. Every shard is opened (headers only; data stays on disk until read).
"""

from __future__ import annotations

import json
from pathlib import Path

from ckptlab.errors import CorruptFileError
from ckptlab.io.base import TensorRef, safe_member
from ckptlab.io.files import read_text
from ckptlab.io.safetensors_file import open_safetensors

INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def find_index(folder: Path) -> Path | None:
    for name in INDEX_FILES:
        if (folder / name).is_file():
            return folder / name
    return None


def open_sharded(index_path: Path, *, sequential: bool = False):
    """(refs, aliases, notes, skipped, closers) for all shards named by the index."""
    folder = index_path.parent
    try:
        index = json.loads(read_text(index_path))
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptFileError(f"unreadable shard index ({e})", path=index_path) from None
    except RecursionError:
        raise CorruptFileError("unreadable shard index (JSON nested too deeply)", path=index_path) from None
    shards = sorted({safe_member(folder, f, what="the shard index") for f in weight_map.values()})
    refs: dict[str, TensorRef] = {}
    aliases: dict[str, str] = {}
    notes: list[str] = []
    skipped: dict[str, str] = {}
    closers = []
    for shard in shards:
        path = folder / shard
        if not path.is_file():
            raise CorruptFileError(f"shard {shard} named by {index_path.name} is missing", path=folder)
        if shard.endswith(".safetensors"):
            shard_refs, _, shard_skipped, file = open_safetensors(path, sequential=sequential)
            closers.append(file.close)
            skipped.update(shard_skipped)
        else:
            from ckptlab.io.torch_file import open_torch  # (imports torch: only for .bin shards)

            shard_refs, shard_aliases, shard_notes, shard_closers = open_torch(path, sequential=sequential)
            aliases.update(shard_aliases)
            notes += shard_notes
            closers += shard_closers
        for name, ref in shard_refs.items():
            if name in refs:
                raise CorruptFileError(f"tensor {name!r} is stored in two shards", path=folder)
            refs[name] = ref
    absent = [n for n, f in weight_map.items() if n not in refs and n not in aliases and n not in skipped]
    if absent:
        raise CorruptFileError(
            f"{index_path.name} lists {len(absent)} tensor(s) its shards do not hold (e.g. {absent[0]!r} in {weight_map[absent[0]]})",
            path=folder,
        )
    notes.append(f"{len(shards)} shard(s) listed by {index_path.name}")
    return refs, aliases, notes, skipped, closers
