"""`ckptlab export --mlflow / --wandb`: read back with MLflow's own client and W&B's own
reader, checked against the run; exporting again sends nothing twice."""

import math
import re
import sys

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("wandb")

import ckptlab  # noqa: E402
from tests import fault_models as fm  # noqa: E402
from tests.models import build_mlp, record_run, step_mlp  # noqa: E402
from tests.trackers.readers import (  # noqa: E402
    mlflow_series,
    nan_or,
    offline_runs,
    quiet_wandb,
    same,
    wandb_config,
    wandb_history,
    wandb_records,
    wandb_summary,
)

NAN_STEP = 20
VAL = [(8, 0.125), (16, 0.0625), (24, pytest.approx(1 / 24))]  # after steps 7, 15, 23


def batches(first: int, last: int):
    for s in range(first, last):
        x, y = fm._xy(s)
        if s == NAN_STEP:
            x[2, 3] = float("nan")
        yield x, y


def record(run_dir, first: int, last: int, **kw):
    return record_run(
        run_dir,
        build_mlp,
        step_mlp,
        ((b, fm.ids(first + i)) for i, b in enumerate(batches(first, last))),
        ckpt_every=10,
        keep_last=10,
        on_nonfinite="record",
        on_anomaly=None,
        stop_on_nonfinite=False,
        validate=lambda i, m: {"val_loss": 1.0 / (first + i + 1)} if (first + i) % 8 == 7 else None,
        **kw,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("export-trackers") / "run"
    record(run_dir, 0, 24)
    return ckptlab.open_run(run_dir)


@pytest.fixture(autouse=True)
def _quiet(monkeypatch, tmp_path_factory):
    quiet_wandb(monkeypatch, tmp_path_factory.getbasetemp() / "wandb-home")


def mlflow_run(uri):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("ckptlab")
    (found,) = client.search_runs([exp.experiment_id])
    return client, found


def test_mlflow_export_reads_back_and_exporting_again_adds_nothing(cli, run, tmp_path):
    store = tmp_path / "mlruns"
    r = cli("export", "--run", run.path, "--mlflow", store, "--no-grads")
    assert r.code == 0, r.err
    client, found = mlflow_run(store.resolve().as_uri())
    rid, m = found.info.run_id, run.metrics()
    loss = mlflow_series(client, rid, "train/loss")
    assert [s for s, _ in loss] == m.step.tolist() and same([v for _, v in loss], m.loss)
    assert math.isnan(loss[NAN_STEP][1])  # a NaN loss is a point too
    stamps = sorted((x.step, x.timestamp) for x in client.get_metric_history(rid, "train/loss"))
    assert [t for _, t in stamps] == [int(r["time"] * 1000) for r in m.scalars]  # training time, not export time
    name = m.param_names[0]
    assert same(
        [v for _, v in mlflow_series(client, rid, f"grad_norm/{name}")][:NAN_STEP], m.param_grad_norm[:NAN_STEP, 0]
    )
    assert [s for s, _ in mlflow_series(client, rid, f"update_ratio/{name}")] == [
        0,
        10,
    ]  # health_every=10 (at 20 it is NaN: not a point)
    assert mlflow_series(client, rid, "val/val_loss") == VAL
    assert mlflow_series(client, rid, "anomaly/nonfinite_loss")[0][0] == NAN_STEP
    # One tagged event per anomaly episode, carrying the verdict line and the replay command.
    alerts = {k: v for k, v in found.data.tags.items() if k.startswith("ckptlab.anomaly.")}
    assert list(alerts) == [f"ckptlab.anomaly.{NAN_STEP:08d}"]
    assert f"ckptlab replay --run {run.path} --step {NAN_STEP}" in alerts[f"ckptlab.anomaly.{NAN_STEP:08d}"]
    assert found.data.params["versions.torch"] == run.manifest["versions"]["torch"]
    assert found.data.params["ckptlab.ckpt_every"] == "10"
    files = {f.path for f in client.list_artifacts(rid)} | {f.path for f in client.list_artifacts(rid, "histograms")}
    assert "ckptlab-report.html" in files and "histograms/step_00000010.json" in files
    hist = client.download_artifacts(rid, "histograms/step_00000010.json", str(tmp_path))
    assert "weights/" + name in open(hist).read()

    again = cli("export", "--run", run.path, "--mlflow", store, "--no-grads", "--json")
    assert again.code == 0 and again.json()["already_exported"] is True
    assert len(mlflow_series(client, rid, "train/loss")) == len(m.step)


def test_exporting_a_run_that_went_on_sends_only_the_new_points(cli, tmp_path):
    run_dir, store, wb = tmp_path / "run", tmp_path / "mlruns", tmp_path / "wb"
    record(run_dir, 0, 12)
    for target in (["--mlflow", store], ["--wandb", wb]):
        assert cli("export", "--run", run_dir, *target, "--no-grads", "--no-html").code == 0
    record(run_dir, 12, 18, resume=True)
    for target in (["--mlflow", store], ["--wandb", wb]):
        r = cli("export", "--run", run_dir, *target, "--no-grads", "--no-html", "--json")
        assert r.code == 0, r.err
        assert r.json()["steps"] == 6 and r.json()["checkpoints"] == [12, 16]  # session start; best val
    client, found = mlflow_run(store.resolve().as_uri())
    assert [s for s, _ in mlflow_series(client, found.info.run_id, "train/loss")] == list(range(18))
    assert [s for s, _ in mlflow_series(client, found.info.run_id, "val/val_loss")] == [8, 16]
    # W&B: a second fragment of the same run id, holding only the new steps
    first, second = offline_runs(wb)
    # offline-run-<time>-<id>; wandb adds "-1" to a second fragment started in the same second
    fragment = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(r.json()['run_id'])}(-\d+)?")
    assert fragment.fullmatch(first.name) and fragment.fullmatch(second.name), (first.name, second.name)
    history = wandb_history(wandb_records(second))
    assert [s for s, _ in history["train/loss"]] == list(range(12, 18)) and history["val/val_loss"] == [(16, 0.0625)]


def test_wandb_export_reads_back_with_wandbs_reader_and_is_idempotent(cli, run, tmp_path):
    r = cli("export", "--run", run.path, "--wandb", tmp_path / "wb", "--no-grads", "--no-html")
    assert r.code == 0, r.err
    assert "wandb sync" in r.out
    (offline,) = offline_runs(tmp_path / "wb")
    records = wandb_records(offline)
    history, m = wandb_history(records), run.metrics()
    loss = history["train/loss"]
    assert [s for s, _ in loss] == m.step.tolist() and same([nan_or(v) for _, v in loss], m.loss)
    name = m.param_names[0]
    assert same([v for _, v in history[f"grad_norm/{name}"]][:NAN_STEP], m.param_grad_norm[:NAN_STEP, 0])
    assert history["val/val_loss"] == VAL
    assert [s for s, _ in history["anomaly/nonfinite_loss"]][0] == NAN_STEP
    # Histograms are logged at the checkpoint's step, in the same increasing-step history.
    weights = history[f"weights/{name}._type"]
    assert [s for s, _ in weights] == [0, 8, 10, 16, 20] and weights[0][1] == "histogram"
    assert run.checkpoints[-1] == 24 and history[f"nonfinite/weights/{name}"] == [(24, 16 * 8)]  # all NaN: counted
    (line,) = wandb_summary(records)["ckptlab/anomalies"]
    assert f"ckptlab replay --run {run.path} --step {NAN_STEP}" in line
    assert wandb_config(records)["versions.torch"] == run.manifest["versions"]["torch"]

    again = cli("export", "--run", run.path, "--wandb", tmp_path / "wb", "--no-grads", "--json")
    assert again.code == 0 and again.json()["already_exported"] is True
    assert offline_runs(tmp_path / "wb") == [offline]  # no second fragment


def test_an_unreachable_store_is_one_line_before_any_work(cli, run, tmp_path):
    r = cli("export", "--run", run.path, "--mlflow", "http://127.0.0.1:9", "--no-grads")
    assert r.code == 1 and r.out == ""
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the MLflow tracking store" in lines[0] and "127.0.0.1:9" in lines[0]


@pytest.mark.parametrize(("flag", "package"), [("--mlflow", "mlflow"), ("--wandb", "wandb")])
def test_a_missing_extra_is_one_line(cli, run, tmp_path, monkeypatch, flag, package):
    monkeypatch.setitem(sys.modules, package, None)  # what `import` sees when it is not installed
    r = cli("export", "--run", run.path, flag, tmp_path / "out", "--no-grads")
    assert r.code == 1 and r.out == ""
    assert r.err.strip() == next(line for line in r.err.splitlines() if line)
    assert f"pip install 'ckptlab[{package}]'" in r.err
    assert not (tmp_path / "out").exists()


def test_one_target_at_a_time(cli, run, tmp_path):
    r = cli("export", "--run", run.path, "--wandb", tmp_path / "a", "--tensorboard", tmp_path / "b")
    assert r.code == 2 and "choose one of" in r.err
