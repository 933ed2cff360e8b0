"""Write a run's health as TensorBoard event files (`ckptlab export --tensorboard DIR`).

    summary = write_tensorboard(run, "tb/exp1", gradients=checkpoint_gradients)
    # then: tensorboard --logdir tb

What goes where (x axis: the ckptlab step; a checkpoint "at step k" is the state step k starts in):
    train/loss, train/grad_norm (before clipping), train/lr[/group{i}], train/step_time,
    train/nonfinite_grads, train/update_ratio (every health_every steps) -- every recorded step
    val/<metric>                      each validation point
    grad_norm/<param>, update_ratio/<param>, weight_norm/<param>   per parameter
    weights/<param>                   histogram at each checkpoint (finite values)
    grads/<param>                     histogram of step k's gradient (before clipping), when
                                      `gradients(step)` is given (it replays that step)
    nonfinite/weights/<param>         count of non-finite weights at each checkpoint
    anomalies                         text: what the Recorder flagged at each step

Rendering only: numbers come from the run reader (and `gradients`); nothing is analysed here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ckptlab.errors import CkptlabError
from ckptlab.io.base import expand_aliases
from ckptlab.run.reader import Run
from ckptlab.run.records import NO_GRAD

# Per-parameter scalars multiply the tag count by the parameter count; past this many
# parameters only the global curves and the histograms are written (TensorBoard's UI lists
# every tag, and a 7B model has ~300 parameter tensors).
MAX_PARAM_SCALARS = 512


@dataclass
class ExportSummary:
    logdir: str
    steps: int
    scalars: int  # scalar points written
    histograms: int
    checkpoints: list[int]
    gradient_checkpoints: list[int]
    notes: list[str] = field(default_factory=list)


def require_tensorboard():
    """torch's SummaryWriter; CkptlabError naming the extra to install when it is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise CkptlabError(
            "exporting to TensorBoard needs the tensorboard package", hint="pip install 'ckptlab[tensorboard]'"
        ) from None
    return SummaryWriter


def summary_writer(logdir: str | os.PathLike):
    """A SummaryWriter on a folder that holds no event files yet (TensorBoard would merge them)."""
    SummaryWriter = require_tensorboard()  # noqa: N806 - a class
    logdir = Path(logdir)
    if logdir.exists() and (
        not logdir.is_dir() or any(p.name.startswith("events.out.tfevents") for p in logdir.iterdir())
    ):
        raise CkptlabError(
            "already holds TensorBoard event files; refusing to mix two exports",
            path=logdir,
            hint="choose a new folder, e.g. tb/<run name>",
        )
    return SummaryWriter(log_dir=str(logdir))


def write_tensorboard(
    run: Run,
    logdir: str | os.PathLike,
    *,
    gradients: Callable[[int], dict[str, torch.Tensor]] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ExportSummary:
    """Write `run` into `logdir`. `progress(done, total)` is called per checkpoint."""
    writer = summary_writer(logdir)
    out = ExportSummary(str(logdir), 0, 0, 0, [], [])
    try:
        _steps(writer, run, out)
        _validation(writer, run, out)
        _events(writer, run)
        checkpoints = run.checkpoints
        for i, step in enumerate(checkpoints):
            _checkpoint(writer, run, step, gradients, out)
            if progress is not None:
                progress(i + 1, len(checkpoints))
    finally:
        writer.close()
    return out


def _steps(writer, run: Run, out: ExportSummary) -> None:
    m = run.metrics()
    per_param = len(m.param_names) <= MAX_PARAM_SCALARS
    if not per_param:
        out.notes.append(f"{len(m.param_names)} parameters: per-parameter curves left out (limit {MAX_PARAM_SCALARS})")
    groups = m.lr.shape[1] if m.lr.ndim == 2 else 0
    for i, step in enumerate(m.step.tolist()):
        scalars = {
            "train/loss": m.loss[i],
            "train/grad_norm": m.grad_norm[i],
            "train/step_time": m.step_time[i],
            "train/nonfinite_grads": m.nonfinite_grads[i],
        }
        for g in range(groups):
            scalars["train/lr" if groups == 1 else f"train/lr/group{g}"] = m.lr[i, g]
        ratio = m.scalars[i].get("update_ratio_global")
        if ratio is not None:
            scalars["train/update_ratio"] = ratio
        if per_param:
            for j, name in enumerate(m.param_names):
                if m.param_grad_norm[i, j] != NO_GRAD:
                    scalars[f"grad_norm/{name}"] = m.param_grad_norm[i, j]
                for key, arr in (("update_ratio", m.update_ratio), ("weight_norm", m.weight_norm)):
                    if not np.isnan(arr[i, j]):
                        scalars[f"{key}/{name}"] = arr[i, j]
        for tag, value in scalars.items():
            writer.add_scalar(tag, float(value), global_step=step)
        out.scalars += len(scalars)
    out.steps = len(m.step)


def _validation(writer, run: Run, out: ExportSummary) -> None:
    for point in run.validation():
        for name, value in point.get("metrics", {}).items():
            writer.add_scalar(f"val/{name}", float(value), global_step=point["step"])
            out.scalars += 1


def _events(writer, run: Run) -> None:
    by_step: dict[int, list[str]] = {}
    for e in run.events():
        by_step.setdefault(int(e["step"]), []).append(str(e["kind"]))
    for step, kinds in by_step.items():
        writer.add_text(
            "anomalies", f"step {step}: " + ", ".join(kinds) + f" -- `ckptlab replay --step {step}`", global_step=step
        )


def _checkpoint(writer, run: Run, step: int, gradients, out: ExportSummary) -> None:
    ckpt = run.checkpoint(step)
    tensors, aliases = ckpt.load_model()  # verifies the hashes
    full = expand_aliases(tensors, aliases)
    for name in run.param_names:
        if name in full:
            out.histograms += _histogram(writer, f"weights/{name}", full[name], step, f"nonfinite/weights/{name}")
    out.checkpoints.append(step)
    if gradients is None or step not in run.steps:
        return
    try:
        grads = gradients(step)
    except CkptlabError as e:  # e.g. the recorded build_fn cannot be imported here
        out.notes.append(f"no gradient histograms at step {step}: {e}")
        return
    for name, g in grads.items():
        out.histograms += _histogram(writer, f"grads/{name}", g, step, f"nonfinite/grads/{name}")
    out.gradient_checkpoints.append(step)


def _histogram(writer, tag: str, t: torch.Tensor, step: int, nonfinite_tag: str) -> int:
    """A histogram of the finite values (TensorBoard cannot bin NaN/Inf); their count beside it."""
    if t.is_sparse:
        t = t.to_dense()
    if not (t.is_floating_point() or t.is_complex()):
        return 0
    x = t.detach().reshape(-1).float()
    finite = torch.isfinite(x)
    bad = int((~finite).sum())
    if bad:
        writer.add_scalar(nonfinite_tag, bad, global_step=step)
        x = x[finite]
    if x.numel() == 0:
        return 0
    writer.add_histogram(tag, x.numpy(), global_step=step)
    return 1
