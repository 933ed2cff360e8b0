"""The `ckptlab` command. Subcommands live one per module and are imported only when run,
so `ckptlab --help` does not pay for importing torch.

Exit codes (every command): 0 done, 1 bad input or failure (one clear line on stderr),
2 usage error. `--debug` (or CKPTLAB_DEBUG=1) shows the traceback of a failure.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import click

COMMANDS = {
    "info": ("ckptlab.cli.info", "Summarize a run: steps, checkpoints (verified), anomalies, disk use."),
    "replay": ("ckptlab.cli.replay", "Replay a faulty step bit-exactly and point to its cause."),
    "diff": ("ckptlab.cli.diff", "Compare two checkpoints and rank the parameters that went wrong."),
    "dirty": ("ckptlab.cli.dirty", "Find dirty batches and samples; write a skip list."),
    "rollback": ("ckptlab.cli.rollback", "Roll back to the best-validation or last healthy checkpoint."),
    "report": ("ckptlab.cli.report", "Diagnose the training curves (terminal, JSON or HTML)."),
    "export": ("ckptlab.cli.export", "Export the run's health to TensorBoard, MLflow or Weights & Biases."),
    "show": ("ckptlab.cli.show", "Summarize a dump file written by replay --dump."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return [name for name, (module, _) in COMMANDS.items() if importlib.util.find_spec(module) is not None]

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module = COMMANDS[name][0]
        if importlib.util.find_spec(module) is None:
            return None
        return importlib.import_module(module).command

    def format_commands(self, ctx, formatter):
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show the full traceback when a command fails (also CKPTLAB_DEBUG=1).")
@click.version_option(package_name="ckptlab")
def cli(debug: bool) -> None:
    """ckptlab: checkpoint forensics and replay for PyTorch training.

    \b
    A command that needs a run finds it by --run DIR, else $CKPTLAB_RUN, else the most
    recently written run under ./runs/ (and says which it picked).
    """


def main(argv: list[str] | None = None) -> None:
    args = _debug_first(list(sys.argv[1:] if argv is None else argv))
    debug = args[:1] == ["--debug"] or os.environ.get("CKPTLAB_DEBUG") == "1"
    try:
        # With standalone_mode=False click *returns* the code of a command's
        # `raise click.exceptions.Exit(n)` instead of raising it.
        code = cli.main(args=args, prog_name="ckptlab", standalone_mode=False)
        if isinstance(code, int) and code:
            sys.exit(code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:  # usage errors exit 2, others 1
        e.show()
        sys.exit(e.exit_code)
    except click.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)
    except BrokenPipeError:
        sys.stderr.close()
        sys.exit(1)
    except Exception as e:  # noqa: BLE001 - rendered once, here, as one line
        from ckptlab.errors import CkptlabError

        if debug:
            import traceback

            traceback.print_exc()
        if isinstance(e, CkptlabError):
            click.echo(f"ckptlab: error: {e}", err=True)
        else:
            click.echo(
                f"ckptlab: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)",
                err=True,
            )
        sys.exit(1)
    sys.exit(0)


def _debug_first(args: list[str]) -> list[str]:
    """`--debug` anywhere before a `--` (`ckptlab replay ... --debug`, as one types it after
    a failure) moved in front of the command, where the group's option is."""
    end = args.index("--") if "--" in args else len(args)
    if "--debug" not in args[:end]:
        return args
    return ["--debug", *(a for a in args[:end] if a != "--debug"), *args[end:]]
