"""Options and helpers shared by the subcommands."""

from __future__ import annotations

import os
from pathlib import Path

import click

from ckptlab.errors import NotARunError

RUN_HELP = "Run directory (default: $CKPTLAB_RUN, else the most recently written run under ./runs/)."

run_option = click.option("--run", "run_dir", type=click.Path(path_type=Path), default=None, help=RUN_HELP)
json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document on stdout (notes go to stderr)."
)


def find_run(run_dir: Path | None, term) -> Path:
    """--run, else $CKPTLAB_RUN, else the most recently written run under ./runs/."""
    if run_dir is not None:
        return run_dir
    env = os.environ.get("CKPTLAB_RUN")
    if env:
        return Path(env)
    from ckptlab.run.layout import is_run, last_written

    root = Path("runs")
    candidates = [d for d in root.iterdir() if is_run(d)] if root.is_dir() else []
    if not candidates:
        raise NotARunError("no run given and none found under ./runs", hint="pass --run DIR or set CKPTLAB_RUN")
    newest = max(candidates, key=last_written)
    term.note(f"using run {newest} (the most recently written under ./runs; pass --run to choose)")
    return newest
