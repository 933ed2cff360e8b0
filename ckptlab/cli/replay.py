"""`ckptlab replay`: replay a faulty step bit-exactly and point to its cause."""

from __future__ import annotations

import os
from pathlib import Path

import click

from ckptlab.cli.common import find_run, json_option, open_terminal, run_option, trust_option


@click.command("replay")
@run_option
@click.option("--step", "step", type=int, required=True, help="The step to explain (e.g. where the loss went NaN).")
@json_option
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default=None,
    help="Where to replay (default: where the run was recorded). cuda applies deterministic CUDA settings.",
)
@click.option(
    "--from-step", type=int, default=None, help="Start from this checkpoint instead of the one ckptlab picks."
)
@click.option(
    "--nproc",
    type=int,
    default=None,
    help="Distributed runs: the number of processes to replay on (must equal the recorded world size; default: that).",
)
@click.option(
    "--world-size",
    "world_size",
    type=click.IntRange(min=1),
    default=None,
    help="Distributed (DDP, FSDP2) runs: replay on this many processes, fewer than the run's (a divisor of it): 1 "
    "replays every rank's micro-batches in turn in this process and averages their gradients as the recorded "
    "all-reduce or reduce-scatter did (FSDP2: the checkpoint resharded onto them). "
    "Under torchrun, the job's processes are these (WORLD_SIZE must equal it). Refused up front when the processes "
    "would need more memory than the machine has.",
)
@click.option(
    "--rank",
    type=int,
    default=None,
    help="Distributed runs: replay only this rank's micro-batches in one process (a quick look, not bit-exact).",
)
@trust_option
@click.option("--no-trace", is_flag=True, help="Skip the per-op trace of the root step.")
@click.option(
    "--no-counterfactuals",
    is_flag=True,
    help="Skip the counterfactual re-runs (without the blamed rows; from an older state) and the --budget searches.",
)
@click.option(
    "--budget",
    type=click.IntRange(min=0),
    default=32,  # replayer.search.DEFAULT_BUDGET (not imported here: it imports torch); a test ties them
    show_default=True,
    help="Extra replays for the deeper searches: the minimal culprit (fewest rows, then positions, "
    "that still fault), the transplant into a healthy batch, and the earlier step that doomed the "
    "root step. 0 skips them; the report says when a search ran out.",
)
@click.option(
    "--dump",
    "dump_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the root step's tensors to this HDF5 file: the origin op's inputs and outputs, the batch, "
    "the selected modules' outputs and gradients, with an index (docs/replay.md). Read it with `ckptlab show FILE`.",
)
@click.option(
    "--dump-select",
    metavar="REGEX",
    default=None,
    help="--dump: only the modules whose path matches this regular expression (re.search; default: every module).",
)
@click.option(
    "--dump-max-bytes",
    metavar="BYTES",
    default=None,
    show_default="1G",
    help="--dump: at most this many bytes of tensors (uncompressed; 500M, 2G also work); the rest is listed as left out.",
)
@click.option("--force", is_flag=True, help="--dump: replace the file if it exists.")
@click.option(
    "--profile",
    "profile",
    is_flag=False,
    flag_value="",
    default=None,
    metavar="[FILE]",
    help="Then replay the step (and a neighbour) timed and under torch.profiler: its slowest ops and modules with "
    "their source lines, its time against the recorded step_time, and whether its slowness came back on replay (the "
    "step's own) or not (the environment's); a healthy but slow step too. JSON key `profile`; writes a Chrome trace "
    "to FILE (a new file: never overwritten), by default RUN/profiles/step-N.json.",
)
def command(
    run_dir,
    step: int,
    as_json: bool,
    device,
    from_step,
    nproc,
    world_size,
    rank,
    trust_code: bool,
    no_trace: bool,
    no_counterfactuals: bool,
    budget: int,
    dump_path: Path | None,
    dump_select: str | None,
    dump_max_bytes: str | None,
    force: bool,
    profile: str | None,
) -> None:
    """Replay a recorded step and explain what went wrong.

    Rebuilds the model with the recorded build_fn, loads the checkpoint before the fault,
    re-runs the recorded steps with the recorded batches (each loss and gradient norm checked:
    bit-exact, equivalent within round-off and why the bits differ, or diverged), finds the root
    step, traces it per op, and names the layer, op, parameter and data sample behind the fault
    -- or says that the fault did not reproduce, and why: the first step that left the record is
    replayed twice with a hash of every op's output, which names the first nondeterministic op,
    or shows the state changed outside step_fn. --dump FILE.h5 also writes the root step's
    tensors to an HDF5 file (`ckptlab show FILE.h5`).

    A distributed (DDP/FSDP) run replays on its processes (--world-size 1: all in this one) and names the
    rank the fault came in on; under torchrun each process replays its rank, rank 0 prints the report.

    This imports and runs the run's recorded build_fn/step_fn, and nothing else, only when
    they are your own files, unchanged since recording (it says which file runs); anything
    else needs --trust-run-code.
    """
    dump = dump_request(dump_path, dump_select, dump_max_bytes, force, no_trace)
    term = open_terminal(as_json)
    run, follower = _open_with_step(run_dir, step, rank, term)
    report = _replay(
        run,
        step,
        term,
        device=device,
        from_step=from_step,
        trace=not no_trace,
        counterfactuals=not no_counterfactuals,
        rank=rank,
        nproc=nproc,
        world_size=world_size,
        trust_code=trust_code,
        budget=budget,
        dump=dump,
        profile=Path(profile) if profile else profile == "",  # ("": --profile with no FILE)
    )
    if not follower:  # (a launched job's rank other than 0: rank 0 says it)
        _say(report, term, as_json)
        if _nothing_to_explain(report):
            _point_to_anomalies(run, step, term)


def _nothing_to_explain(report) -> bool:
    """A step healthy when recorded and when replayed, the replay following the record (else
    the verdict says why not)."""
    followed = report.deterministic or report.agreement == "equivalent"
    return not report.fault_recorded and report.root_step is None and followed


def _open_with_step(run_dir, step: int, rank: int | None, term):
    """The run that holds `step` (`_run_with_step`), and whether this process is a launched
    job's rank other than 0 (it then prints nothing but errors: rank 0 prints the report)."""
    run = _open(run_dir, term)
    from ckptlab.training.world import launched  # (after _open: it imports torch)

    launch = launched()
    term.quiet = follower = launch is not None and not launch.is_main
    run = _run_with_step(run, step, picked=run_dir is None and not os.environ.get("CKPTLAB_RUN"), term=term)
    if launch is not None and launch.size > 1 and (rank is not None or run.world_size == 1):
        alone = f"--rank {rank}" if rank is not None else "a run recorded on one process"
        raise click.UsageError(
            f"{alone} replays in one process, and this is one of {launch.size} that a launcher started "
            "(torchrun): run it without the launcher"
        )
    for problem in [] if follower else run.problems:  # known on opening: a rollback that was interrupted
        term.warn(problem)
    return run, follower


def _open(run_dir, term):
    """The run, opened once the CPU kernels it was recorded with are pinned (before torch
    loads: run.reader imports it)."""
    found = find_run(run_dir, term)
    _pin_recorded_kernels(found)
    from ckptlab.run.reader import open_run

    return open_run(found)


def _pin_recorded_kernels(run_dir) -> None:
    """A run recorded with its CPU kernels pinned (`ckptlab.portable_cpu()`) replays with the
    same pins, set before torch loads (it reads them once); a variable the user set wins."""
    import sys

    from ckptlab.errors import CkptlabError
    from ckptlab.run.environment import pinned
    from ckptlab.run.manifest import read_manifest

    if "torch" in sys.modules:  # in-process (tests, ckptlab.replay): too late; environment_diff says so
        return
    try:
        manifest = read_manifest(Path(run_dir))
    except CkptlabError:
        return  # open_run says what is wrong
    for name, value in pinned(manifest.get("environment")).items():
        os.environ.setdefault(name, value)


# --- a step that is not the fault: say where the faults are (#31) ----------------------------------

SHOWN_ANOMALIES = 5  # anomalous steps named in the pointer after a healthy step
SIBLINGS_SCANNED = 100  # runs beside the chosen one that are searched for a step it lacks


def _has_step(run, step: int) -> bool:
    """The step is in the run's record (a batch kept, or its health measured): what replay needs."""
    return run.metrics().index(step) is not None or step in run.steps


def _run_with_step(run, step: int, *, picked: bool, term):
    """`run` if it recorded `step`. Else the runs beside it (the same parent folder) that did:
    when ckptlab picked `run` itself (no --run, no $CKPTLAB_RUN) and exactly one other run has
    the step, that run, said on stderr; otherwise a ReplayError naming the runs that have it
    and the command to replay it there."""
    from ckptlab.errors import CkptlabError, ReplayError
    from ckptlab.run.layout import is_run
    from ckptlab.run.reader import open_run

    if _has_step(run, step):
        return run
    others = []
    parent = run.path.parent if run.path.name else run.path.resolve().parent  # (--run . : the folder above)
    beside = sorted(d for d in parent.iterdir() if d.is_dir() and d.resolve() != run.path.resolve())
    for d in beside[:SIBLINGS_SCANNED]:
        try:
            if is_run(d) and _has_step(other := open_run(d), step):
                others.append(other)
        except (CkptlabError, OSError):  # a damaged or unreadable neighbour is not our answer
            continue
    missing = run.missing_step(step)
    if picked and len(others) == 1:
        term.note(f"{run.path}: {missing}; using run {others[0].path} instead, the run beside it that has step {step}")
        return others[0]
    if not others:
        raise ReplayError(missing, path=run.path)
    names = ", ".join(str(o.path) for o in others[:SHOWN_ANOMALIES]) + (
        ", ..." if len(others) > SHOWN_ANOMALIES else ""
    )
    has = "has" if len(others) == 1 else "have"
    raise ReplayError(
        f"{missing}; {names} {has} step {step}",
        path=run.path,
        hint=f"replay it there: ckptlab replay --run {_arg(others[0].path)} --step {step}",
    )


def _point_to_anomalies(run, step: int, term) -> None:
    """After a step that was healthy when recorded and replayed: where the run's anomalies are,
    and the command that explains the nearest (the first after `step`, else the last before)."""
    from ckptlab.analysis.anomalies import RECORD_WARNINGS  # (no fault: replay's notes say them)

    kinds: dict[int, list[str]] = {}
    for e in run.events():
        if e.get("kind") not in RECORD_WARNINGS:
            kinds.setdefault(int(e["step"]), []).append(str(e.get("kind")))
    say = term.line  # on stderr, as the notes (--json keeps stdout for the document)
    if not kinds:
        say(f"The run recorded no anomaly: step {step} replayed as recorded, and there is nothing else to explain.")
        return
    steps = sorted(kinds)
    shown = ", ".join(f"{s} ({', '.join(dict.fromkeys(kinds[s]))})" for s in steps[:SHOWN_ANOMALIES])
    more = f", ... ({len(steps)} steps in all; ckptlab info lists them)" if len(steps) > SHOWN_ANOMALIES else ""
    nearest = next((s for s in steps if s > step), steps[-1])
    at = "step" if len(steps) == 1 else "steps"
    say(f"Step {step} is not where the run went wrong: anomalies were recorded at {at} {shown}{more}.")
    say(f"To explain step {nearest}: ckptlab replay --run {_arg(run.path)} --step {nearest}")


def _arg(path) -> str:
    """A path as a shell word (quoted when it needs to be)."""
    import shlex

    return shlex.quote(str(path))


def _replay(run, step: int, term, **options):
    """`replayer.replay`, its progress shown on the terminal (nothing under --json)."""
    from ckptlab.replayer import replay

    with term.progress(f"replaying up to step {step}") as update:
        return replay(
            run,
            step,
            log=lambda msg: update(description=msg),
            progress=lambda done, total: update(done, total=total),
            **options,
        )


def _say(report, term, as_json: bool) -> None:
    """The report's notes on stderr, then the report: JSON, or the terminal view."""
    from ckptlab.render.replay import render

    for note in report.notes:
        term.warn(note)
    if as_json:
        term.json(report.to_json())
    else:
        render(report, term)


def dump_request(path: Path | None, select: str | None, max_bytes: str | None, force: bool, no_trace: bool):
    """The --dump options as a DumpRequest (None without --dump); bad values are usage errors."""
    if path is None:
        if select is not None or max_bytes is not None or force:
            raise click.UsageError("--dump-select, --dump-max-bytes and --force go with --dump FILE.h5")
        return None
    if no_trace:
        raise click.UsageError("--dump needs the per-op trace (it finds the origin op): drop --no-trace")
    if select is not None:
        import re

        try:
            re.compile(select)
        except re.error as e:
            raise click.BadParameter(f"not a regular expression: {e}", param_hint="--dump-select") from None
    from ckptlab.replayer.dump import DumpRequest

    sized = {"max_bytes": parse_bytes(max_bytes)} if max_bytes is not None else {}
    return DumpRequest(path, select=select, force=force, **sized)


def parse_bytes(text: str) -> int:
    """'1000', '500M', '2G', '64k' (powers of 1000: as the default's "1G" = 10**9)."""
    units = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    t = text.strip().upper().removesuffix("B")
    unit = t[-1:] if t[-1:] in units and t[-1:] else ""
    try:
        value = float(t[: len(t) - len(unit)]) * units[unit]
    except ValueError:
        value = -1
    if not value >= 0 or value != value or value > 2**62:
        raise click.BadParameter(
            f"{text!r} is not a size in bytes (e.g. 1000000, 500M, 2G)", param_hint="--dump-max-bytes"
        )
    return int(value)
