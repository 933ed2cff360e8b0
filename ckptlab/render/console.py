"""The one terminal object all CLI output goes through.

stdout carries results (tables, or with --json only the JSON document); stderr carries notes,
warnings and errors, so `ckptlab replay --json > out.json` always yields valid JSON.

With --json that holds whatever the user's code prints: the CLI's Terminal claims stdout
(`claim_stdout`, `StdoutClaim`) for the whole command: file descriptor 1 and `sys.stdout` point
at stderr, so `print`, `os.write(1, ...)`, C code and every child process (DataLoader
workers, distributed replay's ranks) write to stderr, and the document alone goes to the
stdout the command started with.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.text import Text

from ckptlab.render.jsonout import dumps
from ckptlab.stdio import flush_c_stdio

FIELD = 11  # where a field's value starts: "root step  5431 ..."


class StdoutClaim:
    """stdout kept for one JSON document while everything else that would write there (the
    user's `print`, writes to fd 1 from C, child processes, which inherit fd 1) goes to stderr.

    `release()` (idempotent) puts fd 1 and `sys.stdout` back as they were. Where fd 1 cannot
    be moved (closed, or no fd 2), only `sys.stdout` is redirected."""

    def __init__(self) -> None:
        self.stdout = sys.stdout  # where the document goes: the stdout the command started with
        self.saved_fd: int | None = None
        _flush(self.stdout, sys.__stdout__)
        try:
            saved = os.dup(1)
        except OSError:
            saved = None
        if saved is not None:
            try:
                os.dup2(2, 1)
                self.saved_fd = saved
            except OSError:
                os.close(saved)
        sys.stdout = sys.stderr
        self.released = False

    def write(self, text: str) -> None:
        """The document: to the saved fd 1 where the original stdout wrote to fd 1, else to the
        original stdout object (a notebook's, or pytest's capture)."""
        if self.saved_fd is not None and _fileno(self.stdout) == 1:
            data = text.encode(getattr(self.stdout, "encoding", None) or "utf-8", errors="replace")
            while data:
                data = data[os.write(self.saved_fd, data) :]
        else:
            self.stdout.write(text)
            self.stdout.flush()

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        _flush(sys.stdout, sys.__stdout__)
        flush_c_stdio()  # what C code left in its stdout buffer belongs to stderr too
        if self.saved_fd is not None:
            os.dup2(self.saved_fd, 1)
            os.close(self.saved_fd)
            self.saved_fd = None
        sys.stdout = self.stdout


class Terminal:
    """With --json the CLI also has the Terminal claim stdout (`claim_stdout`, undone by
    `close`): cli/common.py `open_terminal`, for the whole command."""

    def __init__(self, *, json_mode: bool = False, quiet: bool = False):
        self.json_mode = json_mode
        self.quiet = quiet
        self._claim: StdoutClaim | None = None
        self.out = _console(sys.stdout)
        self.err = _console(sys.stderr)

    def claim_stdout(self) -> None:
        """From now until `close()`, stdout is for `json()` alone (`StdoutClaim`)."""
        if self._claim is None or self._claim.released:
            self._claim = StdoutClaim()

    def close(self) -> None:
        """Give stdout back (after --json); idempotent."""
        if self._claim is not None:
            self._claim.release()

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def print(self, *renderables: Any, **kwargs) -> None:
        """A result for stdout (suppressed in --json mode, where only the JSON goes there)."""
        if not self.json_mode:
            self.out.print(*renderables, **kwargs)

    def field(self, label: str, text: str, *, width: int = FIELD) -> None:
        """One `label      value` line of a report (both in rich markup; the label fits in
        `width` - 1 columns, "" for a value's further line). Where output wraps, the value wraps
        at word boundaries and its continuation lines start under its first character."""
        head = self.out.render_str(label)
        head.pad_right(max(1, width - head.cell_len))
        self._hanging(head, text)

    def paragraph(self, text: str) -> None:
        """Text in rich markup, wrapped at word boundaries where output wraps (no line ends in
        spaces)."""
        self._hanging(Text(), text)

    def _hanging(self, head: Text, text: str) -> None:
        if self.json_mode:
            return
        value = self.out.render_str(text)
        if self.out.soft_wrap:  # piped: one line, as it is
            self.out.print(head + value)
            return
        lines = value.wrap(self.out, max(20, self.out.width - head.cell_len))
        shown = Text()
        for i, line in enumerate(lines):
            line.rstrip()
            shown.append_text(head if i == 0 else Text(" " * head.cell_len))
            shown.append_text(line)
            if i < len(lines) - 1:
                shown.append("\n")
        self.out.print(shown, soft_wrap=True)  # wrapped already

    def json(self, obj: Any) -> None:
        text = dumps(obj) + "\n"
        if self._claim is not None and not self._claim.released:
            self._claim.write(text)
        else:
            sys.stdout.write(text)
            sys.stdout.flush()

    def note(self, message: str) -> None:
        if not self.quiet:
            self.err.print(f"[dim]{_escape(message)}[/dim]")

    def line(self, message: str) -> None:
        """A line for stderr as it is, without style (ckptlab's log records: cli/common.py)."""
        self.err.print(_escape(message), emoji=False)

    def warn(self, message: str) -> None:
        self.err.print(f"[yellow]warning:[/yellow] {_escape(message)}")

    def error(self, message: str) -> None:
        self.err.print(f"[bold red]error:[/bold red] {_escape(message)}")

    def status(self, message: str):
        """A spinner on stderr while something long runs; silent when not a terminal."""
        if self.quiet or self.json_mode or not self.err.is_terminal:
            from contextlib import nullcontext

            return nullcontext()
        return self.err.status(_escape(message))

    @contextmanager
    def progress(self, description: str, total: int | None = None, *, in_bytes: bool = False):
        """A progress bar on stderr while something long runs; yields
        `update(done=None, total=None, description=None)`. Done/total when the total is known
        (as bytes and a transfer rate with `in_bytes`), a spinner until then. A description
        given without a count names a new phase: the bar pulses and the count stays hidden until
        counting starts again, so a finished count does not sit beside work it does not measure.
        Silent (and free) when not a terminal, --json or quiet."""
        if self.quiet or self.json_mode or not self.err.is_terminal:
            yield lambda done=None, total=None, description=None: None
            return
        from rich.progress import Progress

        with Progress(*_progress_columns(in_bytes), console=self.err, transient=True) as bar:
            task = bar.add_task(_escape(description), total=total, phase=False)

            def update(done: int | None = None, total: int | None = None, description: str | None = None) -> None:
                # rich's update() leaves a field as it is where its argument is None
                counting = done is not None or total is not None
                shown = None if description is None else _escape(description)
                phase = {"phase": not counting} if counting or shown is not None else {}
                bar.update(task, completed=done, total=total, description=shown, refresh=shown is not None, **phase)

            yield update


def _progress_columns(in_bytes: bool) -> tuple:
    """Spinner, description, bar, counts, elapsed time; during a phase (a task's `phase`
    field) the bar pulses and the counts are blank."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        ProgressBar,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    class PhaseBar(BarColumn):
        def render(self, task):
            if not task.fields.get("phase"):
                return super().render(task)
            width = None if self.bar_width is None else max(1, self.bar_width)
            return ProgressBar(total=None, width=width, pulse=True, animation_time=task.get_time())

    def counts(column):
        class Counts(column):
            def render(self, task):
                return Text("") if task.fields.get("phase") else super().render(task)

        return Counts()

    shown = (counts(DownloadColumn), counts(TransferSpeedColumn)) if in_bytes else (counts(MofNCompleteColumn),)
    return (SpinnerColumn(), TextColumn("{task.description}"), PhaseBar(), *shown, TimeElapsedColumn())


def _console(stream) -> Console:
    """rich wraps words at the width on a terminal, or where COLUMNS says the width; piped
    (COLUMNS unset) each line goes out whole, however long."""
    console = Console(file=stream, highlight=False)
    console.soft_wrap = not (console.is_terminal or os.environ.get("COLUMNS", "").strip().isdigit())
    return console


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return None


def _flush(*streams) -> None:
    for stream in streams:
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass


def _escape(text: str) -> str:
    from ckptlab.render.text import safe

    return safe(text)


__all__ = ["Terminal", "json"]
