"""`ckptlab replay`: replay a faulty step bit-exactly and point to its cause."""

from __future__ import annotations

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
    default=32,
    show_default=True,
    help="Extra replays for the deeper searches: the minimal culprit (fewest rows, then positions, "
    "that still fault), the transplant into a healthy batch, and the earlier step that doomed the "
    "root step. 0 skips them; the report says when a search ran out.",
)
def command(
    run_dir,
    step: int,
    as_json: bool,
    device,
    from_step,
    nproc,
    rank,
    trust_code: bool,
    no_trace: bool,
    no_counterfactuals: bool,
    budget: int,
) -> None:
    """Replay a recorded step and explain what went wrong.

    Rebuilds the model with the recorded build_fn, loads the checkpoint before the fault,
    re-runs the recorded steps with the recorded batches (checking every loss bit for bit),
    finds the root step, traces it per op, and names the layer, op, parameter and data
    sample behind the fault -- or says that the fault did not reproduce.

    A distributed (DDP/FSDP) run replays on as many processes as it was recorded with (gloo on
    the CPU, NCCL on GPUs) and names the rank the fault came in on.

    This imports and runs the run's recorded build_fn/step_fn, and nothing else, only when
    they are your own files, unchanged since recording (it says which file runs); anything
    else needs --trust-run-code.
    """
    from ckptlab.render.replay import render
    from ckptlab.replayer import replay
    from ckptlab.run.reader import open_run

    term = open_terminal(as_json)
    run = open_run(find_run(run_dir, term))
    with term.progress(f"replaying up to step {step}") as update:
        report = replay(
            run,
            step,
            device=device,
            from_step=from_step,
            trace=not no_trace,
            counterfactuals=not no_counterfactuals,
            rank=rank,
            nproc=nproc,
            trust_code=trust_code,
            budget=budget,
            log=lambda msg: update(description=msg),
            progress=lambda done, total: update(done, total=total),
        )
    for note in report.notes:
        term.warn(note)
    if as_json:
        term.json(report.to_json())
    else:
        render(report, term)
