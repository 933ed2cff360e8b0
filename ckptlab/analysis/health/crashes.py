"""The crash detector: steps whose own code raised (the Recorder's `exception` events)."""

from __future__ import annotations

from ckptlab.analysis.health.inputs import RunData
from ckptlab.analysis.health.rules import Finding, HealthRules


def crashes(d: RunData, rules: HealthRules) -> list[Finding]:
    out = []
    for e in d.run.events():
        if e.get("kind") != "exception":
            continue
        step, where = int(e["step"]), ""
        if e.get("module") is not None:
            where += f" in `{e['module'] or '<root>'}`"
        if e.get("source"):
            where += f" at {e['source']}"
        out.append(
            Finding(
                kind="crash",
                severity="error",
                title=f"step {step} raised {e.get('error', 'an exception')}{where}",
                steps=[step],
                evidence={k: e[k] for k in ("error", "source", "call", "module", "phase") if e.get(k) is not None},
                remedies=[
                    f"replay it: ckptlab replay --step {step} (does it raise again, and on which rows?)",
                    "a crash that does not reproduce is transient (out of memory, hardware, I/O): resume with "
                    "Recorder(..., resume=True)",
                    "a row that raises alone: skip it and resume from the checkpoint before it (ckptlab rollback)",
                ],
            )
        )
    return out
