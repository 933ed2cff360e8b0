"""`ckptlab show`: what a dump file written by `ckptlab replay --dump` holds."""

from __future__ import annotations

from pathlib import Path

import click

from ckptlab.cli.common import json_option, open_terminal


@click.command("show")
@click.argument("path", type=click.Path(path_type=Path))
@json_option
def command(path: Path, as_json: bool) -> None:
    """Summarize a dump file (FILE.h5 from `ckptlab replay --dump`).

    \b
    The fault it was written for (step, origin op, verdict), where the origin's first
    non-finite outputs came from, then every tensor in the file: role (origin input/output,
    batch, a module's forward output or gradient, a parameter's gradient), phase, op, source
    line, shape, dtype and its first non-finite elements; and what was left out (over
    --dump-max-bytes). Read the tensors with h5py: docs/replay.md gives the layout.
    """
    from ckptlab.render.show import render
    from ckptlab.run.dumpfile import read_dump

    term = open_terminal(as_json)
    dump = read_dump(path)
    if as_json:
        term.json(dump)
    else:
        render(dump, term)
