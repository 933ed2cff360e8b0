"""ckptlab: checkpoint forensics and replay for PyTorch training.

    import ckptlab
    rec = ckptlab.Recorder("runs/exp1", model, opt, step_fn=step, build_fn=build, ckpt_every=500)
    loss = rec.step(batch, sample_ids=ids)          # in the training loop
    run = ckptlab.open_run("runs/exp1")             # later: run.steps, run.batch(n), run.metrics()
    report = ckptlab.replay("runs/exp1", 5432)      # why did step 5432 go wrong?
    findings = ckptlab.diff("a.pt", "b.safetensors")

Public names are imported lazily so `import ckptlab` (and `ckptlab --help`) stay fast.
"""

from __future__ import annotations

__version__ = "0.1.0"

from ckptlab.errors import (  # noqa: E402 - light, no torch
    CkptlabError,
    CorruptFileError,
    FormatVersionError,
    IntegrityError,
    NonFiniteLoss,
    NotARunError,
    RecordError,
    ReplayError,
    UnsafeFileError,
    UntrustedCodeError,
)

_LAZY = {
    "Recorder": ("ckptlab.record", "Recorder"),
    "open_run": ("ckptlab.run.reader", "open_run"),
    "Run": ("ckptlab.run.reader", "Run"),
    "replay": ("ckptlab.replayer", "replay"),
    "diff": ("ckptlab.analysis.diff", "diff"),
    "skip_samples": ("ckptlab.training.sample_ids", "skip_samples"),
    "with_sample_ids": ("ckptlab.training.sample_ids", "with_sample_ids"),
    "collate_with_ids": ("ckptlab.training.sample_ids", "collate_with_ids"),
    "track_sample_ids": ("ckptlab.training.sample_ids", "track_sample_ids"),
    "RecordConfig": ("ckptlab.record", "RecordConfig"),
    "HandUpdate": ("ckptlab.training.hand_update", "HandUpdate"),
    "RunLockedError": ("ckptlab.run.lock", "RunLockedError"),
    "portable_cpu": ("ckptlab.run.environment", "portable_cpu"),
}

__all__ = [
    "CkptlabError",
    "CorruptFileError",
    "FormatVersionError",
    "IntegrityError",
    "NonFiniteLoss",
    "NotARunError",
    "RecordError",
    "ReplayError",
    "UnsafeFileError",
    "UntrustedCodeError",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ckptlab' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
