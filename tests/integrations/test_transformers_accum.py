"""Gradient accumulation with padded rows, end to end: a tiny Llama under the Hugging Face
Trainer (micro-batches of 4 rows, 2 a step, rows right-padded) reads a corrupt embedding row
that every checkpoint holds. Replay names the sample that reads it by its micro-batch and row
in every piece of evidence, narrows it to the token's position and moves it into a healthy
step's batch."""

import contextlib
import io
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import Trainer  # noqa: E402

import ckptlab  # noqa: E402
from ckptlab.cli import main  # noqa: E402
from ckptlab.integrations import transformers as ckt  # noqa: E402
from tests.integrations import hf_llama_models as lm  # noqa: E402


def run_json(*args) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        main([str(a) for a in args])
    assert done.value.code == 0
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("hf-llama-accum") / "run"
    trainer = Trainer(model=lm.model(), args=lm.fresh_args(), train_dataset=lm.PaddedTokens())
    ckt.record(trainer, run_dir, build_fn=lm.build, sample_id_key="idx", ckpt_every=4)
    with pytest.raises(ckptlab.NonFiniteLoss) as e:
        trainer.train()
    assert e.value.step == lm.FAULT_STEP
    return run_dir


@pytest.fixture(scope="module")
def replayed(llama_run) -> dict:
    return run_json("replay", "--run", llama_run, "--step", lm.FAULT_STEP, "--json")


def test_the_bad_start_names_the_rows_that_read_it_by_micro_batch(llama_run, replayed):
    """The checkpoint replay starts from holds the NaN row: the row that reads it is found
    in its micro-batch (every leaf there has 4 rows, the step has 8 sample ids)."""
    batch, ids = ckptlab.open_run(llama_run).batch(lm.FAULT_STEP)  # as the Trainer's callback recorded it
    assert len(ids) == lm.ROWS and batch["micro_rows"] == [lm.MICRO] * lm.ACCUM
    first = batch["micro_batches"][0]["inputs"]
    assert first["attention_mask"][0].tolist() == [1] * lm.SHORT + [0] * (lm.SEQ - lm.SHORT)  # a padded row
    assert first["labels"][0, lm.SHORT :].eq(-100).all()
    start = replayed["start_state"]
    assert start["checkpoint"] == replayed["start_checkpoint"] == 8
    assert start["nonfinite"] == [
        {"parameter": "model.embed_tokens.weight", "count": lm.HIDDEN, "rows": [lm.BAD_TOKEN]}
    ]
    assert start["used_by"] == [{"row": lm.FAULT_ROW, "sample_id": lm.FAULT_SAMPLE, "micro_batch": lm.FAULT_MICRO}]
    where = f"micro-batch {lm.FAULT_MICRO} row {lm.FAULT_ROW} (sample {lm.FAULT_SAMPLE})"
    assert f"The first to use it: {where}." in replayed["verdict"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["replay", "--run", str(llama_run), "--step", str(lm.FAULT_STEP), "--no-counterfactuals"])
    assert f"first used by {where}" in out.getvalue()


def test_replay_blames_the_micro_batch_row_and_proves_it(replayed):
    """The row alone faults, the step without it does not (the NaN weights that every replay
    from this state holds are no fault of a batch)."""
    assert replayed["root_step"] == lm.FAULT_STEP and replayed["reproduced"] and replayed["deterministic"]
    assert [(s["micro_batch"], s["row"], s["sample_id"]) for s in replayed["samples"]] == [
        (lm.FAULT_MICRO, lm.FAULT_ROW, lm.FAULT_SAMPLE)
    ]
    without = next(c for c in replayed["counterfactuals"] if "without the blamed rows" in c["question"])
    assert f"({lm.FAULT_SAMPLE})" in without["question"] and without["fault"] is False, without


def test_the_culprit_is_narrowed_to_the_token_and_transplanted(replayed):
    c = replayed["culprit"]
    assert (c["micro_batches"], c["rows"], c["sample_ids"]) == ([lm.FAULT_MICRO], [lm.FAULT_ROW], [lm.FAULT_SAMPLE])
    # the bad token's position, in the token ids alone (every other value from a healthy row
    # with tokens wherever the culprit has them: not row 0 of its step, padded from position 3)
    assert (c["positions"], c["fields"], c["minimal"]) == ([lm.FAULT_POSITION], ["['inputs']['input_ids']"], True)
    # put into step 8's batch (its micro-batch 1 row 2), from the root step's state, it faults
    assert (c["transplant_step"], c["transplant_fault"]) == (lm.FAULT_STEP - 1, True)
    assert f"it needs position(s) {lm.FAULT_POSITION} of batch['inputs']['input_ids']" in c["detail"]
