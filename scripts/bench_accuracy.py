"""Blame accuracy: ckptlab replay against torch.autograd.detect_anomaly and first-NaN module
hooks, on every planted fault of the zoo (tests/fault_zoo.py), scored against its ground truth.

    python scripts/bench_accuracy.py               # all scenarios: tables, summary, one JSON line
    python scripts/bench_accuracy.py --only dead_relu
    python scripts/bench_accuracy.py --only token_sgd     # an earlier-cause scenario (tests/earlier_zoo.py)

For each scenario: record the run (a temp dir), then ask each method about the symptom step.
- ckptlab: `ckptlab.replay(run, symptom)`; its claims are root_step, origin.kind,
  origin.module, origin.parameter, the blamed samples, and `reproduced`.
- detect_anomaly: the training re-run from the run's oldest retained checkpoint (step 0 unless
  retention pruned it; the recorded build_fn, step_fn, scheduler and batches) under `torch.autograd.detect_anomaly()`; its claims are the step at which it
  raised and the module of the forward call in its traceback (read as a person would: the
  frames' `self.<name>(...)` calls, from the root model down; the first instance when a
  traceback cannot tell which).
- first-NaN hooks: the same re-run with a forward hook on every module and a full backward hook
  on every leaf module; its claims are the step and the module of the first non-finite output
  (forward hooks fire innermost first) or, failing that, the first non-finite input gradient.
Neither baseline can name a kind, a parameter or a sample: those cells are "-" (not claimed).
The earlier-cause zoo (tests/earlier_zoo.py) is scored on the step each method points to as
the cause (ckptlab: `rewind.step`, the step whose removal prevents the fault; a baseline: the
step it stopped at), the cause's sample ids (ckptlab only) and whether the fault reproduced.
A method that does not see the fault again (a baseline that finds nothing up to the symptom
step, replay with `reproduced: false`) claims "not reproduced", a root step (replay: the
record's; a baseline: none, a miss), and no module ("-"). Docs: docs/accuracy.md.
"""

from __future__ import annotations

import argparse
import json
import linecache
import re
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ckptlab  # noqa: E402
from ckptlab.replayer.driver import Replayer  # noqa: E402
from tests.earlier_zoo import EARLIER  # noqa: E402
from tests.fault_zoo import SCENARIOS  # noqa: E402

METHODS = ("ckptlab", "detect_anomaly", "nan_hooks")
COLUMNS = ("root_step", "kind", "module", "parameter", "samples", "reproduced")
# The earlier-cause zoo (tests/earlier_zoo.py): the step a method points to as the cause (for
# ckptlab, `rewind.step`; for a baseline, the step it stopped at), the cause's sample ids.
EARLIER_COLUMNS = ("earlier_cause", "cause_samples", "reproduced")
NOT_CLAIMED = object()


# --- re-running the recorded training (the baselines' view) ---------------------------------------


class Raised(list):
    """A re-run whose step raised before anything was flagged: the step, and what a person
    reads off the traceback (the module of the forward call in it, the exception)."""

    def __init__(self, step: int, module: str | None, error: BaseException):
        super().__init__([step])
        self.step, self.module, self.error = step, module, error


def rerun(run, last: int, around_step):
    """Re-run the recorded training from the run's oldest retained checkpoint (step 0 unless
    retention pruned it) to `last`: the recorded build_fn, step_fn, scheduler and batches, and
    the learning rate each step ran with (as the recorded loop set it, a schedule by hand
    included), the state restored by ckptlab's Replayer (the same restoration replay gets).
    Each step runs inside `around_step(model, step)`, a context manager that returns a list:
    the first step that leaves something in it ends the re-run, and that list is returned; a
    step that raises first ends it with a `Raised`."""
    replayer = Replayer(run)
    t = replayer.build()
    start = min(run.checkpoints)
    replayer.load_checkpoint(t, start)
    try:
        for s in range(start, last + 1):
            batch = replayer.batch(s).batch
            replayer.follow_lr(t.optimizer, s)
            flagged: list = []
            try:
                with around_step(t.model, s) as flagged:
                    replayer.step_fn(t.model, t.step_optimizer, batch)
            except Exception as e:  # noqa: BLE001 - the user's step raised: what a person sees
                if flagged:
                    return flagged
                frames = [(f.filename, f.lineno or 0) for f in traceback.extract_tb(e.__traceback__)]
                return Raised(s, module_from_traceback(t.model, frames), e)
            if flagged:
                return flagged
            if t.scheduler is not None:
                t.scheduler.step()
        return None
    finally:
        replayer.close(t)


def _raised_claims(r: Raised) -> dict:
    return {
        "root_step": r.step,
        "module": r.module,
        "reproduced": True,
        "detail": f"step {r.step} raised {type(r.error).__name__}: {' '.join(str(r.error).split())[:80]}",
    }


class _Flag(list):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _frames(text: str) -> list[tuple[str, int]]:
    return [(f, int(n)) for f, n in re.findall(r'File "([^"]+)", line (\d+)', text)]


def _forward_covers(module, path: str, line: int) -> bool:
    code = type(module).forward.__code__
    try:
        last = max(ln for _, _, ln in code.co_lines() if ln is not None)
    except ValueError:
        return False
    return Path(code.co_filename).resolve() == Path(path).resolve() and code.co_firstlineno <= line <= last


def module_from_traceback(model, frames: list[tuple[str, int]]) -> str | None:
    """The module a person reading the traceback would name: from the root model's forward
    frame down, each next forward frame's module among the current one's descendants, chosen
    by the `self.<name>` the calling line mentions (the first candidate when several match)."""
    named = dict(model.named_modules())
    start = next((i for i, (f, n) in enumerate(frames) if _forward_covers(model, f, n)), None)
    if start is None:
        return None
    current, caller = "", frames[start]
    for f, n in frames[start + 1 :]:
        prefix = current + "." if current else ""
        candidates = [
            name
            for name, m in named.items()
            if name.startswith(prefix) and name != current and _forward_covers(m, f, n)
        ]
        if not candidates:
            continue
        text = linecache.getline(caller[0], caller[1])
        said = [c for c in candidates if f"self.{c[len(prefix) :].split('.')[0]}" in text]
        current, caller = (said or candidates)[0], (f, n)
    return current


def detect_anomaly_claims(run, symptom: int) -> dict:
    found = {}

    class Watch(_Flag):
        def __init__(self, model, step):
            super().__init__()
            self.model, self.step = model, step

        def __enter__(self):
            self.anomaly = torch.autograd.detect_anomaly()
            self.anomaly.__enter__()
            self.caught = warnings.catch_warnings(record=True)
            self.warned = self.caught.__enter__()
            warnings.simplefilter("always")
            return self

        def __exit__(self, kind, err, tb):
            self.caught.__exit__(None, None, None)
            self.anomaly.__exit__(None, None, None)
            if kind is RuntimeError and "nan" in str(err).lower():
                text = "\n".join(str(w.message) for w in self.warned)
                frames = _frames(text)
                fn = re.search(r"Function '(\w+)'", str(err))
                found.update(
                    step=self.step,
                    module=module_from_traceback(self.model, frames),
                    detail=f"{fn.group(1) if fn else 'a backward function'} returned NaN; forward call at "
                    + (f"{Path(frames[-1][0]).name}:{frames[-1][1]}" if frames else "?"),
                )
                self.append(True)
                return True
            return False

    raised = rerun(run, symptom, Watch)
    if isinstance(raised, Raised):
        return _raised_claims(raised)
    if not found:
        return {"root_step": None, "reproduced": False, "detail": "never raised"}
    return {"root_step": found["step"], "module": found["module"], "reproduced": True, "detail": found["detail"]}


def nan_hooks_claims(run, symptom: int) -> dict:
    def bad(xs) -> bool:
        xs = xs if isinstance(xs, (tuple, list)) else (xs,)
        return any(isinstance(x, torch.Tensor) and x.is_floating_point() and not torch.isfinite(x).all() for x in xs)

    class Hooks(_Flag):
        def __init__(self, model, step):
            super().__init__()
            self.model, self.step, self.handles = model, step, []

        def __enter__(self):
            for name, m in self.model.named_modules():
                self.handles.append(m.register_forward_hook(self._on("forward", name)))
                if not list(m.children()):
                    self.handles.append(m.register_full_backward_hook(self._on_grad(name)))
            return self

        def _on(self, phase, name):
            def hook(module, inputs, output):
                if not self and bad(output):
                    self.append((self.step, phase, name))

            return hook

        def _on_grad(self, name):
            def hook(module, grad_input, grad_output):
                if not self and bad(grad_input):
                    self.append((self.step, "backward", name))

            return hook

        def __exit__(self, *exc):
            for h in self.handles:
                h.remove()
            return False

    flagged = rerun(run, symptom, Hooks)
    if isinstance(flagged, Raised):
        return _raised_claims(flagged)
    if not flagged:
        return {"root_step": None, "reproduced": False, "detail": "nothing non-finite"}
    step, phase, name = flagged[0]
    detail = f"{'output' if phase == 'forward' else 'input gradient'} of `{name or '<root>'}` non-finite ({phase})"
    return {"root_step": step, "module": name, "reproduced": True, "detail": detail}


def ckptlab_claims(run_dir: Path, symptom: int) -> dict:
    doc = ckptlab.replay(run_dir, symptom).to_json()
    o = doc["origin"]
    claims = {
        "root_step": doc["root_step"],
        "kind": o["kind"],
        "parameter": o["parameter"],
        "samples": [s["sample_id"] for s in doc["samples"]],
        "reproduced": doc["reproduced"],
        "detail": doc["verdict"][:160] + ("..." if len(doc["verdict"]) > 160 else ""),
    }
    if doc["reproduced"]:  # a fault not seen again has no module to claim (as for the baselines)
        claims["module"] = o["module"]
    w = doc["rewind"] or {}  # the step it points to as the cause: the earlier one found, else the root
    claims["earlier_cause"] = w.get("step") if w.get("step") is not None else doc["root_step"]
    claims["cause_samples"] = w.get("sample_ids") or [s["sample_id"] for s in doc["samples"]]
    return claims


# --- scoring -----------------------------------------------------------------------------------------


def truth_of(sc) -> dict:
    if hasattr(sc, "cause"):  # an earlier-cause scenario
        return {"earlier_cause": sc.cause, "cause_samples": sc.samples, "reproduced": True}
    return {
        "root_step": sc.root,
        "kind": sc.kind,
        "module": sc.module,
        "parameter": sc.parameter,
        "samples": sc.samples,
        "reproduced": sc.reproduces,
    }


def score(sc, column: str, claims: dict):
    """True (right), False (a miss), NOT_CLAIMED (the method cannot claim it), or None (no
    ground truth: the parameter column where no single parameter is at fault)."""
    if column == "parameter" and sc.parameter is None:
        return None
    if column == "earlier_cause" and "earlier_cause" not in claims:  # a baseline: the step it stopped at
        claims = {**claims, "earlier_cause": claims.get("root_step")}
    if column not in claims:
        return NOT_CLAIMED
    got, want = claims[column], truth_of(sc)[column]
    if column == "cause_samples":
        return set(got) == set(want)
    if column == "samples":  # the most to blame first: the top ones are the true samples
        return set(got[: len(want)]) == set(want) if want else got == []
    return got == want


def _show(value) -> str:
    if value is None:
        return "none"
    if value == "":
        return '"" (root)'
    if isinstance(value, list):
        return ",".join(str(v) for v in value[:3]) + ("..." if len(value) > 3 else "") if value else "[]"
    return str(value)


def cell(sc, column, claims) -> str:
    s = score(sc, column, claims)
    if s is NOT_CLAIMED:
        return "-"
    if s is None:
        return "n/a"
    got = claims[column] if column in claims else claims.get("root_step")
    return f"{'✓' if s else '✗'} {_show(got)}"


def columns_of(sc) -> tuple[str, ...]:
    return EARLIER_COLUMNS if hasattr(sc, "cause") else COLUMNS


def scenario_table(sc, claims: dict) -> str:
    cols = columns_of(sc)
    lines = [
        f"### {sc.name}",
        "",
        "| | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
        "| truth | " + " | ".join(_show(truth_of(sc)[c]) for c in cols) + " |",
    ]
    for m in METHODS:
        lines.append(f"| {m} | " + " | ".join(cell(sc, c, claims[m]) for c in cols) + " |")
    lines.append("")
    lines += [f"- {m}: {claims[m]['detail']}" for m in METHODS]
    return "\n".join(lines)


def summary(results: list, columns: tuple[str, ...] = COLUMNS) -> dict:
    out = {}
    for m in METHODS:
        out[m] = {}
        for c in columns:
            scores = [score(sc, c, claims[m]) for sc, claims in results]
            applicable = [s for s in scores if s is not None]
            claimed = [s for s in applicable if s is not NOT_CLAIMED]
            out[m][c] = {"correct": sum(1 for s in claimed if s), "claimed": len(claimed), "total": len(applicable)}
    return out


def summary_table(summ: dict, columns: tuple[str, ...] = COLUMNS) -> str:
    lines = ["| method | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for m in METHODS:
        cells = []
        for c in columns:
            s = summ[m][c]
            cells.append(f"{s['correct']} / {s['claimed']} / {s['total']}" if s["claimed"] else f"- / 0 / {s['total']}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_scenario(sc, root: Path) -> tuple[dict, dict]:
    run_dir = root / sc.name
    t0 = time.perf_counter()
    exp = sc.record(run_dir)
    if exp.symptom != sc.symptom:
        print(f"bench_accuracy: {sc.name}: symptom step {exp.symptom}, registry says {sc.symptom}", file=sys.stderr)
    run = ckptlab.open_run(run_dir)
    timing = {"record_s": time.perf_counter() - t0}
    claims = {}
    for m, fn in (
        ("ckptlab", lambda: ckptlab_claims(run_dir, exp.symptom)),
        ("detect_anomaly", lambda: detect_anomaly_claims(run, exp.symptom)),
        ("nan_hooks", lambda: nan_hooks_claims(run, exp.symptom)),
    ):
        t0 = time.perf_counter()
        claims[m] = fn()
        timing[f"{m}_s"] = time.perf_counter() - t0
    claims["symptom"] = exp.symptom
    return claims, timing


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", metavar="NAME", help="run one scenario (names: tests/fault_zoo.py)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    chosen = [s for s in [*SCENARIOS, *EARLIER] if args.only in (None, s.name)]
    if not chosen:
        print(f"bench_accuracy: no scenario named {args.only!r}", file=sys.stderr)
        return 2
    results, timings = [], {}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for sc in chosen:
            claims, timings[sc.name] = run_scenario(sc, Path(tmp))
            results.append((sc, claims))
            print(scenario_table(sc, claims) + "\n", flush=True)
    zoo = [(sc, c) for sc, c in results if not hasattr(sc, "cause")]
    earlier = [(sc, c) for sc, c in results if hasattr(sc, "cause")]
    summ = summary(zoo)
    summ_earlier = summary(earlier, EARLIER_COLUMNS)
    print("### summary (correct / claimed / total)\n")
    print(summary_table(summ) + "\n")
    print("### summary of the earlier-cause zoo (correct / claimed / total)\n")
    print(summary_table(summ_earlier, EARLIER_COLUMNS) + "\n")
    print(
        json.dumps(
            {
                "bench": "accuracy",
                "scenarios": {
                    sc.name: {m: {c: score(sc, c, claims[m]) for c in columns_of(sc)} for m in METHODS}
                    for sc, claims in results
                },
                "summary": summ,
                "summary_earlier": summ_earlier,
                "total_s": round(sum(sum(t.values()) for t in timings.values()), 1),
                "torch": torch.__version__,
            },
            default=lambda v: "-" if v is NOT_CLAIMED else str(v),
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
