"""One naming for every wrapper: the parameters of a model inside Lightning Fabric's
`_FabricModule`, DDP (`module.`), torch.compile (`_orig_mod.`) and their combinations are named as
the model names them, by the probe, the checkpoints and the diff's name matching alike; whether
it runs compiled is seen through all of them."""

import pytest

pytest.importorskip("lightning.fabric")

import torch  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.wrappers import _FabricModule  # noqa: E402

from ckptlab.analysis.diff.names import canonical  # noqa: E402
from ckptlab.training.probe import named_parameters  # noqa: E402
from ckptlab.training.state import capture_model, is_compiled  # noqa: E402
from ckptlab.training.world import unsupported  # noqa: E402
from ckptlab.training.wrappers import unwrap  # noqa: E402


class DistributedDataParallel(torch.nn.Module):
    """DDP as ckptlab sees it (its class name, its `.module`), without a process group."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(5, 4)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.register_buffer("scale", torch.ones(4))


OWN = ["embed.weight", "blocks.0.weight", "blocks.0.bias", "blocks.1.weight", "blocks.1.bias"]


def _fabric():
    return Fabric(accelerator="cpu", devices=1)


def _wrapped(how: str, model: Net) -> torch.nn.Module:
    if how == "fabric":  # _forward_module.embed.weight
        return _fabric().setup_module(model)
    if how == "fabric, compiled":  # Fabric's own layout: _forward_module._orig_mod.embed.weight
        return _fabric().setup_module(torch.compile(model))
    if how == "fabric, compiled, ddp":  # Fabric 2.6 under DDP: _forward_module._orig_mod.module.embed.weight
        ddp = torch.compile(DistributedDataParallel(model))
        return _FabricModule(ddp, _fabric().strategy, original_module=model)
    if how == "fabric, ddp, compiled":  # compiled under DDP: _forward_module.module._orig_mod.embed.weight
        return _FabricModule(DistributedDataParallel(torch.compile(model)), _fabric().strategy, original_module=model)
    if how == "compiled, fabric, ddp":  # Fabric's module compiled: _orig_mod._forward_module.module.embed.weight
        return torch.compile(_FabricModule(DistributedDataParallel(model), _fabric().strategy, original_module=model))
    if how == "ddp, compiled":  # module._orig_mod.embed.weight
        return DistributedDataParallel(torch.compile(model))
    return model


@pytest.mark.parametrize(
    ("how", "compiled"),
    [
        ("fabric", False),
        ("fabric, compiled", True),
        ("fabric, compiled, ddp", True),
        ("fabric, ddp, compiled", True),
        ("compiled, fabric, ddp", True),
        ("ddp, compiled", True),
        ("none", False),
    ],
)
def test_every_wrapper_combination_is_named_as_the_model_names_itself(how, compiled):
    model = Net()
    wrapped = _wrapped(how, model)
    assert unwrap(wrapped) is model
    assert [n for n, _ in named_parameters(wrapped)] == OWN  # the probe's, the manifest's, replay's
    tensors, _ = capture_model(wrapped)  # a checkpoint's, so `ckptlab diff RUN@S`'s
    assert sorted(tensors) == sorted([*OWN, "scale"])
    # A state dict saved from the wrapper as it is names the same tensors once its prefixes go.
    assert sorted({canonical(n) for n, _ in wrapped.named_parameters()}) == sorted(OWN)
    assert is_compiled(wrapped) is compiled
    assert unsupported(wrapped) is None


def test_a_deepspeed_engine_inside_fabrics_module_is_refused():
    engine = type("DeepSpeedEngine", (DistributedDataParallel,), {"__module__": "deepspeed.runtime.engine"})
    model = Net()
    why = unsupported(_FabricModule(engine(model), _fabric().strategy, original_module=model))
    assert why is not None and why.startswith("cannot record a DeepSpeed model (DeepSpeedEngine)")
