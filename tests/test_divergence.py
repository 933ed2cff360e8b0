"""A fault that does not reproduce: the first step off the record, replayed twice with a hash
of every op's output, tells kernel nondeterminism from a state changed outside step_fn."""

from ckptlab.cli import main
from tests import fault_models as fm


def _replay_json(run_dir, step, capsys):
    import json

    capsys.readouterr()
    try:
        main(["replay", "--run", str(run_dir), "--step", str(step), "--json"])
    except SystemExit as e:
        assert e.code == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_replays_that_differ_name_the_first_nondeterministic_op(run_dir, capsys):
    exp = fm.record_unrecorded_noise(run_dir)
    doc = _replay_json(run_dir, exp.symptom, capsys)
    assert not doc["reproduced"] and doc["left_record_step"] == 10
    d = doc["divergence"]
    assert d["step"] == 10 and d["replays_agree"] is False and d["losses"][0] != d["losses"][1]
    op = d["first_nondeterministic_op"]
    assert (op["module"], op["phase"], op["index"]) == ("jitter", "forward", 0)  # the noise, nothing before it
    assert "first nondeterministic op" in doc["verdict"] and "`jitter`" in doc["verdict"]
    assert "transient" in doc["verdict"]


def test_replays_that_agree_say_the_state_changed_outside_step_fn(run_dir, capsys):
    exp = fm.record_corrupted_weight(run_dir)
    doc = _replay_json(run_dir, exp.symptom, capsys)
    d = doc["divergence"]
    assert d["step"] == exp.symptom and d["replays_agree"] is True and d["first_nondeterministic_op"] is None
    assert d["ops_compared"] > 50 and d["losses"][0] == d["losses"][1] and d["recorded_loss"] == "nan"
    assert "agree op for op" in doc["verdict"] and "outside the recorded computation" in doc["verdict"]
    capsys.readouterr()
    try:
        main(["replay", "--run", str(run_dir), "--step", str(exp.symptom)])
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    assert f"step {exp.symptom} replayed twice" in out and "agree with each other" in out


def test_a_reproduced_fault_has_no_divergence_check(run_dir, capsys):
    exp = fm.record_input_nan(run_dir)
    doc = _replay_json(run_dir, exp.symptom, capsys)
    assert doc["reproduced"] and doc["divergence"] is None and doc["dump"] is None
