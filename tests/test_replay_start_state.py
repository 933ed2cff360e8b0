"""A state that was already bad when the replay began: replay says so, names the weights and
where the record first saw them bad, and the rows that first used them."""

import pytest
import torch

import ckptlab
from ckptlab.replayer.startstate import used_by
from tests import bad_state_models as bm


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("badstate") / "run"
    model, opt = bm.build()
    with ckptlab.Recorder(
        run_dir, model, opt, step_fn=bm.step, build_fn=bm.build, ckpt_every=5, on_anomaly=None
    ) as rec:
        with pytest.raises(ckptlab.NonFiniteLoss):
            for s in range(20):
                rec.step(bm.batch(s), sample_ids=[100 * s + r for r in range(bm.B)])
    return run_dir


def test_a_state_already_bad_is_named_with_the_rows_that_first_used_it(recorded, cli):
    r = cli("replay", "--run", recorded, "--step", bm.FIRST_USE, "--json", "--no-counterfactuals")
    assert r.code == 0, r.err
    doc = r.json()
    start = doc["start_state"]
    assert start["checkpoint"] == doc["start_checkpoint"]
    assert start["nonfinite"] == [{"parameter": "emb.weight", "count": bm.D, "rows": [bm.BAD_TOKEN]}]
    assert start["first_recorded"] == 0  # the record saw it from the first step
    assert start["used_by"] == [{"row": bm.ROW, "sample_id": 100 * bm.FIRST_USE + bm.ROW, "micro_batch": None}]
    assert doc["verdict"].startswith(
        f"The state was already bad when the replay began: checkpoint {start['checkpoint']}"
    )
    assert "emb.weight" in doc["verdict"] and f"row {bm.ROW} (sample {100 * bm.FIRST_USE + bm.ROW})" in doc["verdict"]
    text = cli("replay", "--run", recorded, "--step", bm.FIRST_USE, "--no-counterfactuals")
    assert "already bad in checkpoint" in text.out and "emb.weight: 8 non-finite (row 7)" in text.out


def test_used_by_reads_token_ids_in_each_micro_batch_and_no_mask():
    """A bad row 0 (an unknown token) in a run whose pad id is 2: the attention mask's 0s on
    padded rows are not ids. Row 0 of micro-batch 1 reads the bad row 9."""

    def part(ids):
        ids = torch.tensor(ids)
        return {"input_ids": ids, "attention_mask": (ids != 2).long()}

    batch = {
        "micro_batches": [part([[5, 6, 2, 2], [7, 8, 4, 3]]), part([[5, 9, 2, 2], [3, 3, 3, 3]])],
        "micro_rows": [2, 2],
    }
    bad = [{"parameter": "emb.weight", "count": 16, "rows": [0, 9], "embedding": True}]
    assert used_by(bad, batch, [10, 11, 12, 13]) == [{"row": 0, "sample_id": 12, "micro_batch": 1}]
