"""`ckptlab export --tensorboard`: read back with TensorBoard's own event reader."""

import math

import numpy as np
import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

import ckptlab  # noqa: E402
from tests.models import build_lm, lm_batches, record_run, step_lm  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("export") / "run"
    record_run(
        run_dir,
        build_lm,
        step_lm,
        lm_batches(25),
        ckpt_every=10,
        validate=lambda i, m: {"val_loss": 1.0 / (i + 1)} if i % 8 == 7 else None,
    )
    return ckptlab.open_run(run_dir)


def read(logdir) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_health_curves_validation_and_histograms_read_back(cli, run, tmp_path):
    r = cli("export", "--run", run.path, "--tensorboard", tmp_path / "tb")
    assert r.code == 0, r.err
    assert "tensorboard --logdir" in r.out
    acc = read(tmp_path / "tb")
    m = run.metrics()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == m.step.tolist()
    assert np.allclose([e.value for e in loss], m.loss, rtol=1e-6)  # stored as float32
    assert np.allclose([e.value for e in acc.Scalars("train/grad_norm")], m.grad_norm, rtol=1e-6)
    assert np.allclose([e.value for e in acc.Scalars("train/lr")], m.lr[:, 0], rtol=1e-6)
    assert [e.step for e in acc.Scalars("train/update_ratio")] == [s for s in m.step.tolist() if s % 10 == 0]
    assert [(e.step, e.value) for e in acc.Scalars("val/val_loss")] == [
        (8, 0.125),
        (16, pytest.approx(1 / 16)),
        (24, pytest.approx(1 / 24)),
    ]
    name = m.param_names[0]
    assert len(acc.Scalars(f"grad_norm/{name}")) == len(m.step)
    tags = acc.Tags()["histograms"]
    assert {f"weights/{n}" for n in m.param_names} <= set(tags)
    assert {f"grads/{n}" for n in m.param_names} <= set(tags)
    weights = acc.Histograms(f"weights/{name}")
    assert [h.step for h in weights] == run.checkpoints
    assert weights[0].histogram_value.num == math.prod(run.checkpoint(run.checkpoints[0]).load_model()[0][name].shape)


def test_json_summary_and_no_grads(cli, run, tmp_path):
    r = cli("export", "--run", run.path, "--tensorboard", tmp_path / "tb", "--no-grads", "--json")
    assert r.code == 0, r.err
    assert r.err == ""  # no progress bar (nor anything else) when not a terminal / with --json
    doc = r.json()
    assert doc["steps"] == 25 and doc["checkpoints"] == run.checkpoints and doc["gradient_checkpoints"] == []
    assert not any(t.startswith("grads/") for t in read(tmp_path / "tb").Tags()["histograms"])


def test_a_damaged_run_exports_what_it_can_then_fails_naming_the_damage(cli, run, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run.path, copy)
    segment = sorted((copy / "journal").glob("s*.log"))[0]  # its session went on: whole, once
    segment.write_bytes(segment.read_bytes()[:-50])
    r = cli("export", "--run", copy, "--tensorboard", tmp_path / "tb", "--no-grads", "--json")
    assert r.code == 1 and r.json()["steps"] > 0  # what was readable is exported
    errors = [line for line in r.err.splitlines() if line.startswith("ckptlab: error:")]
    assert len(errors) == 1 and segment.name in errors[0] and "corrupt file" in errors[0]


def test_curves_are_thinned_on_request_and_on_long_runs(cli, run, tmp_path, monkeypatch):
    """`--every N` sends the health curves every N steps (the update ratios, measured every 10
    steps, at each of theirs) and every step with a validation or a checkpoint. Without it, a
    run longer than the caps gets every 2nd, 5th, 10th... step's points, and says so."""
    from ckptlab.render import export

    m = run.metrics()
    name = m.param_names[0]
    steps = m.step.tolist()
    marked = {8, 16, 24, *run.checkpoints}  # validations, checkpoints
    r = cli("export", "--run", run.path, "--tensorboard", tmp_path / "a", "--no-grads", "--every", "4", "--json")
    assert r.code == 0, r.err
    acc = read(tmp_path / "a")
    assert [e.step for e in acc.Scalars(f"grad_norm/{name}")] == [s for s in steps if s % 4 == 0 or s in marked]
    assert [e.step for e in acc.Scalars("train/loss")] == [s for s in steps if s % 4 == 0 or s in marked]
    assert [e.step for e in acc.Scalars(f"update_ratio/{name}")] == [0, 10, 20]
    assert [e.step for e in acc.Scalars("val/val_loss")] == [8, 16, 24]
    assert any("grad_norm/<param> a point per 4 steps" in n for n in r.json()["notes"])

    # 25 steps over caps of 10 (run curves) and 4 (per parameter): every 5th and every 10th
    monkeypatch.setattr(export, "RUN_CURVE_POINTS", 10)
    monkeypatch.setattr(export, "PARAM_CURVE_POINTS", 4)
    r = cli("export", "--run", run.path, "--tensorboard", tmp_path / "b", "--no-grads", "--json")
    assert r.code == 0, r.err
    acc = read(tmp_path / "b")
    assert [e.step for e in acc.Scalars("train/loss")] == [s for s in steps if s % 5 == 0 or s in marked]
    assert [e.step for e in acc.Scalars(f"grad_norm/{name}")] == [s for s in steps if s % 10 == 0 or s in marked]
    assert [e.step for e in acc.Scalars(f"update_ratio/{name}")] == [0, 10, 20]  # 3 records: all
    assert r.json()["scalars"] < len(steps) * len(m.param_names)


def test_a_thinned_curve_keeps_the_steps_with_an_anomaly(tmp_path):
    """A label of 1e17 at step 25: the loss and gradient norm spike there, finite, and the
    per-parameter curves thinned to every 7th step still show the step."""
    from ckptlab.render.tensorboard import write_tensorboard
    from tests import fault_models as fm

    fm.record_huge_target(tmp_path / "run")
    run = ckptlab.open_run(tmp_path / "run")
    m = run.metrics()
    flagged = {e["step"] for e in run.events()} | set(run.checkpoints)
    grads = m.param_grad_norm[:, 0]
    shown = {int(s) for s, g in zip(m.step, grads) if np.isfinite(g) and (s % 7 == 0 or s in flagged)}
    assert 25 in shown
    write_tensorboard(run, tmp_path / "tb", every=7)
    acc = read(tmp_path / "tb")
    assert [e.step for e in acc.Scalars(f"grad_norm/{m.param_names[0]}")] == sorted(shown)


def test_refuses_to_mix_two_exports_in_one_folder(cli, run, tmp_path):
    assert cli("export", "--run", run.path, "--tensorboard", tmp_path / "tb", "--no-grads").code == 0
    r = cli("export", "--run", run.path, "--tensorboard", tmp_path / "tb", "--no-grads")
    assert r.code == 1 and "already holds TensorBoard event files" in r.err and r.out == ""


def test_anomalies_and_a_nan_loss_are_exported(tmp_path):
    from ckptlab.render.tensorboard import write_tensorboard
    from tests import fault_models as fm

    exp = fm.record_input_nan(tmp_path / "nan")
    nan_run = ckptlab.open_run(tmp_path / "nan")
    summary = write_tensorboard(nan_run, tmp_path / "tb")
    assert summary.steps == len(nan_run.steps)
    acc = read(tmp_path / "tb")
    assert math.isnan(acc.Scalars("train/loss")[-1].value)
    text = acc.Tensors("anomalies/text_summary")[-1]
    assert text.step == exp.step and b"nonfinite loss" in text.tensor_proto.string_val[0]


def test_nonfinite_values_are_counted_beside_the_histogram():
    import torch

    from ckptlab.render.export import _histograms
    from ckptlab.trackers.points import Row

    row = Row(7)
    _histograms(
        row,
        "weights",
        {"w": torch.tensor([1.0, float("nan"), float("inf"), -2.0]), "n": torch.full((3,), float("nan"))},
    )
    assert row.scalars == {"nonfinite/weights/w": 2.0, "nonfinite/weights/n": 3.0}
    h = row.histograms["weights/w"]
    assert list(row.histograms) == ["weights/w"] and h.num == 2 and sum(h.counts) == 2
    assert (h.min, h.max, h.sum, h.sum_squares) == (-2.0, 1.0, -1.0, 5.0)
    assert len(h.edges) == len(h.counts) + 1 and h.edges[0] == -2.0 and h.edges[-1] == 1.0


def test_progress_bar_counts_on_a_terminal_and_is_silent_otherwise():
    import io

    from rich.console import Console

    from ckptlab.render.console import Terminal

    term = Terminal()
    term.err = Console(file=io.StringIO(), force_terminal=True, width=100)
    with term.progress("exporting checkpoints", total=3) as update:
        for i in range(3):
            update(i + 1)
    assert "3/3" in term.err.file.getvalue()
    quiet = Terminal(json_mode=True)
    quiet.err = Console(file=io.StringIO(), force_terminal=True)
    with quiet.progress("x", total=3) as update:
        update(1, description="y")
    assert quiet.err.file.getvalue() == ""


def test_the_event_files_checksums_are_tensorboards():
    """The event file is written here (render/tensorboard.py EventFile), its TFRecord CRCs by
    google-crc32c where installed: the same values as TensorBoard's own."""
    import os

    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    from ckptlab.render.tensorboard import _masked_crc32c

    crc = _masked_crc32c()
    for data in (b"", b"a", bytes(range(256)) * 3, os.urandom(1000)):
        assert crc(data) == masked_crc32c(data)
