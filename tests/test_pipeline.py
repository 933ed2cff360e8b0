"""Pipeline stages (torch.distributed.pipelining), 2 processes, gloo on the CPU: a run under
ScheduleGPipe and one under Schedule1F1B (tests/pipe_models.py: a NaN sample that enters at stage
0, and the last stage's learning rate jumping), recorded once each and replayed on 2 processes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

import ckptlab
from ckptlab.errors import RecordError, ReplayError
from tests import pipe_models as pm
from tests.integrations.ddp_launch import replay_json, torchrun

WHOLE_MODEL = [
    "layers.0.fc.weight",
    "layers.0.fc.bias",
    "layers.1.fc.weight",
    "layers.1.fc.bias",
    "head.weight",
    "head.bias",
]


def _record(tmp_path_factory, kind: str):
    run_dir = tmp_path_factory.mktemp(kind) / "run"
    assert torchrun("pipe_models.py", run_dir, 2, kind) == [f"rank {r} recorded {pm.STEPS} steps" for r in (0, 1)]
    return run_dir


@pytest.fixture(scope="module")
def gpipe(tmp_path_factory):
    return _record(tmp_path_factory, "gpipe")


@pytest.fixture(scope="module")
def one_f_one_b(tmp_path_factory):
    return _record(tmp_path_factory, "1f1b")


def test_the_stages_are_recorded_as_one_model(gpipe):
    """Each stage's parameters under the whole model's names, in stage order; the loss is the
    last stage's; the learning rates are every stage's groups; a checkpoint holds every stage's
    tensors (one DCP folder), so it loads as the whole model in one process."""
    run = ckptlab.open_run(gpipe)
    manifest = run.manifest
    assert (manifest["layout"], run.world_size) == ("pipeline", 2)
    assert manifest["pipeline"] == {"schedule": "ScheduleGPipe", "stages": 2, "micro_batches": 2, "groups": [[0], [1]]}
    assert [(p["name"], p["stage"], p["group"]) for p in manifest["parameters"]] == [
        (name, 0 if name.startswith("layers.0") else 1, 0 if name.startswith("layers.0") else 1) for name in WHOLE_MODEL
    ]
    m = run.metrics()
    assert m.param_names == WHOLE_MODEL
    assert math.isnan(m.loss[m.index(pm.NAN_STEP)]) and all(math.isfinite(x) for x in m.loss[: pm.NAN_STEP])
    assert list(m.lr[m.index(pm.LR_STEP)]) == [pm.LR, pm.LR_JUMP] and list(m.lr[m.index(pm.LR_STEP - 1)]) == [pm.LR] * 2
    stage_norms = m.scalars[m.index(pm.LR_STEP)]["rank_grad_norm"]
    assert len(stage_norms) == 2 and m.grad_norm[m.index(pm.LR_STEP)] == pytest.approx(math.hypot(*stage_norms))
    ck = run.checkpoint(run.checkpoints[-1])
    assert ck.sharded and sorted(ck.load_model()[0]) == sorted(WHOLE_MODEL)
    for rank in (0, 1):  # every stage records the whole batch
        assert run.batch(pm.NAN_STEP, rank=rank)[1] == pm.sample_ids(pm.NAN_STEP)
    with pytest.raises(ReplayError, match="a pipeline stage cannot run alone"):
        ckptlab.replay(gpipe, pm.NAN_STEP, rank=1)


def test_a_nan_sample_is_named_by_its_stage_micro_batch_and_row(gpipe):
    report = ckptlab.replay(gpipe, pm.NAN_STEP)
    assert report.bit_exact and report.deterministic and all(c.match for c in report.steps)
    assert report.root_step == pm.NAN_STEP and report.rank == 0
    o = report.origin
    assert (o.kind, o.stage, o.micro_batch) == ("data", 0, pm.NAN_MICRO)
    assert "enters the model at `layers.0.fc`" in o.detail
    assert [(s.micro_batch, s.row, s.sample_id) for s in report.samples] == [
        (pm.NAN_MICRO, pm.NAN_MICRO_ROW, pm.sample_ids(pm.NAN_STEP)[pm.NAN_ROW])
    ]
    assert f"on rank 0 (pipeline stage 0, micro-batch {pm.NAN_MICRO})" in report.verdict
    assert f"micro-batch {pm.NAN_MICRO} row {pm.NAN_MICRO_ROW}" in report.verdict
    older = next(c for c in report.counterfactuals if "older model state" in c.question)
    assert older.fault is True  # the same batch from checkpoint 0, on both stages: the data alone


def test_a_learning_rate_jump_on_the_last_stage_is_named_with_its_group(gpipe):
    report = ckptlab.replay(gpipe, pm.LR_STEP + 1)
    assert report.bit_exact and all(c.match for c in report.steps)
    assert report.root_step == pm.LR_STEP and report.rank == pm.LR_STAGE
    o = report.origin
    assert (o.kind, o.stage, o.param_group) == ("optimizer", pm.LR_STAGE, 1)
    assert o.parameter in WHOLE_MODEL[2:]  # one of the last stage's
    assert "500x its recent value" in o.detail and report.samples == []
    recent = next(c for c in report.counterfactuals if "recent learning rate" in c.question)
    assert recent.fault is False  # set on the stage that holds group 1, the step is healthy


def test_1f1b_replays_bit_exact_from_the_command_line(one_f_one_b):
    doc = replay_json(one_f_one_b, pm.NAN_STEP)
    assert doc["bit_exact"] and doc["root_step"] == pm.NAN_STEP and doc["rank"] == 0
    assert (doc["origin"]["stage"], doc["origin"]["micro_batch"]) == (0, pm.NAN_MICRO)
    assert [(s["micro_batch"], s["row"], s["sample_id"]) for s in doc["samples"]] == [
        (pm.NAN_MICRO, pm.NAN_MICRO_ROW, pm.sample_ids(pm.NAN_STEP)[pm.NAN_ROW])
    ]


def test_a_stage_module_given_as_the_model_is_refused(tmp_path):
    """Without its schedule a stage's module looks like a whole model; the ranks' differ, which
    the Recorder sees when it starts, on every rank, before anything is written."""
    said = torchrun("pipe_models.py", tmp_path / "run", 2, "stage-module")
    assert len(said) == 2 and all("the ranks' models have different parameters" in line for line in said)
    assert not (tmp_path / "run").exists()


def test_stages_that_name_a_parameter_alike_are_refused():
    """Stages split by hand, each numbering its own modules: their parameters would share the
    run's slots and a checkpoint's keys."""
    from ckptlab.training.pipeline import Stages, micro_row
    from tests.models import MLP

    model = MLP()
    world = SimpleNamespace(rank=0, gather_objects=lambda mine: [mine, mine])
    stage = SimpleNamespace(stage_index=0, submod=model)
    schedule = SimpleNamespace(_n_microbatches=2)
    with pytest.raises(RecordError, match="pipeline stage 1 names parameter fc1.bias as an earlier stage does"):
        Stages.gather(stage, schedule, ckptlab.HandUpdate(model.parameters(), lr=0.1), world)
    assert [micro_row(r, 5, 2) for r in range(5)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]  # tensor_split's
