"""How a Lightning trainer's strategy spreads the step over processes, recorded and replayed.

    why = not_recorded(trainer)              # None: ckptlab records this trainer's strategy
    config = strategy_config(trainer)        # recorded with each step: {"strategy": "ddp", "ddp": {...}}
    configure_model(module, tensor_parallel_size=2)   # build_fn: the module's configure_model, on a mesh

Three strategies are recorded (docs/integrations.md, "Lightning under DDP" and "Lightning's
ModelParallelStrategy"):
- one process (no strategy that spreads anything);
- DDP (`strategy="ddp"`, `"ddp_spawn"`): the trainer wraps the module in DistributedDataParallel.
  The replayed step makes the same wrapper around the built module (`ddp_wrapper`), with the
  recorded options, so its backward all-reduces the gradients as the trainer's did;
- ModelParallelStrategy: the module shards itself in `configure_model` (FSDP2's `fully_shard`
  on the strategy's `device_mesh["data_parallel"]`, tensor parallelism on its
  `["tensor_parallel"]`), so the module the callback records is FSDP2's (x TP's), recorded and
  checkpointed as a plain FSDP2 (x TP) model is (docs/distributed.md). The trainer calls the
  module's own methods; replay does too, on the module `configure_model` made the same way.

Not recorded (`not_recorded`: a one-line warning, nothing written): Lightning's FSDP1 strategy
(`strategy="fsdp"`, which Lightning itself refuses on the CPU), its DeepSpeed strategy on any
number of processes (refused by Lightning on the CPU: "The DeepSpeed strategy is only supported
on CUDA GPUs"; its engine holds the module and the ZeRO optimizer, which the callback would not
see), and any other strategy of several processes.
"""

from __future__ import annotations

import contextlib
import importlib

import torch

from ckptlab.errors import ReplayError, install_hint
from ckptlab.integrations import _common

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]  # the same API under its old name
    except ImportError:
        raise ImportError(
            "ckptlab.integrations.lightning needs PyTorch Lightning: " + install_hint("lightning", "lightning")
        ) from None

BUILD_HINT = "return ckptlab.integrations.lightning.build(module) from build_fn"

# DistributedDataParallel's options that shape the gradient all-reduce (its buckets, which
# gradients it waits for, buffers it broadcasts): recorded with each step, replayed as given.
DDP_OPTIONS = (
    "bucket_cap_mb",
    "find_unused_parameters",
    "gradient_as_bucket_view",
    "static_graph",
    "broadcast_buffers",
)
MESH_DIMS = ("data_parallel", "tensor_parallel")  # ModelParallelStrategy's device mesh, its order


def _strategies():
    return importlib.import_module(f"{pl.__name__}.strategies")


def _model_parallel() -> tuple:
    """ModelParallelStrategy's class, for isinstance (none before Lightning 2.4)."""
    return tuple(c for c in [getattr(_strategies(), "ModelParallelStrategy", None)] if c is not None)


def not_recorded(trainer) -> str | None:
    """Why this trainer's run is not recorded (None: it is): one process, DDP (every rank
    records, as the Recorder does under DDP) or ModelParallelStrategy (every rank records its
    shards, as under FSDP2; docs/distributed.md)."""
    strategies, strategy = _strategies(), trainer.strategy
    if isinstance(strategy, strategies.DeepSpeedStrategy):  # (a DDPStrategy subclass)
        return (
            "recording Lightning's DeepSpeedStrategy is not supported "
            "(ckptlab records DeepSpeed's engine as deepspeed.initialize returns it; through Lightning: "
            'strategy="ddp", "ddp_spawn", ModelParallelStrategy and one process)'
        )
    if isinstance(strategy, (strategies.DDPStrategy, *_model_parallel())) or trainer.world_size <= 1:
        return None
    return (
        f"recording a {trainer.world_size}-process Lightning run under {type(strategy).__name__} is not supported "
        '(ckptlab records strategy="ddp", "ddp_spawn", ModelParallelStrategy (FSDP2, FSDP2 x TP) and one '
        "process; Lightning's FSDP1 strategy shards the model in ways it does not replay)"
    )


def strategy_config(trainer) -> dict:
    """What the replayed step needs to know of the strategy, recorded with each step: under
    DDP the wrapper's options; under ModelParallelStrategy the device mesh's sizes (replay
    checks that build_fn made the same); nothing for one process."""
    if isinstance(trainer.model, torch.nn.parallel.DistributedDataParallel):
        options = getattr(trainer.strategy, "_ddp_kwargs", {})
        return {"strategy": "ddp", "ddp": {k: v for k, v in options.items() if k in DDP_OPTIONS}}
    if isinstance(trainer.strategy, _model_parallel()):
        mesh = trainer.strategy.device_mesh
        return {"strategy": "model_parallel", "mesh": {d: mesh[d].size() for d in MESH_DIMS}}
    return {}


# --- build_fn: the module's configure_model, on the mesh the strategy would give it ------------


def configure_model(module, tensor_parallel_size: int) -> None:
    """What the trainer does to `module` before `configure_optimizers`: under torch.distributed,
    ModelParallelStrategy's device mesh (data_parallel, tensor_parallel) over the process group
    build_fn runs in, given to the module as `self.device_mesh`; then `configure_model()`
    (which shards the module under ModelParallelStrategy) and any meta tensors materialized.
    The mesh is (world / t, t) with t = `tensor_parallel_size`, or (1, 1) in the process group
    of one where replay explains the root step."""
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.is_available() and dist.is_initialized():
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        tp = min(tensor_parallel_size, world)
        if world % tp:
            raise ReplayError(
                f"tensor_parallel_size={tensor_parallel_size} does not divide the {world} processes build_fn runs on",
                hint="pass ckptlab.integrations.lightning.build(module, tensor_parallel_size=T) the trainer's size",
            )
        if torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        module._device_mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=MESH_DIMS)
    module.configure_model()
    fabric = "lightning.fabric" if pl.__name__.startswith("lightning.") else "lightning_fabric"
    materialize = importlib.import_module(f"{fabric}.utilities.init")._materialize_distributed_module
    materialize(module, device)  # (a configure_model that built on the meta device)
    if device.type != "cpu":
        module.to(device)  # the strategy's model_to_device


def check_mesh(model, cfg: dict) -> None:
    """A ModelParallelStrategy step is replayed on a module whose mesh is the recorded one (on
    the recorded processes) or a process group of one's: else its shards would not be the
    checkpoint's, and replay would fail in the load or compute something else."""
    recorded = cfg.get("mesh")
    mesh = getattr(model, "_device_mesh", None)
    if cfg.get("strategy") != "model_parallel" or recorded is None:
        return
    if mesh is None:
        raise ReplayError(
            "this step ran under ModelParallelStrategy, and the module build_fn returned has no device mesh",
            hint="return ckptlab.integrations.lightning.build(module, tensor_parallel_size=T) from build_fn",
        )
    built = {d: mesh[d].size() for d in MESH_DIMS}
    if built != recorded and mesh.size() == recorded["data_parallel"] * recorded["tensor_parallel"]:
        raise ReplayError(
            f"build_fn's device mesh is {built['data_parallel']} x {built['tensor_parallel']} (data_parallel x "
            f"tensor_parallel); the trainer's was {recorded['data_parallel']} x {recorded['tensor_parallel']}",
            hint=f"pass tensor_parallel_size={recorded['tensor_parallel']} to ckptlab.integrations.lightning.build",
        )


# --- DDP: the wrapper the trainer's DDPStrategy put around the module -------------------------


def ddp_wrapper(model, optimizer, cfg: dict):
    """Replay of a step the trainer ran under DDP: the DistributedDataParallel wrapper around
    `model` with the recorded options, so the backward all-reduces the gradients over the
    ranks the replay runs on (a process group of one when one rank is replayed alone). Made
    at the built model's first replayed step, on every rank alike (its construction is
    collective), and kept with the optimizer build(...) registered."""
    if cfg.get("strategy") != "ddp":
        return None
    wrapper = _common.registered(optimizer, "ddp", required=False, hint=BUILD_HINT)
    if wrapper is None or wrapper.module is not model:
        wrapper = torch.nn.parallel.DistributedDataParallel(model, **cfg.get("ddp", {}))
        _common.remember(optimizer, "ddp", wrapper)
    return wrapper


def run_training_step(model, ddp, args):
    """`model.training_step(*args)`; under DDP through the wrapper's forward, as DDPStrategy
    runs it (its forward redirection), so the wrapper prepares the gradient all-reduce.
    (ModelParallelStrategy calls the module's own training_step: FSDP2's hooks are on it.)"""
    if ddp is None:
        return model.training_step(*args)
    redirect = importlib.import_module(f"{pl.__name__}.strategies.ddp")._DDPForwardRedirection()
    return redirect(ddp, model, "training_step", *args)


def no_sync(ddp):
    """DDPStrategy.block_backward_sync: a micro-batch before the step's last one."""
    return ddp.no_sync() if ddp is not None else contextlib.nullcontext()
