"""Replay against the ground truth of the earlier-cause zoo (tests/earlier_zoo.py): the step
whose removal prevents the fault, named by `rewind`, with its sample ids; the symptom still
reproduces. Each scenario is recorded and replayed once (module scope)."""

import pytest

import ckptlab
from tests.earlier_zoo import EARLIER

# Known misses, kept so that the benchmark stays honest (docs/accuracy.md discusses each).
MISSES: dict[str, str] = {
    "lr_restart": "checkpoint 30 holds the earlier session's scheduler, not the rebuilt one the resumed session "
    "ran with: replay from it leaves the record at step 32 and calls the fault transient",
}


@pytest.fixture(scope="module")
def replays(tmp_path_factory):
    done = {}

    def get(scenario):
        if scenario.name not in done:
            run_dir = tmp_path_factory.mktemp(scenario.name) / "run"
            exp = scenario.record(run_dir)
            assert (exp.cause, exp.symptom) == (scenario.cause, scenario.symptom)  # the registry is current
            done[scenario.name] = ckptlab.replay(run_dir, scenario.symptom).to_json()
        return done[scenario.name]

    return get


def _cases():
    for s in EARLIER:
        marks = [pytest.mark.xfail(strict=True, reason=MISSES[s.name])] if s.name in MISSES else []
        yield pytest.param(s, id=s.name, marks=marks)


@pytest.mark.parametrize("scenario", list(_cases()))
def test_the_earlier_cause_is_named(scenario, replays):
    doc = replays(scenario)
    assert doc["reproduced"], doc["verdict"]
    w = doc["rewind"]
    assert w is not None and w["step"] == scenario.cause, doc["verdict"]
    if scenario.samples:
        assert w["sample_ids"] == scenario.samples
    assert f"step {scenario.cause}" in doc["verdict"]
