"""Replay against the ground truth of the earlier-cause zoo (tests/earlier_zoo.py): the step
whose removal prevents the fault, named by `rewind` with its sample ids (or, for a cause no
single removal undoes, the root step replay names, before the symptom); the symptom still
reproduces. Each scenario is recorded and replayed once (module scope)."""

import pytest

import ckptlab
from tests.earlier_zoo import EARLIER

# Known misses, kept so that the benchmark stays honest (docs/accuracy.md discusses each).
MISSES: dict[str, str] = {}


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
    if w is None or w["step"] is None:  # the root step itself lies before the symptom: it is the cause
        assert doc["root_step"] == scenario.cause < scenario.symptom and not scenario.samples, doc["verdict"]
    else:
        assert w["step"] == scenario.cause, doc["verdict"]
        assert w["sample_ids"] == scenario.samples
    assert f"step {scenario.cause}" in doc["verdict"].lower()
