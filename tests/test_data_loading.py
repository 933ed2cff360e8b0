"""Data loading end to end: sample ids from the dataset (`with_sample_ids`) through worker
processes, shuffling and distributed samplers, for tuple, dict and nested batches; replay
names the planted step and dataset item, and `skip_samples` keeps that item out afterwards."""

import json

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler

import ckptlab
from ckptlab.cli import main
from tests import data_models as dm

BS = 4


def sampler_of(kind: str, skip=()):
    """The loader's sampler, and the order in which it yields dataset indices."""
    if kind == "distributed":  # rank 0 of 2, no process group needed when both are given
        s = DistributedSampler(range(dm.N), num_replicas=2, rank=0, shuffle=True, seed=3)
    else:
        s = RandomSampler(range(dm.N), generator=torch.Generator().manual_seed(3))
    if skip:
        s = ckptlab.skip_samples(s, skip)
    return s


def loader_of(kind: str, ds, skip=()) -> DataLoader:
    sampler = sampler_of(kind, skip)
    data = ckptlab.with_sample_ids(ds)
    if kind == "batch_sampler":
        return DataLoader(data, batch_sampler=BatchSampler(sampler, BS, drop_last=False))
    workers = {"num_workers": 2, "persistent_workers": True} if kind == "workers" else {}
    return DataLoader(data, sampler=sampler, batch_size=BS, **workers)


CASES = [("tuple", "workers"), ("dict", "distributed"), ("nested", "batch_sampler")]


@pytest.mark.parametrize(("structure", "kind"), CASES)
def test_replay_names_the_planted_dataset_item_and_skip_samples_drops_it(structure, kind, run_dir, capsys):
    order = list(sampler_of(kind))
    root, row = 5, 1
    bad = int(order[root * BS + row])  # lands at step 5, row 1
    model, opt = dm.build()
    with ckptlab.Recorder(run_dir, model, opt, step_fn=dm.step, build_fn=dm.build, ckpt_every=3) as rec:
        with pytest.raises(ckptlab.NonFiniteLoss) as stopped:
            for ids, batch in loader_of(kind, dm.Points(structure, bad=bad)):
                rec.step(batch, sample_ids=ids)
    assert stopped.value.step == root
    run = ckptlab.open_run(run_dir)
    batch, ids = run.batch(root)
    assert ids == [int(i) for i in order[root * BS : root * BS + BS]]
    if structure == "nested":  # the structure round-trips: dicts, the namedtuple, strings
        assert type(batch["target"]).__name__ == "Target" and batch["inputs"]["name"][row] == f"p{bad}"

    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["replay", "--run", str(run_dir), "--step", str(root), "--json"])
    assert done.value.code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["root_step"] == root and doc["reproduced"] and doc["deterministic"]
    assert doc["origin"]["kind"] == "data"
    assert [(s["row"], s["sample_id"]) for s in doc["samples"]] == [(row, bad)]

    kept = [int(i) for ids, _ in loader_of(kind, dm.Points(structure), skip=[bad]) for i in ids]
    assert bad not in kept and sorted(kept) == sorted(int(i) for i in order if int(i) != bad)


def test_with_sample_ids_gives_the_index_under_skip_samples_of_a_dataset():
    ds = ckptlab.skip_samples(dm.Points("dict"), [0, 5])  # a Subset: positions shift ...
    data = ckptlab.with_sample_ids(ds)
    ids = [data[i][0] for i in range(len(data))]
    assert len(ids) == dm.N - 2 and ids[:5] == [1, 2, 3, 4, 6]  # ... the ids do not
    assert torch.equal(data[4][1]["x"], dm.Points("dict").x[6])
    with pytest.raises(TypeError, match="map-style dataset"):
        ckptlab.with_sample_ids(iter(range(3)))


def _shaped_loader(shape: str, ds):
    """A loader whose batches keep the shape a collator or a trainer needs, and how to get a
    batch's ids out: (loader, take(batch) -> (batch, ids))."""
    from transformers import default_data_collator  # wants dict items: vars() of a tuple fails

    sampler = sampler_of("random")
    if shape == "dict_key":
        data = ckptlab.with_sample_ids(ds, key="sample_id")
        loader = DataLoader(data, sampler=sampler, batch_size=BS, collate_fn=default_data_collator)
        return loader, lambda b: (b, b.pop("sample_id"))
    if shape == "collator":
        collate = ckptlab.collate_with_ids(default_data_collator)
        loader = DataLoader(ckptlab.with_sample_ids(ds), sampler=sampler, batch_size=BS, collate_fn=collate)
        return loader, lambda b: (b[1], b[0])
    tracked = ckptlab.track_sample_ids(BatchSampler(sampler, BS, drop_last=False))
    loader = DataLoader(ds, batch_sampler=tracked, num_workers=2)  # batches exactly as without ckptlab
    return loader, lambda b: (b, tracked.next_batch())


@pytest.mark.parametrize(("shape", "structure"), [("dict_key", "dict"), ("collator", "dict"), ("tracked", "tuple")])
def test_sample_ids_ride_where_the_batch_shape_needs_them(shape, structure, run_dir, cli):
    order = list(sampler_of("random"))
    root, row = 4, 2
    bad = int(order[root * BS + row])
    model, opt = dm.build()
    with ckptlab.Recorder(run_dir, model, opt, step_fn=dm.step, build_fn=dm.build, ckpt_every=3) as rec:
        loader, take = _shaped_loader(shape, dm.Points(structure, bad=bad))
        with pytest.raises(ckptlab.NonFiniteLoss):
            for got in loader:
                batch, ids = take(got)
                assert "sample_id" not in batch  # the model sees the batch it always saw
                rec.step(batch, sample_ids=ids)
    assert ckptlab.open_run(run_dir).batch(root)[1] == [int(i) for i in order[root * BS : root * BS + BS]]
    r = cli("replay", "--run", run_dir, "--step", root, "--json", "--no-counterfactuals")
    assert r.code == 0, r.err
    assert [(s["row"], s["sample_id"]) for s in r.json()["samples"]] == [(row, bad)]


def test_sample_id_shapes_refuse_what_they_cannot_carry():
    with pytest.raises(TypeError, match=r"key='sample_id'\) needs dict items, but item 0 is a tuple"):
        ckptlab.with_sample_ids(dm.Points("tuple"), key="sample_id")[0]
    with pytest.raises(ValueError, match="already has a 'x' key"):
        ckptlab.with_sample_ids(dm.Points("dict"), key="x")[0]
    tracked = ckptlab.track_sample_ids(BatchSampler(range(6), 4, drop_last=False))
    assert [len(b) for b in DataLoader(range(6), batch_sampler=tracked)] == [4, 2]
    assert tracked.next_batch() == [0, 1, 2, 3] and tracked.next_batch() == [4, 5]
    with pytest.raises(RuntimeError, match="more often than the loader gave batches"):
        tracked.next_batch()


def test_state_carried_between_steps_is_recorded_as_model_state_and_replays_exactly(run_dir, cli):
    """An LSTM's hidden state carried from step to step, kept in the model as buffers: every
    checkpoint holds it, replay carries it bit for bit and names the sample (a column of the
    sequence-first batch) whose NaN weight started the fault."""
    from tests import carried_models as cm

    bad_step, bad_col = 13, 2
    model, opt = cm.build()
    with ckptlab.Recorder(run_dir, model, opt, step_fn=cm.step, build_fn=cm.build, ckpt_every=5) as rec:
        with pytest.raises(ckptlab.NonFiniteLoss):
            for s in range(20):
                rec.step(cm.chunk(s, bad_step, bad_col), sample_ids=[100 * s + b for b in range(cm.B)])
    assert "h" in ckptlab.open_run(run_dir).checkpoint(10).load_model()[0]  # the carried state is checkpointed
    r = cli("replay", "--run", run_dir, "--step", bad_step, "--json", "--no-counterfactuals")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["deterministic"] and doc["root_step"] == bad_step and doc["start_checkpoint"] == 10
    assert [s["sample_id"] for s in doc["samples"]][:1] == [100 * bad_step + bad_col]


def test_sequence_first_batches_are_split_by_sample_for_the_row_replays(run_dir, cli):
    """(T, B) batches: the rows replayed alone, without the blamed rows and in the minimal
    culprit are columns (dimension 1), not time steps."""
    from tests import carried_models as cm

    bad_step, bad_col = 7, 1
    model, opt = cm.build_seq_first()
    with ckptlab.Recorder(
        run_dir, model, opt, step_fn=cm.step_seq_first, build_fn=cm.build_seq_first, ckpt_every=5
    ) as rec:
        with pytest.raises(ckptlab.NonFiniteLoss):
            for s in range(10):
                rec.step(cm.seq_first_chunk(s, bad_step, bad_col), sample_ids=[100 * s + b for b in range(cm.B)])
    r = cli("replay", "--run", run_dir, "--step", bad_step, "--json", "--budget", 8)
    assert r.code == 0, r.err
    doc = r.json()
    assert [(s["row"], s["sample_id"]) for s in doc["samples"]] == [(bad_col, 100 * bad_step + bad_col)]
    without = next(c for c in doc["counterfactuals"] if "without the blamed rows" in c["question"])
    assert without["fault"] is False, without
    assert doc["culprit"]["rows"] == [bad_col], doc["culprit"]
