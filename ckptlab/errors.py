"""Typed errors. Every expected failure is a `CkptlabError`; the CLI renders it as one line.

    try:
        run = ckptlab.open_run("runs/exp1")
    except ckptlab.CkptlabError as e:
        print(e)        # "runs/exp1: not a ckptlab run (no manifest.json)"

Messages name the file first and then the problem, so a person at a terminal knows where to
look. `NonFiniteLoss` is deliberately *not* a CkptlabError: it is raised into the user's
training loop, not reported by the CLI.
"""

from __future__ import annotations

import os


class CkptlabError(Exception):
    """An expected failure with a one-line message (bad input, missing data, ...)."""

    def __init__(self, message: str, *, path: str | os.PathLike | None = None, hint: str | None = None):
        self.path = os.fspath(path) if path is not None else None
        self.problem = message
        self.hint = hint
        text = f"{self.path}: {message}" if self.path else message
        if hint:
            text = f"{text} ({hint})"
        super().__init__(text)

    def __reduce__(self):
        # Pickled as it is (a worker process sends it to its parent), whatever the subclass's
        # own arguments: the default would call __init__ with the message alone.
        return (_restore, (type(self), self.args, self.__dict__))


def _restore(cls, args, state):
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


def install_hint(extra: str, packages: str) -> str:
    """How to install what an optional feature needs: the packages themselves (works in any
    environment), or ckptlab's extra from its clone (ckptlab is not on a package index)."""
    return f"pip install {packages}; from ckptlab's clone: pip install -e '.[{extra}]'"


class NotARunError(CkptlabError):
    """The directory is not a ckptlab run."""


class FormatVersionError(CkptlabError):
    """The run (or file) was written by a newer ckptlab."""


class CorruptFileError(CkptlabError):
    """A file is truncated, malformed or fails its own hash."""


class IntegrityError(CorruptFileError):
    """A checkpoint file does not match the hash recorded when it was committed."""


class UnsafeFileError(CkptlabError):
    """A file would need unpickling of arbitrary objects (or escapes its folder) to read."""


class UnknownFormatError(CkptlabError):
    """A path is not a checkpoint format ckptlab reads."""


class RecordError(CkptlabError):
    """Something the Recorder was given cannot be recorded (e.g. an object array in a batch)."""


class ReplayError(CkptlabError):
    """A replay cannot start or continue (missing step, pruned batches, changed model...)."""


class RetiredError(ReplayError):
    """Part of a live run was retired while it was read: retention deleted an old checkpoint
    or batch log (or a rollback moved it) after the reader listed it. The run is healthy;
    the reader's answer would have been from a moment that has passed."""

    def __init__(self, what: str, *, path: str | os.PathLike | None = None):
        super().__init__(
            f"{what} was retired by retention while this command read it (the run is still recording)",
            path=path,
            hint="run the command again: it reads what the run holds then",
        )


class UntrustedCodeError(ReplayError):
    """A run names code that is not the user's own, unchanged: it is not run without opt-in."""


class NonFiniteLoss(ArithmeticError):
    """Raised by `Recorder.step` after it recorded a step whose loss is NaN or infinite."""

    def __init__(self, step: int, loss: float, run_dir: str):
        self.step = step
        self.loss = loss
        self.run_dir = run_dir
        super().__init__(
            f"loss is {loss} at step {step}; the step is recorded. "
            f"Investigate with: ckptlab replay --run {run_dir} --step {step}"
        )
