"""Options and helpers shared by the subcommands."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import click

from ckptlab.errors import CorruptFileError, NotARunError

RUN_HELP = "Run directory (default: $CKPTLAB_RUN, else the most recently written run under ./runs/)."

run_option = click.option("--run", "run_dir", type=click.Path(path_type=Path), default=None, help=RUN_HELP)
# The opt-in of training/userfns.py's trust rule (the flag and variable are named there too).
trust_option = click.option(
    "--trust-run-code",
    "trust_code",
    is_flag=True,
    envvar="CKPTLAB_TRUST_RUN_CODE",
    help="Run the run's recorded build_fn/step_fn even when they are not your own unchanged files "
    "(missing here, edited since recording, or only inside the run). Also: CKPTLAB_TRUST_RUN_CODE=1.",
)
# A run written more than this far in the future (a downloaded run's clock) is never picked
# as the latest one under ./runs.
FUTURE_SLACK_S = 60.0

json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document on stdout (notes go to stderr)."
)


def open_terminal(as_json: bool):
    """The command's Terminal. With --json it holds stdout for the JSON document alone (the
    user's code and child processes print to stderr: render/console.py `StdoutClaim`) until
    the command ends, however it ends. ckptlab's log records go to its stderr meanwhile
    (`TerminalLog`)."""
    from ckptlab.render.console import Terminal

    term = Terminal(json_mode=as_json)
    ctx = click.get_current_context(silent=True)
    if ctx is not None:  # click closes the context however the command ends
        if as_json:
            term.claim_stdout()
            ctx.call_on_close(term.close)
        ctx.call_on_close(TerminalLog.install(term))
    return term


class TerminalLog(logging.Handler):
    """The one handler on the `ckptlab` logger while a command runs: each record's message
    (a failing tracker, which recorded code replay runs) as a line on the command's stderr,
    through its Terminal, so --json keeps stdout for the document. The library only logs;
    showing is the CLI's part (where no handler is set, Python's last resort prints warnings)."""

    def __init__(self, term):
        super().__init__()
        self.term = term

    @classmethod
    def install(cls, term):
        """Put a handler for `term` on the `ckptlab` logger (in place of an earlier command's)
        and return what takes it off."""
        logger = logging.getLogger("ckptlab")
        for old in [h for h in logger.handlers if isinstance(h, cls)]:
            logger.removeHandler(old)
        handler = cls(term)
        logger.addHandler(handler)
        return lambda: logger.removeHandler(handler)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.term.line(record.getMessage())
        except Exception:  # noqa: BLE001 - logging's own policy for a handler that fails
            self.handleError(record)


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
    now = time.time()
    future = [d for d in candidates if last_written(d) > now + FUTURE_SLACK_S]
    for d in future:
        term.warn(f"ignoring {d}: written in the future (its files' times are after now); pass --run to use it")
    candidates = [d for d in candidates if d not in future]
    if not candidates:
        raise NotARunError("no run given and none found under ./runs", hint="pass --run DIR or set CKPTLAB_RUN")
    newest = max(candidates, key=last_written)
    term.note(f"using run {newest} (the most recently written under ./runs; pass --run to choose)")
    return newest


def end_with_problems(problems: list[str], damaged: list[str], term) -> None:
    """After a command's results: a warning for each problem the run's files have (a crash's
    torn tail), then, if anything is damaged, fail with the first damage as the one error line
    (exit 1): the results stand, but the run is not intact."""
    for problem in problems:
        if problem not in damaged[:1]:
            term.warn(problem)
    if damaged:
        more = len(damaged) - 1
        raise CorruptFileError(damaged[0] + (f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""))
