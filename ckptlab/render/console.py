"""The one terminal object all CLI output goes through.

stdout carries results (tables, or with --json only the JSON document); stderr carries notes,
warnings and errors, so `ckptlab replay --json > out.json` always yields valid JSON.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Any

from rich.console import Console

from ckptlab.render.jsonout import dumps


class Terminal:
    def __init__(self, *, json_mode: bool = False, quiet: bool = False):
        self.json_mode = json_mode
        self.quiet = quiet
        self.out = Console(file=sys.stdout, highlight=False, soft_wrap=True)
        self.err = Console(file=sys.stderr, highlight=False, soft_wrap=True)

    def print(self, *renderables: Any, **kwargs) -> None:
        """A result for stdout (suppressed in --json mode, where only the JSON goes there)."""
        if not self.json_mode:
            self.out.print(*renderables, **kwargs)

    def json(self, obj: Any) -> None:
        sys.stdout.write(dumps(obj) + "\n")
        sys.stdout.flush()

    def note(self, message: str) -> None:
        if not self.quiet:
            self.err.print(f"[dim]{_escape(message)}[/dim]")

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
        (as bytes and a transfer rate with `in_bytes`), a spinner until then; silent (and
        free) when not a terminal, --json or quiet."""
        if self.quiet or self.json_mode or not self.err.is_terminal:
            yield lambda done=None, total=None, description=None: None
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TransferSpeedColumn,
        )

        counts = (DownloadColumn(), TransferSpeedColumn()) if in_bytes else (MofNCompleteColumn(),)
        columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), *counts, TimeElapsedColumn())
        with Progress(*columns, console=self.err, transient=True) as bar:
            task = bar.add_task(_escape(description), total=total)

            def update(done: int | None = None, total: int | None = None, description: str | None = None) -> None:
                changes = {}
                if done is not None:
                    changes["completed"] = done
                if total is not None:
                    changes["total"] = total
                if description is not None:
                    changes["description"] = _escape(description)
                bar.update(task, **changes)

            yield update


def _escape(text: str) -> str:
    from ckptlab.render.text import safe

    return safe(text)


__all__ = ["Terminal", "json"]
