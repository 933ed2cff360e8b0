"""The profiling scripts name the functions they time (scripts/bench_record.py, phase by mode;
scripts/profile_record_step.py, phase by step): a function moved or renamed must move in their
tables too, or the scripts stop at their first line of output."""

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent.parent / "scripts"


@pytest.mark.parametrize("script", ["bench_record", "profile_record_step"])
def test_every_function_a_profiling_script_times_exists(monkeypatch, script):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    for name in ("bench_replay", "bench_record", script):
        monkeypatch.delitem(sys.modules, name, raising=False)  # (imported afresh, undone after)
    module = __import__(script)
    missing = [
        f"{getattr(owner, '__name__', owner)}.{name} ({phase})"
        for phase, targets in module.PHASES.items()
        if "older ckptlab" not in phase  # (profile_record_step also times an older checkout)
        for owner, name in targets
        if not callable(getattr(owner, name, None))
    ]
    assert missing == []
