"""Which tensor of A is which of B: names matched after removing wrapper prefixes (`module.`
from DDP, `_orig_mod.` from torch.compile, `_forward_module.`/`_original_module.` from Lightning
Fabric's module, a prefix one whole side shares such as Lightning's `model.`), tied weights
compared once, shapes that differ set aside (`align`). The names are then the model's own, as
ckptlab names parameters everywhere (training/wrappers.py `unwrap`, on live modules)."""

from __future__ import annotations

from dataclasses import dataclass

from ckptlab import dtypes
from ckptlab.analysis.diff.findings import Mismatch
from ckptlab.io import LazyStateDict


@dataclass
class Pair:
    name: str  # the aligned name shown to the user
    name_a: str  # as stored in A / in B
    name_b: str
    tied: list[str]


@dataclass
class Plan:
    pairs: list[Pair]
    missing: list[str]
    unexpected: list[str]
    mismatched: list[Mismatch]
    notes: list[str]


# Components only a wrapper names (torch.compile's; Fabric's, which registers the model under both
# when nothing wraps it in between; FSDP1's, around each unit): removed wherever they are. DDP's
# `module.` is also a name models use, so only leading ones go.
WRAPPER_COMPONENTS = frozenset({"_orig_mod", "_forward_module", "_original_module", "_fsdp_wrapped_module"})


def canonical(name: str) -> str:
    """The name without wrapper components: `module.` in front, `_orig_mod.`,
    `_forward_module.`, `_original_module.` and `_fsdp_wrapped_module.` anywhere."""
    parts = [p for p in name.split(".") if p not in WRAPPER_COMPONENTS]
    while len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def _names(sd: LazyStateDict, strip: str = "") -> dict[str, str]:
    """aligned name -> stored (or alias) name; first one wins if two collapse to one name."""
    out: dict[str, str] = {}
    for name in sd:
        c = canonical(name)
        if strip and c.startswith(strip):
            c = c[len(strip) :]
        out.setdefault(c, name)
    return out


def _shared_first(names) -> str:
    """The first dotted component every name shares ("model." for Lightning), else ""."""
    firsts = {n.split(".", 1)[0] for n in names if "." in n}
    if len(firsts) == 1 and all("." in n for n in names):
        return firsts.pop() + "."
    return ""


def align(sd_a: LazyStateDict, sd_b: LazyStateDict, pattern=None) -> Plan:
    """Match A's tensors with B's: names, prefixes, tied weights, shapes."""
    na, nb = _names(sd_a), _names(sd_b)
    notes = []
    wrapped = [side for side, sd in (("A", sd_a), ("B", sd_b)) if any(canonical(n) != n for n in sd)]
    if wrapped:
        notes.append(f"aligned names: removed wrapper prefixes (module., _orig_mod., ...) from {' and '.join(wrapped)}")
    best: tuple[int, dict[str, str], dict[str, str], str | None] = (len(na.keys() & nb.keys()), na, nb, None)
    for side, sd in (("A", sd_a), ("B", sd_b)):
        prefix = _shared_first(_names(sd))
        if prefix:
            ta = _names(sd_a, prefix) if side == "A" else na
            tb = _names(sd_b, prefix) if side == "B" else nb
            if len(ta.keys() & tb.keys()) > best[0]:
                best = (
                    len(ta.keys() & tb.keys()),
                    ta,
                    tb,
                    f"aligned names: removed the prefix {prefix!r} that all of {side}'s names share",
                )
    _, na, nb, note = best
    if note:
        notes.append(note)
    if pattern is not None:
        na = {k: v for k, v in na.items() if pattern.search(k)}
        nb = {k: v for k, v in nb.items() if pattern.search(k)}

    pairs: dict[tuple, Pair] = {}
    mismatched: list[Mismatch] = []
    for name, stored_a in na.items():
        if name not in nb:
            continue
        ra, rb = sd_a.info(stored_a), sd_b.info(nb[name])
        if ra.shape != rb.shape:
            mismatched.append(
                Mismatch(name, list(ra.shape), list(rb.shape), dtypes.name_of(ra.dtype), dtypes.name_of(rb.dtype))
            )
            continue
        key = (ra.identity, rb.identity)  # tied on both sides: one comparison, several names
        if key in pairs:
            pairs[key].tied.append(name)
        else:
            pairs[key] = Pair(name, stored_a, nb[name], [])
    for p in pairs.values():  # show the stored name, the tied ones as aliases
        names = [p.name, *p.tied]
        stored = [n for n in names if na[n] in sd_a.refs]
        if stored and stored[0] != p.name:
            p.name = stored[0]
            p.tied = [n for n in names if n != p.name]

    for p in pairs.values():  # names tied on one side only (the other side dropped them)
        for sd, aligned, target in ((sd_a, na, p.name_a), (sd_b, nb, p.name_b)):
            p.tied += [n for n, s in aligned.items() if sd.aliases.get(s) == target and n != p.name and n not in p.tied]
    covered = {n for p in pairs.values() for n in (p.name, *p.tied)}
    missing = [n for n, s in na.items() if n not in nb and not _tied_elsewhere(sd_a, s, covered, na)]
    unexpected = [n for n, s in nb.items() if n not in na and not _tied_elsewhere(sd_b, s, covered, nb)]
    return Plan(list(pairs.values()), missing, unexpected, mismatched, notes)


def _tied_elsewhere(sd: LazyStateDict, stored: str, covered: set[str], names: dict[str, str]) -> bool:
    """A tied name (an alias) whose data is compared under its other name is not missing:
    Hugging Face files drop `lm_head.weight` when it is `embed_tokens.weight`."""
    target = sd.aliases.get(stored)
    return target is not None and any(names.get(c) == target for c in covered)


def single_plan(sd: LazyStateDict, pattern) -> Plan:
    names = _names(sd)
    pairs: dict[object, Pair] = {}
    for name, stored in names.items():
        if pattern is not None and not pattern.search(name):
            continue
        key = sd.info(stored).identity
        if key in pairs:
            pairs[key].tied.append(name)
        else:
            pairs[key] = Pair(name, stored, stored, [])
    return Plan(list(pairs.values()), [], [], [], [])


# The end of io/nested.py's note on a file that is not a state dict (a list, no tensors at all);
# not imported from there: that module imports torch, and a safetensors diff never does.
NOT_A_STATE_DICT = "not a state dict of named tensors"


def nothing_to_compare(sd_a, sd_b, plan: Plan, pattern) -> str:
    if pattern is not None:
        return f"--select {pattern.pattern!r} matches no tensor" + (" present in both checkpoints" if sd_b else "")
    sides = [sd for sd in (sd_a, sd_b) if sd is not None]
    held = [(sd, n) for sd in sides for n in sd.notes if NOT_A_STATE_DICT in n]
    if held:  # a .pt holding a list, or no tensors: say that, not "unrelated checkpoints?"
        odd, note = held[0]
        other = next((sd for sd in sides if sd is not odd), None)
        like = (
            f" ({other.label} has {len(other)} like {next(iter(other), 'nothing')!r})"
            if other and len(held) == 1
            else ""
        )
        return f"{note}{like}; save model.state_dict() to compare tensors by name"
    if sd_b is None:
        return f"{sd_a.label}: holds no tensors to check"
    if plan.mismatched:
        m = plan.mismatched[0]
        return (
            f"{sd_a.label} and {sd_b.label} share names but no tensor of the same shape "
            f"(e.g. {m.name}: {m.shape_a} vs {m.shape_b}): different architectures?"
        )
    ea, eb = next(iter(sd_a), "nothing"), next(iter(sd_b), "nothing")
    return (
        f"{sd_a.label} and {sd_b.label} share no tensor names (A has {len(sd_a)} like {ea!r}, "
        f"B has {len(sd_b)} like {eb!r}): unrelated checkpoints?"
    )
