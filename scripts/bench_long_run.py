"""How fast ckptlab's readers answer on a long run: `info`, `report --json`, `report --html`,
`dirty --json` and `export --tensorboard`, each as a user runs it (a process of its own),
on a run of 10^6 recorded steps, against the same command on a short run of the same model
(the baseline, timed in the same invocation), plus the run directory's bytes per step.

    PYTHONPATH=. python scripts/bench_long_run.py [--steps 1000000] [--keep /tmp/long-run]
        [--commands info,report,html,dirty,export] [--repeat 2]

The run is a 148-tensor GPT-style LM (scripts/bench_replay.py's, 12 layers x 32 wide: as
many parameter tensors as GPT-2 small, the number that sizes each step record) recorded
with the defaults (checkpoint every 500 steps, health every 10, keep the last 3):

  head    `--head` steps recorded by a Recorder (session 0);
  middle  the journal of steps head..steps-tail, in session 0's later segments, each with
          its summary (as the Recorder's writer leaves them): each step's record is one of
          the head's real records, re-encoded by the recorder's own encoder with its step,
          time, loss, gradient norm and learning rate moved along a training curve (a
          validation every 500 steps, a loss-spike episode at 60% of the run). That is what
          retention leaves of a long run's middle: the journal, kept whole;
  tail    `--tail` steps recorded by a Recorder resuming the run (session 1): checkpoints,
          batches and retention as in any run.

`--keep DIR` builds the run there (or re-uses it when DIR holds one), so the timing can be
repeated without building it again. The short baseline run is the head alone. Prints a
table and, last, one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

LM = {"layers": 12, "width": 32, "heads": 2, "seq": 32}
os.environ["CKPTLAB_BENCH_REPLAY_CFG"] = json.dumps(LM)

import torch  # noqa: E402

import bench_replay as lm  # noqa: E402
import ckptlab  # noqa: E402
from ckptlab.run import columns, framelog, records  # noqa: E402
from ckptlab.run.layout import dir_size, journal_dir, segment_name  # noqa: E402
from ckptlab.run.reader import open_run  # noqa: E402

CKPT_EVERY, VAL_EVERY, BATCH = 500, 500, 4


def _batches(first: int, n: int):
    g = torch.Generator().manual_seed(first)
    for s in range(first, first + n):
        ids = torch.randint(0, lm.VOCAB, (BATCH, LM["seq"] + 1), generator=g)
        yield s, {"ids": ids}, list(range(BATCH * s, BATCH * s + BATCH))


def _record(path: Path, first: int, n: int, *, resume: bool) -> float:
    """Record steps first..first+n-1 of `path`; seconds per step."""
    model, opt = lm.build()
    rec = ckptlab.Recorder(
        path, model, opt, step_fn=lm.step, build_fn=lm.build, ckpt_every=CKPT_EVERY, resume=resume, restore=False
    )
    assert rec.next_step == first, (rec.next_step, first)
    t0 = time.perf_counter()
    for s, batch, ids in _batches(first, n):
        rec.step(batch, sample_ids=ids)
        if (s + 1) % VAL_EVERY == 0:
            rec.log_validation(val_loss=_curve(s + 1) + 0.05)
    rec.close()
    return (time.perf_counter() - t0) / n


def _curve(s: int) -> float:
    return 2.0 + 6.0 * math.exp(-s / 150_000)


def _synthesize(path: Path, first: int, last: int, spike_at: int) -> None:
    """The journal of steps first..last-1 in session 0's segments, from the head's records."""
    run = open_run(path)
    m = run.metrics()
    templates = [
        (r, {k: getattr(m, k)[i] for k in ("param_grad_norm", "update_ratio", "weight_norm")})
        for i, r in enumerate(m.scalars)
    ]
    healthy = [(r, a) for r, a in templates if "update_ratio_global" not in r]
    measured = [(r, a) for r, a in templates if "update_ratio_global" in r]
    t0 = m.scalars[-1]["time"]
    rng = random.Random(0)
    writer: framelog.FrameWriter | None = None
    written: tuple[list, list] = ([], [])

    def close() -> None:  # closed and summarized, as the Recorder's writer leaves a segment
        assert writer is not None
        writer.close(fsync=False)
        summary = columns.encode(columns.Columns.from_records(*written), writer.bytes_written)
        columns.summary_path(writer.path).write_bytes(summary)  # (what write_summary writes, without decoding)

    for s in range(first, last):
        if writer is None or s % CKPT_EVERY == 0:
            if writer is not None:
                close()
            writer, written = framelog.FrameWriter(journal_dir(path) / segment_name(0, s)), ([], [])
        template = measured if s % 10 == 0 else healthy
        scalars, arrays = dict(template[s % len(template)][0]), template[s % len(template)][1]
        spike = 3.0 if spike_at <= s < spike_at + 5 else 1.0
        scalars.update(
            step=s,
            time=t0 + 0.03 * (s - first + 1),
            loss=(_curve(s) + rng.gauss(0, 0.05)) * spike,
            grad_norm=(0.8 + rng.random() * 0.4) * spike,
            lr=[3e-4 * 0.5 * (1 + math.cos(math.pi * s / last))],
        )
        keep = {"param_grad_norm": arrays["param_grad_norm"]}
        if s % 10 == 0:
            keep.update(update_ratio=arrays["update_ratio"], weight_norm=arrays["weight_norm"])
        writer.append(framelog.STEP, s, records.encode_step(scalars, keep), flags=framelog.FLAG_SAFETENSORS)
        written[0].append((s, scalars, keep))
        if (s + 1) % VAL_EVERY == 0:
            meta = {"metrics": {"val_loss": _curve(s + 1) + 0.05}}
            writer.append(framelog.VALIDATION, s + 1, records.encode_json(meta))
            written[1].append((framelog.VALIDATION, s + 1, meta))
    if writer is not None:
        close()


def build(path: Path, steps: int, head: int, tail: int) -> dict:
    t0 = time.perf_counter()
    head_s = _record(path, 0, head, resume=False)
    shutil.copytree(path, path.with_name(path.name + "-short"))
    _synthesize(path, head, steps - tail, spike_at=int(steps * 0.6))
    tail_s = _record(path, steps - tail, tail, resume=True)
    return {"build_s": round(time.perf_counter() - t0, 1), "recorded_step_ms": round(1000 * (head_s + tail_s) / 2, 2)}


def _cli(args: list[str], out: Path) -> tuple[float, float]:
    """Seconds and peak RSS (MiB: the child's own VmHWM) of `python -m ckptlab ARGS`, its
    output to `out`."""
    code = f"import runpy, sys; sys.argv = {['ckptlab', *args]!r}\n"
    code += "try:\n    runpy.run_module('ckptlab', run_name='__main__')\nfinally:\n"
    code += "    hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]\n"
    code += "    print(hwm, file=sys.stderr)"
    t0 = time.perf_counter()
    with open(out, "w") as f:
        done = subprocess.run([sys.executable, "-c", code], stdout=f, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    dt = time.perf_counter() - t0
    lines = done.stderr.strip().splitlines()
    if done.returncode not in (0, 1) or not lines or not lines[-1].isdigit():  # report exits 1 on findings
        raise SystemExit(f"ckptlab {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return dt, int(lines[-1]) / 1024


COMMANDS = {
    "info": lambda run, tmp: ["info", "--run", str(run)],
    "report": lambda run, tmp: ["report", "--run", str(run), "--json"],
    "html": lambda run, tmp: ["report", "--run", str(run), "--html", str(tmp / "report.html")],
    "dirty": lambda run, tmp: ["dirty", "--run", str(run), "--json"],
    "export": lambda run, tmp: ["export", "--run", str(run), "--tensorboard", str(tmp / "tb"), "--no-grads"],
}


def time_commands(run: Path, names: list[str], repeat: int) -> dict[str, dict]:
    out = {}
    for name in names:
        best = None
        for _ in range(repeat):
            with tempfile.TemporaryDirectory() as tmp:
                dt, rss = _cli(COMMANDS[name](run, Path(tmp)), Path(tmp) / "out.txt")
            best = (dt, rss) if best is None or dt < best[0] else best
        assert best is not None
        out[name] = {"s": round(best[0], 2), "rss_mib": round(best[1])}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--head", type=int, default=1000, help="steps recorded before the synthesized middle")
    ap.add_argument("--tail", type=int, default=2000, help="steps recorded after it (resumed)")
    ap.add_argument("--keep", type=Path, default=None, help="build the run here, or re-use the one there")
    ap.add_argument("--commands", default=",".join(COMMANDS))
    ap.add_argument("--repeat", type=int, default=2, help="runs of each command; the fastest is reported")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = [c for c in args.commands.split(",") if c]
    scratch = None
    if args.keep is None:
        scratch = Path(tempfile.mkdtemp(prefix="ckptlab-long-"))
        args.keep = scratch / "run"
    long_run, short_run = args.keep, args.keep.with_name(args.keep.name + "-short")
    built = {}
    if not (long_run / "manifest.json").exists():
        built = build(long_run, args.steps, args.head, args.tail)
    steps = len(open_run(long_run).metrics())
    size = dir_size(long_run)
    journal = dir_size(journal_dir(long_run))
    short = time_commands(short_run, names, args.repeat)
    long = time_commands(long_run, names, args.repeat)
    print(f"{'command':<8} {'short s':>8} {'long s':>8} {'ratio':>7} {'short MiB':>10} {'long MiB':>9}")
    for name in names:
        a, b = short[name], long[name]
        print(f"{name:<8} {a['s']:>8} {b['s']:>8} {b['s'] / a['s']:>7.1f} {a['rss_mib']:>10} {b['rss_mib']:>9}")
    print(
        f"run: {steps} steps, {size / 2**20:.0f} MiB ({size / steps:.0f} B/step; journal {journal / steps:.0f} B/step)"
    )
    result = {
        "steps": steps,
        "short_steps": len(open_run(short_run).metrics()),
        "bytes_per_step": round(size / steps),
        "journal_bytes_per_step": round(journal / steps),
        "short": short,
        "long": long,
        **built,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result))
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
