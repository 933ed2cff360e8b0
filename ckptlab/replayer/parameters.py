"""Parameter blame: the parameters whose gradients, weights or update ratios at the root step
are out of line with their recorded history, and the weight that is out of scale with its peers.

    blamed = parameters(root, h)             # ParameterBlame, the most to blame first
    outsized_weight(model, "blocks.3.attn")  # (parameter, why) or None
    nonfinite_buffers(model)                 # {"bn.running_var": 32}: buffers that hold NaN/Inf
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from ckptlab.analysis.anomalies import UPDATE_EXPLOSION
from ckptlab.analysis.spikes import GRAD_RULE
from ckptlab.replayer.findings import ParameterBlame
from ckptlab.replayer.rootstep import RootStep
from ckptlab.run.records import NO_GRAD
from ckptlab.training.health import StepHealth
from ckptlab.training.probe import named_parameters
from ckptlab.training.wrappers import unwrap

# A weight this many times its peers' RMS (the same parameter in sibling modules: heads.0.fc.weight
# for heads.2.fc.weight), or with no peers this many times the RMS of PyTorch's default init
# (uniform in +-1/sqrt(fan_in)), is outsized: a bad init or a corrupted load, not training.
OUTSIZED_VS_PEERS = 30.0
OUTSIZED_VS_INIT = 100.0


def parameters(root: RootStep, h: StepHealth) -> list[ParameterBlame]:
    """The parameters `h` (the root step replayed) shows non-finite, or far from their typical
    gradient norm over the recorded steps before it, or moved too far by their update."""
    m = root.inv.metrics
    names = m.param_names
    hist = m.window(max(0, root.root - 128), root.root - 1)
    typical = np.full(len(names), np.nan)
    if hist.stop > hist.start:
        with warnings.catch_warnings():  # a parameter that never had a gradient: NaN, said below
            warnings.simplefilter("ignore", RuntimeWarning)
            typical = np.nanmedian(np.where(m.param_grad_norm[hist] >= 0, m.param_grad_norm[hist], np.nan), axis=0)
    out = []
    for i, name in enumerate(names):
        g = float(h.param_grad_norm[i])
        nf = int(h.param_nonfinite[i]) if h.param_nonfinite is not None else 0
        ratio = float(h.update_ratio[i]) if h.update_ratio is not None else None
        w = float(h.weight_norm[i]) if h.weight_norm is not None else None
        typ = float(typical[i]) if i < len(typical) and math.isfinite(typical[i]) else None
        reasons = []
        if nf or (g != NO_GRAD and not math.isfinite(g)):
            reasons.append(f"{nf} non-finite gradient elements" if nf > 0 else "non-finite gradient")
        if w is not None and not math.isfinite(w):
            reasons.append("weights went non-finite")
        if typ and math.isfinite(g) and g > GRAD_RULE.min_ratio * 5 * typ:
            reasons.append(f"gradient norm {g:.3g} is {g / typ:.0f}x its typical {typ:.3g}")
        if ratio is not None and math.isfinite(ratio) and ratio > UPDATE_EXPLOSION:
            reasons.append(f"update moved the weights by {ratio:.3g}x their norm")
        elif ratio is not None and not math.isfinite(ratio) and w is not None and math.isfinite(w):
            pass  # a zero-initialized tensor's first move: not an explosion
        if reasons:
            out.append(ParameterBlame(name, "; ".join(reasons), g if g != NO_GRAD else None, typ, nf, ratio, w))
    out.sort(
        key=lambda p: (
            -p.nonfinite_grad,
            -(
                p.grad_norm / p.typical_grad_norm
                if p.grad_norm and p.typical_grad_norm and math.isfinite(p.grad_norm)
                else (math.inf if p.grad_norm is not None and not math.isfinite(p.grad_norm) else 0)
            ),
            -(p.update_ratio or 0),
        )
    )
    return out


def nonfinite_buffers(model) -> dict[str, int]:
    """The model's floating buffers (BatchNorm's running statistics, a carried state) that hold
    non-finite values, with how many: damage that outlives the step, since later steps and
    evaluation read them and no optimizer step repairs them."""
    out = {}
    with torch.no_grad():
        for name, b in unwrap(model).named_buffers():
            if b.is_floating_point() and b.numel():
                bad = int((~torch.isfinite(b)).sum())
                if bad:
                    out[name] = bad
    return out


def outsized_weight(model, module: str) -> tuple[str, str] | None:
    """(parameter name, why) for the weight of `module`'s subtree most out of scale with its
    peers (or, without peers, with a default init), when one is: the forward op that went
    non-finite in `module` did so because of that weight, not of its input."""
    params = dict(named_parameters(model))
    prefix = f"{module}." if module else ""
    peers: dict[tuple, list[str]] = {}  # heads.2.fc.weight, heads.0.fc.weight -> heads.#.fc.weight
    for name, p in params.items():
        peers.setdefault((_peer_key(name), tuple(p.shape)), []).append(name)
    rms = {name: _rms(p) for name, p in params.items() if p.dim() >= 2 and p.is_floating_point()}
    best = None
    for name, own in rms.items():
        if not name.startswith(prefix) or not math.isfinite(own) or own == 0:
            continue
        others = [o for o in peers[(_peer_key(name), tuple(params[name].shape))] if o != name]
        peer_rms = [r for r in (rms[o] for o in others) if math.isfinite(r) and r > 0]
        if peer_rms:
            typical = float(np.median(peer_rms))
            against, limit = (
                f"its peers' ({', '.join(others[:2])}{', ...' if len(others) > 2 else ''})",
                OUTSIZED_VS_PEERS,
            )
        elif _default_init_is_kaiming(model, name):
            fan_in = params[name][0].numel()
            typical = 1.0 / math.sqrt(3.0 * fan_in)
            against, limit = f"a default init for fan-in {fan_in}", OUTSIZED_VS_INIT
        else:
            continue
        ratio = own / typical
        if ratio > limit and (best is None or ratio > best[0]):
            best = (ratio, name, f"has RMS {own:.3g}, {ratio:.0f}x {against} ({typical:.3g})")
    return (best[1], best[2]) if best else None


def _peer_key(name: str) -> str:
    """The parameter's name with its layer indices blanked: what its peers share."""
    return ".".join("#" if part.isdigit() else part for part in name.split("."))


def _default_init_is_kaiming(model, name: str) -> bool:
    """The weight of a Linear or convolution (their default init is uniform in
    +-1/sqrt(fan_in)); not an Embedding's (N(0, 1)) or a custom module's."""
    owner, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(owner) if owner else model
    except AttributeError:
        return False
    return attr == "weight" and isinstance(module, (torch.nn.Linear, torch.nn.modules.conv._ConvNd))


def _rms(t) -> float:
    with torch.no_grad():
        return float(t.detach().float().pow(2).mean().sqrt())
