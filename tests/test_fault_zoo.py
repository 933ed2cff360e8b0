"""Replay against the ground truth of the zoo's new scenarios (tests/zoo_models.py): root step,
kind, module and parameter, samples, reproducibility. The older scenarios of the zoo are
asserted by test_replay_faults.py and test_replay_search.py.

Each scenario is recorded and replayed once; each field is its own test, so that a known miss
is an xfail of that field alone (strict: a fix turns it into a failure to be un-marked).
docs/accuracy.md publishes the same comparison for every scenario, with two baselines.
"""

import pytest

import ckptlab
from tests.fault_zoo import SCENARIOS

NEW = [s for s in SCENARIOS if s.new]
FIELDS = ("root_step", "kind", "module", "parameter", "samples", "reproduced")

# Known misses, kept so that the benchmark stays honest (docs/accuracy.md discusses each).
MISSES: dict[tuple[str, str], str] = {}  # (scenario, field) -> why replay misses it (a strict xfail)


@pytest.fixture(scope="module")
def replays(tmp_path_factory):
    done = {}

    def get(scenario):
        if scenario.name not in done:
            run_dir = tmp_path_factory.mktemp(scenario.name) / "run"
            exp = scenario.record(run_dir)
            assert (exp.step, exp.symptom) == (scenario.root, scenario.symptom)  # the registry is current
            done[scenario.name] = ckptlab.replay(run_dir, exp.symptom).to_json()
        return done[scenario.name]

    return get


def _cases():
    for s in NEW:
        for f in FIELDS:
            if f == "parameter" and s.parameter is None:
                continue  # no parameter is at fault; one replay names is detail, not blame
            reason = MISSES.get((s.name, f))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(s, f, id=f"{s.name}-{f}", marks=marks)


@pytest.mark.parametrize(("scenario", "field"), list(_cases()))
def test_replay_matches_the_ground_truth(scenario, field, replays):
    doc = replays(scenario)
    origin = doc["origin"]
    if field == "root_step":
        assert doc["root_step"] == scenario.root
    elif field == "kind":
        assert origin["kind"] == scenario.kind
    elif field == "module":
        assert origin["module"] == scenario.module
    elif field == "parameter":
        assert origin["parameter"] == scenario.parameter
    elif field == "samples":  # the most to blame first: the top ones are the true samples
        blamed = [s["sample_id"] for s in doc["samples"]]
        if scenario.samples:
            assert set(blamed[: len(scenario.samples)]) == set(scenario.samples), blamed
        else:
            assert blamed == []
    else:
        assert doc["reproduced"] is scenario.reproduces


def test_a_sample_repeated_across_the_batch_is_blamed(replays):
    """Six copies of one outlier: no row dominates the others (they are equal), yet that one
    sample is the whole update. Replay blames it as data, not as an optimizer fault."""
    doc = replays(next(s for s in NEW if s.name == "duplicated_sample"))
    assert doc["origin"]["kind"] == "data" and {s["sample_id"] for s in doc["samples"]} == {1503}
    assert "sample 1503 fills 6 of the batch's 6 rows" in doc["samples"][0]["reason"]
    assert "1503" in doc["verdict"] and "optimizer" not in doc["verdict"]
