"""torch.compile end to end: a compiled model records (hooks, health, batches) and replays;
replay says it re-ran compiled and bit-exact, and that the per-op trace ran eagerly."""

import json

import numpy as np
import pytest
import torch

import ckptlab
from ckptlab.cli import main
from ckptlab.training import userfns
from ckptlab.training.state import is_compiled
from tests import compiled_models as cm
from tests import models

ROOT, ROW = 8, 2


def batches(n: int):
    for s, (batch, ids) in enumerate(models.mlp_batches(n)):
        if s == ROOT:
            x, y = batch
            x = x.clone()
            x[ROW] = 3e38  # finite, absurd: fc1's matmul sums to Inf
            batch = (x, y)
        yield batch, ids


def test_compiled_model_records_and_replays_bit_exact_with_an_eager_trace(run_dir, capsys):
    model, opt = cm.build_compiled()
    with ckptlab.Recorder(
        run_dir, model, opt, step_fn=cm.step_mlp, build_fn=cm.build_compiled, ckpt_every=5, on_nonfinite="record"
    ) as rec:
        for batch, ids in batches(ROOT + 1):
            rec.step(batch, sample_ids=ids)
    run = ckptlab.open_run(run_dir)
    assert run.manifest["config"]["compiled"] is True
    assert run.param_names == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]  # no _orig_mod.
    m = run.metrics()
    assert (m.param_grad_norm[:ROOT] > 0).all()  # the probe's gradient hooks fired through the graph
    assert np.isfinite(m.weight_norm[0]).all() and run.batch(3)[1] == [3000, 3001, 3002, 3003]

    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["replay", "--run", str(run_dir), "--step", str(ROOT), "--json"])
    assert done.value.code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["compiled"] is True and doc["recorded_compiled"] is True
    assert doc["bit_exact"] is True and doc["deterministic"] is True
    assert doc["trace_eager"] is True and any("ran eagerly" in n for n in doc["notes"])
    assert doc["root_step"] == ROOT and doc["origin"]["module"] == "fc1"
    assert doc["samples"][0]["sample_id"] == 1000 * ROOT + ROW
    assert torch.compiler.is_compiling() is False  # the trace's eager stance was lifted


def test_what_counts_as_compiled():
    """Compilation is lazy: these cost nothing until called."""
    assert is_compiled(cm.build_compiled()[0])  # torch.compile(model): an OptimizedModule
    in_place = models.MLP()
    assert not is_compiled(in_place)
    in_place.compile(backend="aot_eager")  # model.compile(): the same module, compiled
    assert is_compiled(in_place)
    assert is_compiled(torch.compile(models.step_mlp, backend="aot_eager")) and not is_compiled(models.step_mlp)


def test_a_compiled_step_fn_is_recorded_as_the_users_file(tmp_path):
    """`step = torch.compile(step)` at module level: found again by its name, and its source
    is the user's file (not torch's wrapper), so replay's trust check accepts it."""
    desc = userfns.describe(cm.step_compiled, "step_fn", tmp_path)
    assert desc["qualname"] == "step_compiled" and desc["file"].endswith("compiled_models.py")
    assert is_compiled(cm.step_compiled)
