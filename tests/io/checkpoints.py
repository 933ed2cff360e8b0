"""Write real checkpoints in every format ckptlab reads, and a pair with planted faults.

    a = toy_state()                 # a GPT-like state dict: wte (tied to lm_head), 4 blocks
    b = planted_faults(a)           # B = A after a small update, with four faults (FAULTS)
    write(tmp_path / "a", a, "pt")  # -> the path to pass to ckptlab

Sharded folders are written by hand the way transformers' save_pretrained does it (an index
JSON with a weight_map), so the tests need no transformers install.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import safetensors.torch
import torch

FORMATS = ("pt", "safetensors", "hf-safetensors", "hf-bin", "dcp")

# parameter -> (flag it must get, words its reason must contain)
FAULTS = {
    "blocks.2.attn.weight": ("nonfinite", "NaN"),
    "blocks.1.mlp.fc.weight": ("exploded", "grew 1e4x"),
    "blocks.0.mlp.proj.weight": ("drifted", "more than its 3 peers"),
    "blocks.3.ln.weight": ("frozen", "unchanged"),
}


def toy_state(
    blocks: int = 4, d: int = 16, vocab: int = 32, seed: int = 0, dtype=torch.float32
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.1):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    sd = {"wte.weight": w(vocab, d)}
    for i in range(blocks):
        p = f"blocks.{i}."
        sd[p + "ln.weight"] = (1 + w(d, scale=0.01)).to(dtype)
        sd[p + "ln.bias"] = w(d, scale=0.01)
        sd[p + "attn.weight"] = w(d, d)
        sd[p + "attn.bias"] = w(d, scale=0.01)
        sd[p + "mlp.fc.weight"] = w(4 * d, d)
        sd[p + "mlp.proj.weight"] = w(d, 4 * d)
    sd["lm_head.weight"] = sd["wte.weight"]  # tied, as in GPT
    return sd


def planted_faults(a: dict[str, torch.Tensor], seed: int = 1, step: float | None = None) -> dict[str, torch.Tensor]:
    """B = A + an update of `step` relative size, except: one parameter x1e4, one NaN, one
    frozen (bit-for-bit unchanged) and one drifted (an update 100x its peers').

    step defaults to 1e-3, or 1e-2 for 16-bit weights: a 1e-3 step is below bfloat16's
    resolution (2^-8), so it would leave every weight unchanged - frozen, correctly."""
    g = torch.Generator().manual_seed(seed)
    if step is None:
        step = 1e-2 if next(iter(a.values())).element_size() <= 2 else 1e-3
    b = {}
    for name, t in a.items():
        if name == "lm_head.weight":
            continue
        x = t.float()
        b[name] = (x + step * x.abs().mean() * torch.randn(x.shape, generator=g)).to(t.dtype)
    b["blocks.1.mlp.fc.weight"] = (a["blocks.1.mlp.fc.weight"].float() * 1e4).to(a["blocks.1.mlp.fc.weight"].dtype)
    b["blocks.2.attn.weight"][3, 5] = float("nan")
    b["blocks.3.ln.weight"] = a["blocks.3.ln.weight"].clone()
    proj = a["blocks.0.mlp.proj.weight"].float()
    b["blocks.0.mlp.proj.weight"] = (proj + 100 * step * proj.abs().mean() * torch.randn(proj.shape, generator=g)).to(
        a["blocks.0.mlp.proj.weight"].dtype
    )
    b["lm_head.weight"] = b["wte.weight"]
    return b


def write(path: Path, sd: dict[str, torch.Tensor], fmt: str) -> Path:
    """Save `sd` as `fmt` at `path` (a file or folder name without suffix); returns what to open."""
    path = Path(path)
    if fmt == "pt":  # a training checkpoint: model + optimizer + step, tied weights kept tied
        out = path.with_suffix(".pt")
        torch.save(
            {"model": sd, "optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": []}, "step": 7}, out
        )
        return out
    if fmt == "safetensors":
        out = path.with_suffix(".safetensors")
        safetensors.torch.save_file(untied(sd), out)
        return out
    if fmt in ("hf-safetensors", "hf-bin"):
        return write_sharded(path, sd, kind=fmt.removeprefix("hf-"))
    if fmt == "dcp":
        return write_dcp(path, sd)
    raise ValueError(fmt)


def untied(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the second name of tied tensors (as save_pretrained does: safetensors refuses them)."""
    seen, out = set(), {}
    for name, t in sd.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            out[name] = t.contiguous()
    return out


def write_sharded(folder: Path, sd: dict[str, torch.Tensor], *, kind: str = "safetensors", shards: int = 3) -> Path:
    """A Hugging Face sharded folder with its index, like transformers' save_pretrained."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = untied(sd)
    names = list(tensors)
    per = math.ceil(len(names) / shards)
    stem, index_name = (
        ("model", "model.safetensors.index.json")
        if kind == "safetensors"
        else ("pytorch_model", "pytorch_model.bin.index.json")
    )
    suffix = "safetensors" if kind == "safetensors" else "bin"
    weight_map = {}
    for i in range(shards):
        part = {n: tensors[n] for n in names[i * per : (i + 1) * per]}
        shard = f"{stem}-{i + 1:05d}-of-{shards:05d}.{suffix}"
        if kind == "safetensors":
            safetensors.torch.save_file(part, folder / shard, metadata={"format": "pt"})
        else:
            torch.save(part, folder / shard)
        weight_map.update({n: shard for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / index_name).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return folder


def write_dcp(folder: Path, sd: dict[str, torch.Tensor]) -> Path:
    """torch.distributed.checkpoint.save in one process, no process group."""
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {"model": {k: v.clone() for k, v in untied(sd).items()}, "optim": {"lr": torch.tensor(0.1)}, "step": 7}
    with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming single process"
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder))
    return folder
