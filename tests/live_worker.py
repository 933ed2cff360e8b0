"""A run recorded live while readers read it (tests/run/test_live_readers.py).

    python -c "from tests import live_worker; live_worker.record()" RUN_DIR SECONDS [STOP_FILE]
    python -c "from tests import live_worker; live_worker.read()" RUN_DIR KIND SECONDS OUT.jsonl

`record` trains a tiny MLP for SECONDS (or until STOP_FILE exists) with a checkpoint every CKPT_EVERY steps and
retention keeping KEEP_LAST (so it prunes all the time); a NaN planted in sample NAN_ID of
step NAN_STEP makes that step's loss non-finite, and the step function skips the update of a
non-finite loss (as a GradScaler would), so the run goes on healthily after it. Retention
keeps the episode (the last healthy checkpoint before it, and its batches) for good.

`read` runs ckptlab commands on RUN_DIR in a loop, in this one process (click's test runner:
no interpreter start per call), and writes one JSON line per call to OUT: the command, its
exit code and its output.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import ckptlab
from tests.models import MLP

CKPT_EVERY = 5
KEEP_LAST = 2
NAN_STEP = 40
NAN_ROW = 3
ROWS = 8
STEP_PAUSE = 0.01  # seconds between steps: a bounded run (~2k steps a minute), many checkpoints


def sample_ids(step: int) -> list[int]:
    return [1000 * step + r for r in range(ROWS)]


def build():
    torch.manual_seed(0)
    model = MLP()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step_fn(model, optimizer, batch):
    x, y = batch
    loss = F.mse_loss(model(x), y)
    if not torch.isfinite(loss):  # skip the update, as a GradScaler skips an overflowed step
        optimizer.zero_grad(set_to_none=True)
        return loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def plain_step(model, optimizer, batch):
    """A step without the skip: a non-finite loss poisons the weights for good."""
    x, y = batch
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def make_batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(ROWS, 8, generator=g)
    y = x[:, :1] * 0.5 + 0.1 * torch.randn(ROWS, 1, generator=g)
    if step == NAN_STEP:
        x[NAN_ROW, 2] = float("nan")
    return x, y


def record() -> None:
    run_dir, seconds = sys.argv[1], float(sys.argv[2])
    stop = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    model, opt = build()
    deadline = time.monotonic() + seconds
    with ckptlab.Recorder(
        run_dir,
        model,
        opt,
        step_fn=step_fn,
        build_fn=build,
        ckpt_every=CKPT_EVERY,
        keep_last=KEEP_LAST,
        on_nonfinite="record",
        on_anomaly=None,
    ) as rec:
        step = 0
        while time.monotonic() < deadline and not (stop is not None and stop.exists()):
            rec.step(make_batch(step), sample_ids=sample_ids(step))
            step += 1
            time.sleep(STEP_PAUSE)
    print(f"recorded {step}", flush=True)


COMMANDS = {
    "info": [["info", "--json"]],
    "report": [["report", "--json"], ["dirty", "--json"]],
    "replay": [["replay", "--step", str(NAN_STEP), "--json", "--no-counterfactuals"], ["replay", "--latest"]],
}


def read() -> None:
    from click.testing import CliRunner

    from ckptlab.cli import cli
    from ckptlab.errors import CkptlabError

    run_dir, kind, seconds, out = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    runner = CliRunner()
    deadline = time.monotonic() + seconds
    i = 0
    with open(out, "a") as f:  # noqa: PTH123 - a test's own log
        while time.monotonic() < deadline:
            args = COMMANDS[kind][i % len(COMMANDS[kind])]
            i += 1
            for _ in range(5):  # a recent step: retention may prune it before the replay holds it
                called = args
                if args[-1] == "--latest":  # the step after the latest checkpoint
                    called = ["replay", "--step", str(_recent_step(run_dir)), "--json", "--no-counterfactuals"]
                line = _call(runner, cli, CkptlabError, run_dir, called)
                if args[-1] != "--latest" or "pruned by retention" not in line.get("error", ""):
                    break
            f.write(json.dumps(line) + "\n")
            f.flush()


def _call(runner, cli, error_type, run_dir: str, args: list[str]) -> dict:
    result = runner.invoke(cli, [*args[:1], "--run", run_dir, *args[1:]])
    line = {"args": args, "code": result.exit_code, "out": result.stdout, "err": result.stderr[-2000:]}
    e = result.exception
    if isinstance(e, error_type):  # what `ckptlab` prints as "ckptlab: error: ..."
        line["error"] = str(e)
    elif e is not None and not isinstance(e, SystemExit):  # "internal error"
        line["internal"] = f"{type(e).__name__}: {e}"
    return line


def _recent_step(run_dir: str) -> int:
    from ckptlab.run.reader import open_run

    steps = open_run(run_dir).checkpoints
    return steps[-1] + 1 if steps else NAN_STEP
