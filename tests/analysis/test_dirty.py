"""dirty: each planted kind of dirty row is found (and nothing else); step spikes map to their
batches; attribution is an optional stage; skip lists round-trip into skip_samples."""

import json

import pytest
import torch
import torch.utils.data as tud

import ckptlab
from ckptlab.analysis.dirty import scan, skip_ids, write_skip_list
from ckptlab.analysis.dirty.findings import DirtyRules
from ckptlab.analysis.spikes import SpikeRule
from ckptlab.run.skiplist import read as read_skip_list
from ckptlab.training.sample_ids import skip_samples
from tests import act_models as am
from tests import models


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("dirty") / "lm"
    models.record_run(path, am.build_dirty_lm, am.step_dirty_lm, am.dirty_lm_batches(24), ckpt_every=50)
    return ckptlab.open_run(path)


@pytest.fixture(scope="module")
def spike_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("dirty") / "spike"
    models.record_run(
        path, am.build_healthy, models.step_mlp, am.spiky_regression_batches(80, 50), ckpt_every=20, keep_last=10
    )
    return ckptlab.open_run(path)


def test_each_planted_row_found_and_nothing_else(lm_run):
    r = scan(lm_run)
    found = {(f.step, f.row): f.reason for f in r.flagged}
    assert found == am.PLANTED
    by = {f.reason: f for f in r.flagged}
    assert by["out_of_range"].evidence["max"] == 500 and by["out_of_range"].evidence["vocab_size"] == am.DIRTY_VOCAB
    assert by["duplicate"].evidence["same_as"] == {"step": 3, "row": 4, "sample_id": "doc-3-4"}
    assert by["extreme"].evidence["field"] == "quality[0]" and by["extreme"].evidence["z"] > 1e3
    assert by["length"].evidence["length"] == 2
    assert r.data_info["pad_id"] == am.DIRTY_PAD and r.data_info["pad_source"].startswith("inferred")
    assert [f.reason for f in r.flagged][:2] == ["nonfinite", "out_of_range"]  # ranked by severity
    assert r.flagged[0].sample_id == "doc-13-5"


def test_skip_list_excludes_length_outliers(lm_run, tmp_path):
    r = scan(lm_run)
    expected = {f"doc-{s}-{row}" for (s, row), why in am.PLANTED.items() if why != "length"}
    assert set(r.skip_ids) == expected
    doc = write_skip_list(r, tmp_path / "skip.json")
    assert json.loads((tmp_path / "skip.json").read_text())["sample_ids"] == doc["sample_ids"]
    assert set(read_skip_list(tmp_path / "skip.json")) == expected
    assert {e["sample_id"]: e["reasons"] for e in doc["entries"]}["doc-7-1"] == ["out_of_range"]


def test_a_step_without_gradients_is_not_a_nonfinite_gradient(tmp_path):
    # The loop skips backward and update on the spike at step 50: its gradient norm is "none"
    # (NaN, every parameter without a gradient), not a non-finite gradient.
    path = tmp_path / "skipping"
    batches = am.spiky_regression_batches(80, 50)
    models.record_run(path, am.build_healthy, am.step_skip_spikes, batches, ckpt_every=20, keep_last=10)
    run = ckptlab.open_run(path)
    assert (run.metrics().param_grad_norm[50] < 0).all()  # no gradient recorded
    r = scan(run)
    assert [(f["step"], f["kind"]) for f in r.steps] == [(50, "loss_spike")]


def test_data_info_overrides_inference(lm_run):
    r = scan(lm_run, data_info={"pad_id": 63, "vocab_size": 1000})
    assert r.data_info["pad_source"] == "data_info" and r.data_info["vocab_size"] == 1000
    assert "out_of_range" not in {f.reason for f in r.flagged}  # 500 < 1000


def test_clean_data_gets_no_flags(tmp_path):
    models.record_run(
        tmp_path / "lm", am.build_dirty_lm, am.step_dirty_lm, am.dirty_lm_batches(24, plant=False), ckpt_every=50
    )
    r = scan(ckptlab.open_run(tmp_path / "lm"))
    assert r.flagged == [] and r.skip_ids == []
    models.record_run(
        tmp_path / "mlp",
        am.build_healthy,
        models.step_mlp,
        am.regression_batches(200, batch=4),
        ckpt_every=50,
        keep_last=10,
    )
    r = scan(ckptlab.open_run(tmp_path / "mlp"))
    assert r.flagged == [], r.flagged[:3]


def test_spike_mapped_to_its_batch_and_corroborated(spike_run):
    r = scan(spike_run)
    top = r.flagged[0]
    assert (top.step, top.row, top.sample_id, top.reason) == (50, 3, 50003, "extreme")
    assert top.evidence["step_flags"] == ["grad_spike", "loss_spike"]
    spikes = [f for f in r.steps if f["kind"] == "loss_spike"]
    assert [f["step"] for f in spikes] == [50] and spikes[0]["batch"] == "retained"
    assert r.attribution["status"] == "off"  # no attribution passed in
    assert r.skip_ids == [50003]  # the spike has a row to blame: the rest of the batch is kept


def test_spike_thresholds_are_settable(spike_run):
    off = SpikeRule(z=1e12)
    r = scan(spike_run, DirtyRules(loss_spike=off, grad_spike=off))
    assert r.steps == []
    assert {f.reason for f in r.flagged} == {"extreme"}


def test_unexplained_spike_skips_its_whole_batch(spike_run):
    r = scan(spike_run, DirtyRules(extreme_z=1e12))  # content check off: only the spike remains
    assert {f.reason for f in r.flagged} == {"loss_spike", "grad_spike"}
    assert sorted(r.skip_ids) == [50000 + row for row in range(16)]
    assert skip_ids(r, whole_batches=False) == []


def test_attribution_stage_uses_the_attribution_passed_in(spike_run):
    calls = []

    def attribute_rows(run, step):
        calls.append(step)
        # row 7 caused it; row 2 is merely a noisy sample (5x the median, a sliver of the excess)
        loss = {7: 50.0, 2: 5.0}
        return [{"row": r, "sample_id": 1000 * step + r, "loss": loss.get(r, 1.0), "grad_norm": 1.0} for r in range(16)]

    r = scan(spike_run, DirtyRules(extreme_z=1e12), attribute=attribute_rows)
    assert calls == [50] and r.attribution == {"status": "done", "steps": [50]}
    blamed = [f for f in r.flagged if f.reason == "attributed"]
    assert [(f.step, f.row, f.sample_id) for f in blamed] == [(50, 7, 50007)]
    assert blamed[0].evidence["loss_ratio"] == 50.0 and blamed[0].evidence["loss_share"] > 0.9
    assert r.skip_ids == [50007]  # attribution named the row: the batch is not skipped wholesale
    assert scan(spike_run).attribution == {"status": "off"}
    with pytest.raises(ckptlab.CkptlabError, match="takes a function"):
        scan(spike_run, attribute=True)


def test_attribution_blames_nobody_when_every_row_rose(spike_run):
    rows = [(r, 50000 + r, 10.0 + 0.1 * r, 3.0) for r in range(16)]  # e.g. a learning-rate spike
    r = scan(spike_run, DirtyRules(extreme_z=1e12), attribute=lambda run, step: rows)
    assert r.attribution["status"] == "done" and not [f for f in r.flagged if f.reason == "attributed"]


def test_skip_samples_wraps_samplers_datasets_and_iterables(tmp_path):
    skip = [1, 3, 5]
    assert list(skip_samples(tud.SequentialSampler(range(8)), skip)) == [0, 2, 4, 6, 7]
    assert len(skip_samples(tud.SequentialSampler(range(8)), skip)) == 5
    batches = tud.BatchSampler(tud.SequentialSampler(range(8)), batch_size=2, drop_last=False)
    assert list(skip_samples(batches, skip)) == [[0], [2], [4], [6, 7]]
    ds = tud.TensorDataset(torch.arange(8) * 10)
    sub = skip_samples(ds, skip)
    assert [int(sub[i][0]) for i in range(len(sub))] == [0, 20, 40, 60, 70]
    items = [{"id": f"doc-{i}", "x": i} for i in range(4)]
    assert [it["x"] for it in skip_samples(items, ["doc-2"], key=lambda it: it["id"])] == [0, 1, 3]
    loader = tud.DataLoader(
        ds, sampler=skip_samples(tud.RandomSampler(ds, generator=torch.Generator().manual_seed(0)), skip), batch_size=8
    )
    assert sorted(next(iter(loader))[0].tolist()) == [0, 20, 40, 60, 70]
    (tmp_path / "skip.json").write_text(
        json.dumps({"format": "ckptlab-skip", "version": 1, "sample_ids": [torch.tensor(2).item()]})
    )
    assert list(skip_samples(range(4), tmp_path / "skip.json")) == [0, 1, 3]
    assert ckptlab.skip_samples is skip_samples


def test_a_file_that_is_not_a_skip_list_is_refused(tmp_path):
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ckptlab.CkptlabError, match="not a ckptlab skip list"):
        skip_samples(range(3), tmp_path / "x.json")


def test_nested_batch_with_strings_and_masks(tmp_path):
    models.record_run(tmp_path / "r", am.build_nested, am.step_nested, am.nested_batches(), ckpt_every=50)
    r = scan(ckptlab.open_run(tmp_path / "r"))
    assert {(f.step, f.row): (f.reason, f.evidence["field"]) for f in r.flagged} == {
        (4, 1): ("empty", "text"),
        (6, 2): ("empty", "inputs.attention_mask"),
    }
    assert set(r.scanned["fields"]) == {"text", "inputs.ids", "inputs.attention_mask", "y"}


def test_attribution_with_the_real_replay(spike_run):
    """Plumbing only (replay's own attribution tests are replay's): the absurd row is named."""
    from ckptlab.replayer import attribute_rows

    r = scan(spike_run, DirtyRules(extreme_z=1e12), attribute=attribute_rows)
    assert r.attribution["status"] == "done"
    assert [(f.step, f.row, f.sample_id) for f in r.flagged if f.reason == "attributed"] == [(50, 3, 50003)]
    assert r.skip_ids == [50003]


def step_skipping_nonfinite(model, optimizer, batch):
    """A loop that skips the update on a non-finite loss, as many LLM loops do."""
    x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    if not torch.isfinite(loss):
        return loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def nan_batches(n: int, bad: tuple[int, ...]):
    out = list(models.mlp_batches(n))
    for step in bad:
        (x, y), ids = out[step]
        x = x.clone()
        x[1, 0] = float("nan")
        out[step] = ((x, y), ids)
    return out


@pytest.mark.parametrize("skipping", [False, True])
def test_steps_after_a_nonfinite_update_are_downstream_not_dirty(tmp_path, skipping):
    """Once an update made the weights NaN, every later step fails whatever its batch: those
    steps point at the first one and add nothing to the skip list. A loop that skipped the
    update keeps its weights: a later NaN step is a fault of its own."""
    step = step_skipping_nonfinite if skipping else models.step_mlp
    path = tmp_path / "run"
    models.record_run(
        path, models.build_mlp, step, nan_batches(10, (5, 7)), stop_on_nonfinite=False, on_nonfinite="record"
    )
    r = scan(ckptlab.open_run(path), DirtyRules(extreme_z=1e12))
    flags = {(f["step"], f["kind"]): f.get("downstream_of") for f in r.steps}
    if skipping:
        assert flags == {(5, "nonfinite_loss"): None, (7, "nonfinite_loss"): None}
        assert sorted(r.skip_ids) == [5001, 7001]  # the content scan names the NaN rows
    else:
        assert flags[(5, "nonfinite_loss")] is None
        assert {s: d for (s, _), d in flags.items() if s > 5} == {s: 5 for s in range(6, 10)}
        # the NaN rows the content scan names; not the whole batches of steps 6, 8 and 9
        assert sorted(r.skip_ids) == [5001, 7001]
        first = [f for f in r.flagged if f.row is None][0]
        assert (first.step, first.reason) == (5, "nonfinite_loss")  # the root ranks above its consequences
        later = [f for f in r.flagged if f.step == 7 and f.row is None][0]
        assert later.evidence["downstream_of"] == 5
