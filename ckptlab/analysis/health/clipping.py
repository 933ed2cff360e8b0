"""Whether the run clips its gradients, from what it records, so that report does not advise
clipping to a run that already clips (its gradient norms are recorded before clipping, so an
explosion shows in them either way):

- the trainer integrations record their clipping setting with each step's batch
  (`transformers.max_grad_norm`, `lightning.gradient_clip_val`): on or off, for sure;
- a plain Recorder records its step_fn's source file (a copy under the run's `sources/`): a
  call to a clipping function in step_fn, or in a function of the same file that step_fn
  calls, says it clips. Read as text and parsed, never run. No such call is not proof of the
  contrary (a helper in another module may clip), so the answer is then "not known".

    c = clipping(run)             # Clipping(on=True, how="step_fn `step` calls clip_grad_norm_")
    clip_remedy(c)                # the remedy line about clipping, worded for what is known
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass

from ckptlab.errors import CkptlabError
from ckptlab.io.files import read_text
from ckptlab.run.manifest import inside, resolve_file
from ckptlab.run.reader import Run

# The calls that clip: torch.nn.utils' two, Accelerate's, Lightning's and DeepSpeed's spellings.
CLIP_CALLS = frozenset(
    {"clip_grad_norm_", "clip_grad_value_", "clip_grad_norm", "clip_gradients", "clip_grad_norm_fp32"}
)
MAX_SOURCE_BYTES = 4 << 20  # a step_fn's source file larger than this is not parsed
FOLLOW = 2  # levels of same-file functions followed from step_fn


@dataclass(frozen=True)
class Clipping:
    on: bool | None  # None: the run records nothing that says
    how: str  # what says so, for a person ("" when nothing does)


UNKNOWN = Clipping(None, "")


def clipping(run: Run, step: int | None = None) -> Clipping:
    """What the run records about clipping: a trainer integration's setting in the batch of
    `step` (default: the last retained step), else a clipping call in step_fn's source."""
    steps = run.steps
    if steps:
        found = _from_batch(run, step if step in steps else steps[-1])
        if found is not None:
            return found
    return _from_source(run)


def clip_remedy(c: Clipping, rest: str = "lower the learning rate or lengthen warm-up") -> str:
    """`rest`, and clipping: advised when the run does not clip, said to be on when it does,
    and advised conditionally when the run does not say."""
    if c.on:
        return f"{rest} (gradients are already clipped: {c.how})"
    if c.on is False:
        return f"{rest}; clip gradients: {c.how}"
    return f"{rest}; if the gradients are not clipped yet, clip them (clip_grad_norm_ 1.0)"


def _from_batch(run: Run, step: int) -> Clipping | None:
    try:
        batch, _ = run.batch(step)
    except Exception:  # noqa: BLE001 - an unreadable batch says nothing about clipping
        return None
    if not isinstance(batch, dict):
        return None
    for integration, key in (("transformers", "max_grad_norm"), ("lightning", "gradient_clip_val")):
        how = batch.get(integration)
        if isinstance(how, dict) and key in how:
            v = how[key]
            on = isinstance(v, (int, float)) and 0 < v < float("inf")
            said = f"the Trainer's {key} is {v}"
            return Clipping(on, said if on else f"{said}, so nothing clips (set it, e.g. to 1.0)")
    return None


def _from_source(run: Run) -> Clipping:
    desc = (run.manifest.get("functions") or {}).get("step_fn")
    if not isinstance(desc, dict) or not isinstance(desc.get("qualname"), str):
        return UNKNOWN
    tree = _parse(run, desc)
    if tree is None:
        return UNKNOWN
    qualname = desc["qualname"]
    functions = _functions(tree)
    fn = functions.get(qualname)
    if fn is None:
        return UNKNOWN
    call = _clip_call(fn, functions, FOLLOW)
    return Clipping(True, f"step_fn `{qualname}` calls {call}") if call else UNKNOWN


def _parse(run: Run, desc: dict) -> ast.Module | None:
    """step_fn's file: the run's own copy of it, else where it was recorded (parsed only)."""
    candidates = []
    try:
        if isinstance(desc.get("source_copy"), str):
            copy = run.path / desc["source_copy"]
            if inside(copy, run.path):
                candidates.append(copy)
        found = resolve_file(desc, run.path)
        if found is not None:
            candidates.append(found)
    except (OSError, TypeError, ValueError):  # a manifest whose paths are not paths
        pass
    for path in candidates:
        try:
            if os.path.getsize(path) > MAX_SOURCE_BYTES:
                continue
            return ast.parse(read_text(path))
        # missing, not a regular file, not UTF-8, not Python, nested too deep: try the next
        except (OSError, CkptlabError, ValueError, SyntaxError, RecursionError, MemoryError):
            continue
    return None


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """Functions and methods by qualified name (`step`, `Trainer.step`)."""
    out: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}

    def walk(body, prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[prefix + node.name] = node
            elif isinstance(node, ast.ClassDef):
                walk(node.body, f"{prefix}{node.name}.")

    walk(tree.body, "")
    return out


def _clip_call(fn, functions: dict, depth: int) -> str | None:
    """The first clipping call in `fn`, or in a same-file function it calls (`depth` levels)."""
    called = []
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name in CLIP_CALLS:
            return name
        if isinstance(node.func, ast.Name) and node.func.id in functions:
            called.append(functions[node.func.id])
    if depth > 0:
        for g in called:
            if g is not fn and (found := _clip_call(g, functions, depth - 1)):
                return found
    return None
