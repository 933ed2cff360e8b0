"""Find the model's weights inside whatever a training script saved.

    {"model": {...}, "optimizer": {...}, "step": 5}       -> checkpoint["model"]
    {"state_dict": {...}, "optimizer_states": [...]}      -> checkpoint["state_dict"]  (Lightning)
    {"fc.weight": t, "fc.bias": t}                        -> the whole thing

Nested dicts of tensors are flattened with dots ({"fc": {"weight": t}} -> "fc.weight").
Works on any tree of dicts/lists whose leaves are tensors or TensorRefs (torch.load output, a
DCP checkpoint's key paths).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ckptlab.io.base import TensorRef

# Where training code puts the model, in order of preference.
MODEL_KEYS = ("model", "state_dict", "model_state_dict", "model_state", "module", "net", "network", "weights", "params")
# Never the model: optimizer moments are tensors too and would otherwise win on size.
NOT_MODEL = {
    "optimizer",
    "optimizers",
    "optim",
    "opt",
    "optimizer_state",
    "optimizer_state_dict",
    "optimizer_states",
    "scheduler",
    "lr_scheduler",
    "lr_schedulers",
    "scaler",
    "grad_scaler",
    "rng",
    "rng_state",
    "rng_states",
    "dataloader",
    "train_state",
    "trainer",
    "callbacks",
    "loops",
}


def _is_tensor(v) -> bool:
    return isinstance(v, (torch.Tensor, TensorRef))


def _size(v) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, TensorRef):
        return v.nbytes
    if isinstance(v, Mapping):
        return sum(_size(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return sum(_size(x) for x in v)
    return 0


def flatten(tree, prefix: str = "") -> dict[str, object]:
    """{dotted name: leaf tensor} of a nested dict/list (non-tensor leaves dropped)."""
    out: dict[str, object] = {}
    items = tree.items() if isinstance(tree, Mapping) else enumerate(tree)
    for k, v in items:
        name = f"{prefix}{k}"
        if _is_tensor(v):
            out[name] = v
        elif isinstance(v, (Mapping, list, tuple)):
            out.update(flatten(v, name + "."))
    return out


def find_state_dict(obj) -> tuple[dict[str, object], list]:
    """(flat name -> tensor, the keys that led to it: [] for the top level, ["model"], ...)."""
    path: list = []
    while _is_wrapper(obj):
        child = _pick_child(obj)
        if child is None:
            break
        path.append(child)
        obj = obj[child]
    if _is_tensor(obj):
        return {str(path[-1]) if path else "tensor": obj}, path[:-1]
    if isinstance(obj, Mapping):  # a state dict that also carries e.g. its optimizer: leave that out
        obj = {k: v for k, v in obj.items() if _is_tensor(v) or not (isinstance(k, str) and k.lower() in NOT_MODEL)}
    return (flatten(obj) if isinstance(obj, (Mapping, list, tuple)) else {}), path


def _is_wrapper(obj) -> bool:
    """A training checkpoint around the weights ({"model": ..., "step": 5}), as opposed to a
    (possibly nested) state dict ({"fc": {"weight": t}})."""
    if isinstance(obj, (list, tuple)):
        return not any(_is_tensor(v) for v in obj)
    if not isinstance(obj, Mapping) or any(_is_tensor(v) for v in obj.values()):
        return False  # tensors at this level: a state dict
    keys = {k.lower() for k in obj if isinstance(k, str)}
    plain = any(not isinstance(v, (Mapping, list, tuple)) and v is not None for v in obj.values())  # step, epoch...
    return bool(keys & set(MODEL_KEYS)) or bool(keys & NOT_MODEL) or plain


def _pick_child(obj):
    keys = list(obj.keys()) if isinstance(obj, Mapping) else list(range(len(obj)))
    holding = [k for k in keys if _size(obj[k]) > 0]
    if not holding:
        return None
    for key in MODEL_KEYS:
        if key in holding:
            return key
    if len(holding) == 1:
        return holding[0]
    candidates = [k for k in holding if not (isinstance(k, str) and k.lower() in NOT_MODEL)]
    return max(candidates, key=lambda k: _size(obj[k])) if candidates else None


def describe(top, path: list) -> str | None:
    """A note saying where the weights were found and what else the checkpoint held."""
    if not path:
        return None
    where = "".join(f"[{k!r}]" for k in path)
    others = [str(k) for k in top if k != path[0]] if isinstance(top, Mapping) else []
    rest = f" (also in it, not compared: {', '.join(others[:6])}{', ...' if len(others) > 6 else ''})" if others else ""
    return f"model weights taken from checkpoint{where}{rest}"


# The phrase a container note ends with (analysis/diff/names.py finds it to explain a diff
# that matched nothing; that module does not import this one: it must stay torch-free).
NOT_A_STATE_DICT = "not a state dict of named tensors"


def container_note(label: str, obj, flat: dict[str, object], path: list) -> str | None:
    """What a file holds when it is not a state dict (None when it is one, or a wrapper around
    one, `path` leading to it): a list or tuple of tensors (named by position: "0", "1", ...),
    or a container with no tensors at all."""
    if path and flat:
        return None
    if isinstance(obj, (list, tuple)) and flat:
        names = list(flat)
        span = f"{names[0]}..{names[-1]}" if len(names) > 1 else names[0]
        kind = type(obj).__name__
        return f"{label} holds a {kind} of {len(flat)} tensors, {NOT_A_STATE_DICT}: they are named by position ({span})"
    if flat or (isinstance(obj, Mapping) and not obj):
        return None
    return f"{label} holds {_what(obj)} and no tensors, {NOT_A_STATE_DICT}"


def _what(obj) -> str:
    if isinstance(obj, Mapping):
        keys = [str(k) for k in list(obj)[:4]]
        return f"a dict of {len(obj)} entr{'y' if len(obj) == 1 else 'ies'} ({', '.join(keys)}{', ...' if len(obj) > 4 else ''})"
    if isinstance(obj, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in obj})
        return f"a {type(obj).__name__} of {len(obj)} items" + (f" ({', '.join(kinds[:3])})" if kinds else "")
    return f"a {type(obj).__name__}"
