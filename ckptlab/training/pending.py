"""One step's health on its way from the device to the host: what `StepProbe.end` returns
(training/probe.py), read a step later by the Recorder on a GPU or at once by replay, into a
StepHealth (training/health.py) with the same numbers either way."""

from __future__ import annotations

from typing import Any

import torch

from ckptlab.training.health import CommonHealth, StepHealth, read_common, read_health


class PendingHealth:
    """One step's measurements, on their way to the host. `result()` waits for the copy (on
    CUDA: an event recorded after it, normally long done a step later) and turns the numbers
    into a StepHealth. `probe`: the StepProbe that measured it (its parameters, world and
    optimizer; not imported here: the probe imports this module)."""

    def __init__(self, probe: Any, values: torch.Tensor | tuple[float, torch.Tensor], event, parts: dict, meta: dict):
        self._probe, self._event, self._parts, self._meta = probe, event, parts, meta
        # The numbers: one vector, or on the usual CPU step (StepProbe.end) the loss as a float
        # and the gradient norms' vector, kept apart until read. None once read.
        self._values: torch.Tensor | tuple[float, torch.Tensor] | None = values
        self._health: StepHealth | None = None
        self._common: CommonHealth | None = None  # read by common()
        # A watched step (StepProbe.watch): "stepped" (the optimizer did), else once read
        # "moved" (the weights moved all the same) or "still"; None on the other steps.
        self.watched: str | None = meta.pop("watched", None)
        # On a watched step, once read: the parameters in no optimizer given that had a
        # gradient and moved all the same (an optimizer the Recorder was not told about).
        self.moved_outside: tuple[int, ...] = ()
        self._outside: tuple[int, ...] = meta.pop("outside", ())

    def common(self) -> CommonHealth | None:
        """The usual step's health in plain Python numbers (training/health.py `read_common`:
        cheap right after a step), or None for any other step (read it with `result()`).
        One rank, on the CPU."""
        if self._health is not None or self._event is not None or self._probe.world.distributed:
            return None
        values = self._values
        assert values is not None, "let go only once read into _health"
        numbers = [values[0], *values[1].tolist()] if isinstance(values, tuple) else values.tolist()
        common = read_common(numbers, self._parts, self._meta, len(self._probe.params))
        if common is not None:
            self._common, self._values = common, None
        return common

    def result(self, *, grads_live: bool = False) -> StepHealth:
        """`grads_live`: the step's gradients are still on the parameters (read right after
        the step), so a GPU run can count the non-finite elements of a non-finite norm."""
        if self._health is None and self._common is not None:
            self._health = self._common.health()
        if self._health is None:
            assert self._values is not None, "let go only once read into _health"
            if self._event is not None and not self._event.query():
                self._event.synchronize()  # the device is behind by more than a step: wait
            probe = self._probe
            if isinstance(self._values, tuple):  # (the loss and the norms, as to_host joins them)
                loss, norms = self._values
                self._values = torch.cat([torch.tensor([loss], dtype=torch.float32), norms])
            values = self._values.numpy()
            if "w0" in self._parts:
                moved = (values[self._parts["w0"]] != values[self._parts["w1"]]).any()
                self.watched = "moved" if moved else "still"
            if "o0" in self._parts:
                changed = values[self._parts["o0"]] != values[self._parts["o1"]]
                graded = set(self._meta["idx"])
                first = probe.world.stages.first if probe.world.stages is not None else 0  # (the run's numbering)
                self.moved_outside = tuple(
                    first + i for i, c in zip(self._outside, changed.tolist()) if c and i in graded
                )
            self._health = read_health(
                values,
                self._parts,
                self._meta,
                params=probe.params,
                world=probe.world,
                optimizer=probe.optimizer,
                grads_live=grads_live,
            )
            self._values = self._event = None
        return self._health
