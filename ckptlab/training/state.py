"""Training state: what a checkpoint holds, and how it goes back in.

A checkpoint at step k is the state in which step k starts:
- the model's state dict (tied weights stored once, with an alias map; taken from the user's
  module inside torch.compile / DDP / Fabric wrappers, training/wrappers.py `unwrap`, so its
  names are the model's own),
- optimizer, LR scheduler and grad scaler state (of the torch objects inside a framework's
  wrappers: training/wrappers.py),
- every RNG that changes bits (python `random`, numpy's global RNG, torch CPU and CUDA),
- the execution settings that change bits (`env`): thread counts, deterministic-algorithm
  flags, cuDNN/TF32 switches, matmul precision, default dtype, CUBLAS_WORKSPACE_CONFIG.

`capture_*` functions copy the state off the device synchronously (training mutates it right
after); writing to disk happens elsewhere, in the background.
"""

from __future__ import annotations

import contextlib
import os
import random
from typing import Any

import numpy as np
import torch

from ckptlab.io.base import expand_aliases, split_tied
from ckptlab.run import codec
from ckptlab.run.checkpoint import CapturedState
from ckptlab.training import zero
from ckptlab.training.sharded import full_snapshot, load_sharded, set_full
from ckptlab.training.wrappers import module_chain, torch_optimizer, torch_scheduler, unwrap
from ckptlab.training.zero_parts import torch_format


def is_compiled(model) -> bool:
    """The model runs through torch.compile: wrapped (`torch.compile(model)`, an
    OptimizedModule, possibly inside DDP or Fabric's module) or compiled in place
    (`model.compile()`); or, for a function (a step_fn), it is the `torch.compile`d one."""
    if not isinstance(model, torch.nn.Module):
        return getattr(model, "_torchdynamo_orig_callable", None) is not None
    return any(
        type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None
        for m in module_chain(model)
    )


def is_grad_scaler(obj) -> bool:
    """A `torch.amp.GradScaler` (or the older `torch.cuda.amp.GradScaler`, a subclass)."""
    return isinstance(obj, torch.amp.GradScaler)


# --- model ---------------------------------------------------------------------------------


def capture_model(model: torch.nn.Module, *, live: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, aliases): CPU copies of the state dict, each shared tensor stored once.

    `aliases` maps a tied name to the name it shares storage with (GPT's `lm_head.weight` ->
    `transformer.wte.weight`); safetensors refuses to save the same storage twice.
    `live`: large CPU parameters are the parameters themselves, not copies (see `snapshot`);
    buffers are always copied (a forward pass may update them: BatchNorm's running stats).
    """
    target = unwrap(model)
    state = {n: t for n, t in target.state_dict().items() if isinstance(t, torch.Tensor)}
    first, aliases = split_tied(state)
    params = {p.data_ptr() for p in target.parameters()} if live else set()

    def shared(t: torch.Tensor) -> bool:
        return t.data_ptr() in params and _live_candidate(t)

    return {
        n: t.detach() if shared(t) else t.detach().to("cpu", copy=True).contiguous() for n, t in first.items()
    }, aliases


def load_model(model: torch.nn.Module, tensors: dict[str, torch.Tensor], aliases: dict[str, str]) -> None:
    """Load strictly into the unwrapped model; raises ValueError naming what does not match."""
    target = unwrap(model)
    state = expand_aliases(tensors, aliases)
    own = target.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    mismatched = [
        f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(state))
        if isinstance(own[k], torch.Tensor) and tuple(own[k].shape) != tuple(state[k].shape)
    ]
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"missing {_few(missing)}")
        if unexpected:
            parts.append(f"unexpected {_few(unexpected)}")
        if mismatched:
            parts.append(f"shape {_few(mismatched)}")
        raise ValueError("model does not match the checkpoint: " + "; ".join(parts))
    target.load_state_dict(state, strict=True)


def _few(items: list[str], n: int = 3) -> str:
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more


# --- optimizer, scheduler, scaler ----------------------------------------------------------


def capture_train_state(optimizer, scheduler=None, scaler=None) -> dict[str, Any]:
    """Plain nested state (tensors still live: encode it with the codec, which copies)."""
    optimizer, scheduler = torch_optimizer(optimizer), torch_scheduler(scheduler)
    state: dict[str, Any] = {"optimizer": optimizer.state_dict()} if optimizer is not None else {}
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    state["rng"] = capture_rng()
    state["env"] = capture_env()
    return state


def load_train_state(state: dict[str, Any], optimizer, scheduler=None, scaler=None) -> None:
    """Optimizer (when the state has one: a sharded run's goes through DCP), scheduler, scaler."""
    optimizer, scheduler = torch_optimizer(optimizer), torch_scheduler(scheduler)
    if "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and "scheduler" in state:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and "scaler" in state:
        scaler.load_state_dict(state["scaler"])


# --- RNG -----------------------------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    rng: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    # Only when CUDA is already in use: querying it would initialize a context.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    random.setstate(_as_python_state(rng["python"]))
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        states = rng["cuda"]
        for i, s in enumerate(states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def _as_python_state(state):
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


def rng_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys() or a["python"] != b["python"]:
        return False
    na, nb = a["numpy"], b["numpy"]
    if na[0] != nb[0] or not np.array_equal(na[1], nb[1]) or tuple(na[2:]) != tuple(nb[2:]):
        return False
    if not torch.equal(a["torch"], b["torch"]):
        return False
    return all(torch.equal(x, y) for x, y in zip(a.get("cuda", []), b.get("cuda", [])))


# --- execution settings ----------------------------------------------------------------------


def capture_env() -> dict[str, Any]:
    env = {
        "num_threads": torch.get_num_threads(),
        "num_interop_threads": torch.get_num_interop_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "default_dtype": str(torch.get_default_dtype()).removeprefix("torch."),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }
    return env


def apply_env(env: dict[str, Any], *, force_deterministic: bool = False) -> list[str]:
    """Re-create recorded execution settings; returns notes on what could not be matched."""
    notes = []
    if env.get("num_threads") and torch.get_num_threads() != env["num_threads"]:
        torch.set_num_threads(int(env["num_threads"]))
    if env.get("num_interop_threads") and torch.get_num_interop_threads() != env["num_interop_threads"]:
        try:
            torch.set_num_interop_threads(int(env["num_interop_threads"]))
        except RuntimeError:  # only settable before the first parallel work; rarely changes bits
            notes.append(
                f"inter-op threads stay {torch.get_num_interop_threads()} (recorded {env['num_interop_threads']})"
            )
    deterministic = bool(env.get("deterministic_algorithms")) or force_deterministic
    # Forced (not recorded): warn, don't fail, on ops that have no deterministic kernel.
    warn_only = bool(env.get("deterministic_warn_only")) or (
        force_deterministic and not env.get("deterministic_algorithms")
    )
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.backends.cudnn.deterministic = bool(env.get("cudnn_deterministic")) or force_deterministic
    torch.backends.cudnn.benchmark = bool(env.get("cudnn_benchmark")) and not force_deterministic
    torch.backends.cudnn.allow_tf32 = bool(env.get("cudnn_allow_tf32", True))
    torch.backends.cuda.matmul.allow_tf32 = bool(env.get("matmul_allow_tf32", False))
    if env.get("float32_matmul_precision"):
        torch.set_float32_matmul_precision(env["float32_matmul_precision"])
    if env.get("default_dtype"):
        torch.set_default_dtype(codec.dtype_from_name(env["default_dtype"]))
    wanted = env.get("cublas_workspace_config") or (":4096:8" if force_deterministic else None)
    if wanted and os.environ.get("CUBLAS_WORKSPACE_CONFIG") != wanted:
        # cuBLAS reads this when its handle is created: effective only before the first matmul.
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = wanted
    return notes


@contextlib.contextmanager
def process_kept():
    """Leave the process as it was before a replay ran the user's build_fn and step_fn: the
    execution settings (`apply_env`), and torch.nn.functional's functions, which an engine may
    replace for the whole process and leave replaced (DeepSpeed's ZeRO-3 puts its own `linear`
    there): the notebook's next cell, or the next replay in this process, runs the torch it had."""
    env = capture_env()
    functions = {k: v for k, v in vars(torch.nn.functional).items() if callable(v)}
    try:
        yield
    finally:
        for name, fn in functions.items():
            if getattr(torch.nn.functional, name, None) is not fn:
                setattr(torch.nn.functional, name, fn)
        apply_env(env)


# --- whole-state snapshots (checkpoints and replay share these) ------------------------------


def capture_grads(model) -> dict[str, torch.Tensor]:
    """Gradients that exist between steps: usually none (zero_grad(set_to_none=True)), but
    accumulation across steps, or parameters the optimizer does not own (never zeroed), carry
    state into the next step that replay must have too."""
    return {n: p.grad for n, p in unwrap(model).named_parameters() if p.grad is not None}


def restore_grads(model, grads: dict[str, torch.Tensor]) -> None:
    for n, p in unwrap(model).named_parameters():
        g = grads.get(n)
        p.grad = None if g is None else g.detach().to(p.device, copy=True)


# A live snapshot shares tensors of at least this size (smaller ones cost little to copy).
LIVE_MIN_BYTES = 256 << 10


def _live_candidate(t: torch.Tensor) -> bool:
    """Large, contiguous, on the CPU, and its storage's only tensor (safetensors refuses to
    write two tensors that share memory: a view into a flat buffer is copied)."""
    nbytes = t.numel() * t.element_size()
    return (
        t.device.type == "cpu"
        and t.is_contiguous()
        and nbytes >= LIVE_MIN_BYTES
        and t.untyped_storage().nbytes() == nbytes
    )


def _live_state(path: str, t: torch.Tensor) -> bool:
    """The optimizer's per-parameter state (Adam's moments): changed only by its step."""
    return path.startswith("state/optimizer/state/") and _live_candidate(t)


def whole_snapshot(world, step: int, model, optimizer, scheduler=None, scaler=None, rngs=None):
    """`snapshot` of a sharded model (FSDP2): collective, whole on rank 0 (other ranks: None),
    with every rank's RNG streams (`rngs`, when the caller has them: a fold's recorded ranks')."""
    return full_snapshot(world, step, model, optimizer, capture_train_state(None, scheduler, scaler), rngs=rngs)


def snapshot(
    step: int, model, optimizer, scheduler=None, scaler=None, info: dict | None = None, *, live=False, rngs=None
):
    """Copy the whole training state off the device: a CapturedState a checkpoint commit can
    write, or replay can keep in memory and load again (bit-exact either way).

    `live`: the large CPU tensors that only the optimizer's step changes (parameters, its
    per-parameter state) are not copied: the CapturedState holds them themselves, with their
    version counters, and the caller must keep the optimizer from stepping until the commit
    has written them (`CapturedState.released`). Gradients, buffers and small tensors are
    copied as always. On a CPU model this takes the copy of the state (gigabytes into fresh
    memory, page by page) off the step that checkpoints.

    `rngs`: every rank's RNG streams (`rng_by_rank`), for a state that any rank's view of may be
    restored (replayer/fold.py)."""
    tensors, aliases = capture_model(model, live=live)
    state = capture_train_state(optimizer, scheduler, scaler)
    if rngs is not None:
        state["rng_by_rank"] = rngs
    grads = capture_grads(model)
    if grads:
        state["grads"] = grads
    spec, state_tensors = codec.encode(state, prefix="state", share=_live_state if live else None)
    captured = CapturedState(step, tensors, aliases, spec, state_tensors, dict(info or {}))
    if live:
        owned = {p.data_ptr() for p in unwrap(model).parameters()}
        owned |= {
            t.data_ptr()
            for per_param in getattr(torch_optimizer(optimizer), "state", {}).values()
            for t in per_param.values()
            if isinstance(t, torch.Tensor)
        }
        captured.live = [(t, t._version) for t in (*tensors.values(), *state_tensors.values()) if t.data_ptr() in owned]
    if not captured.live:
        captured.release()  # a copy: nothing to wait for
    return captured


def restore(model, optimizer, scheduler, scaler, tensors, aliases, train_state: dict) -> None:
    """Load a model state, optimizer/scheduler/scaler state, leftover gradients and the RNGs
    (not the env). A whole-state snapshot of sharded (FSDP) training carries its optimizer
    state keyed by parameter name (`optimizer_fqn`) and goes in through DCP's state-dict API;
    into a DeepSpeed engine the whole state goes in part by part (training/zero.py)."""
    engine = zero.engine_of(model)
    if engine is not None:  # DeepSpeed ZeRO: each rank takes its parts of the whole state
        optim = train_state.get("optimizer") or torch_format(engine, train_state["optimizer_fqn"])  # (per rank: DCP's)
        zero.load_whole(engine, expand_aliases(tensors, aliases), optim, train_state.get("deepspeed"))
        load_train_state({k: v for k, v in train_state.items() if k != "optimizer"}, optimizer, scheduler, scaler)
    elif "optimizer_fqn" in train_state:
        set_full(model, torch_optimizer(optimizer), expand_aliases(tensors, aliases), train_state["optimizer_fqn"])
        load_train_state({k: v for k, v in train_state.items() if k != "optimizer"}, optimizer, scheduler, scaler)
    else:
        load_model(model, tensors, aliases)
        load_train_state(train_state, optimizer, scheduler, scaler)
        restore_grads(model, train_state.get("grads", {}))
    restore_rng(train_state["rng"])


def restore_snapshot(captured, model, optimizer, scheduler=None, scaler=None, *, rank: int | None = None) -> None:
    """Load a snapshot; `rank` picks that rank's RNG streams from a sharded run's snapshot."""
    # Clone: optimizer.load_state_dict keeps tensors that already have the right dtype/device,
    # and the next step would update them in place -- inside our snapshot.
    tensors = {k: v.clone() for k, v in captured.state_tensors.items()}
    state = codec.decode(captured.state_spec, tensors)
    if "rng_by_rank" in state:  # (taken in a process group of one, `--rank R`: that rank's, alone)
        by_rank = state["rng_by_rank"]
        state["rng"] = by_rank[rank or 0] if len(by_rank) > 1 else by_rank[0]
    restore(model, optimizer, scheduler, scaler, captured.model, captured.aliases, state)


def restore_checkpoint(ckpt, model, optimizer, scheduler=None, scaler=None, world=None) -> dict:
    """Load a committed checkpoint (any layout) into live training objects; returns its
    training state (env included, not applied). Sharded checkpoints go shard by shard into a
    distributed sharded model, else whole (assembled from the shards) into any model."""
    state = ckpt.load_state(verify=False)
    if ckpt.sharded and world is not None and world.checkpoints_sharded and world.distributed:
        load_sharded(ckpt.path, model, torch_optimizer(optimizer), state)
        load_train_state({k: v for k, v in state.items() if k != "optimizer"}, optimizer, scheduler, scaler)
        restore_rng(state["rng"])
    elif ckpt.sharded:
        model_sd, optim_sd = ckpt.load_sharded(state)
        restore(model, optimizer, scheduler, scaler, model_sd, {}, {**state, "optimizer_fqn": optim_sd})
    else:
        tensors, aliases = ckpt.load_model(verify=False)
        restore(model, optimizer, scheduler, scaler, tensors, aliases, state)
    return state
