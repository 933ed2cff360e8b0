"""`ckptlab diff A [B]`: compare two checkpoints and name the parameter that went wrong."""

from __future__ import annotations

import os
import re

import click

from ckptlab.cli.common import find_run, json_option, open_terminal, run_option


def _regex(ctx, param, value):
    if value is None:
        return None
    try:
        return re.compile(value)
    except re.error as e:
        raise click.BadParameter(f"not a regular expression: {e}") from None


@click.command("diff")
@click.argument("a")
@click.argument("b", required=False)
@click.option(
    "--select",
    metavar="REGEX",
    callback=_regex,
    help="Only tensors whose name matches REGEX (searched anywhere in the name).",
)
@click.option(
    "--hist",
    "hist_name",
    metavar="NAME",
    help="Show the value histogram of NAME (default: of the offending parameter).",
)
@click.option(
    "--plot",
    "plot_path",
    metavar="FILE.png",
    type=click.Path(dir_okay=False),
    help="Save A-vs-B histograms of the top tensors as an image (needs matplotlib: pip install matplotlib).",
)
@click.option(
    "--all",
    "show_all",
    is_flag=True,
    help="List every tensor in the table (default: flagged layers and the top of the ranking when there are many).",
)
@click.option(
    "--sequential",
    is_flag=True,
    envvar="CKPTLAB_SEQUENTIAL",
    help="Read files with plain sequential reads instead of mmap: for network filesystems, where mmap is slow or can crash (SIGBUS) if a file changes. Also CKPTLAB_SEQUENTIAL=1.",
)
@click.option(
    "--no-verify",
    is_flag=True,
    help="Do not check RUN@STEP checkpoints against their recorded sha256 (faster on big runs).",
)
@click.option(
    "--workers",
    type=click.IntRange(1, 64),
    envvar="CKPTLAB_WORKERS",
    default=None,
    help="Workers to use (default: the available cores, at most 8): processes for a diff of 128 MiB or more "
    "of files on Linux, threads otherwise (CKPTLAB_PROCESSES=0: always threads). Also CKPTLAB_WORKERS.",
)
@run_option
@json_option
def command(a, b, select, hist_name, plot_path, show_all, sequential, no_verify, workers, run_dir, as_json) -> None:
    """Compare checkpoint A with B, tensor by tensor, and rank what went wrong.

    \b
    A and B are .pt/.pth/.bin or .safetensors files, Hugging Face sharded folders,
    torch.distributed.checkpoint folders, ckptlab runs (their latest checkpoint) or
    RUN@STEP / RUN@latest; @STEP alone is a step of the run found as --run says.
    Without B: the health of A alone (non-finite, extreme, dead).

    \b
    Per tensor: NaN/Inf counts, mean, std, extremes, norms of A, B and B-A, the update ratio
    ||B-A||/||A||, cosine, the share unchanged, the largest change and where, quantiles and
    the Wasserstein-1 distance. Ranked: non-finite, exploded, jumped (a matrix that moved >= 10x
    its own norm), drifted (an update ratio far from the same parameter's in other layers), dead,
    frozen; a shape change is the headline before them. --json prints the findings (keys a,
    b, verdict, ranked, missing, unexpected, mismatched). Exits 0 when done, whatever was found.
    """
    from ckptlab.analysis.diff import diff
    from ckptlab.io import open_checkpoint
    from ckptlab.render import diff as view

    term = open_terminal(as_json)
    a, b = (f"{find_run(run_dir, term)}{ref}" if ref and ref.startswith("@") else ref for ref in (a, b))
    sd_a = open_checkpoint(a, sequential=sequential, verify=not no_verify)
    sd_b = open_checkpoint(b, sequential=sequential, verify=not no_verify) if b is not None else None
    try:
        total = sd_a.nbytes + (sd_b.nbytes if sd_b is not None else 0)
        with term.progress("comparing", total, in_bytes=True) as update:
            read = [0]

            def advance(n: int) -> None:
                read[0] += n
                update(read[0])

            findings = diff(sd_a, sd_b, select=select, sequential=sequential, workers=workers, progress=advance)
    finally:
        sd_a.close()
        if sd_b is not None:
            sd_b.close()
    if hist_name and findings.finding(hist_name) is None:
        raise click.BadParameter(
            f"no compared tensor is named {hist_name!r}{_suggest(hist_name, findings)}", param_hint="--hist"
        )
    if as_json:
        for note in findings.notes:  # (also in the JSON; said on stderr as in the terminal view)
            term.note(note)
        term.json(findings)
    else:
        view.render(findings, term, hist=hist_name, show_all=show_all)
    if plot_path:
        names = [hist_name] if hist_name else [x.name for x in findings.ranked[:4]]
        view.plot(findings, plot_path, names=names)
        term.note(f"wrote {os.fspath(plot_path)}")


def _suggest(name: str, findings) -> str:
    import difflib

    close = difflib.get_close_matches(name, [x.name for x in findings.ranked], n=3)
    return f" (did you mean {', '.join(close)}?)" if close else ""
