"""Live trackers: the Recorder (and both framework callbacks) log the health into real MLflow
and W&B runs as it is recorded, read back with the tools' own readers; a tracker that fails
mid-run is reported once and the recording goes on."""

import dataclasses
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlflow")
pytest.importorskip("wandb")

import torch  # noqa: E402

import ckptlab  # noqa: E402
from ckptlab.render.export import ExportSink  # noqa: E402
from ckptlab.render.tensorboard import TensorBoardSink  # noqa: E402
from ckptlab.trackers import MLflow, Tracker, WandB, live  # noqa: E402
from tests import fault_models as fm  # noqa: E402
from tests.models import build_mlp, step_mlp  # noqa: E402
from tests.trackers.readers import (  # noqa: E402
    mlflow_series,
    nan_or,
    quiet_wandb,
    same,
    wandb_config,
    wandb_history,
    wandb_records,
    wandb_summary,
)

NAN_STEP = 9


@pytest.fixture(autouse=True)
def _quiet(monkeypatch, tmp_path_factory):
    quiet_wandb(monkeypatch, tmp_path_factory.getbasetemp() / "wandb-home")


def train(rec, steps: int, *, nan_at: int | None = None, every=None) -> None:
    for s in range(steps):
        x, y = fm._xy(s)
        if s == nan_at:
            x[1, 2] = float("nan")
        rec.step((x, y), sample_ids=fm.ids(s))
        if s % 4 == 3:
            rec.log_validation(val_loss=1.0 / (s + 1))
        if every is not None:
            every(s)


def warnings_of(caplog) -> str:
    """What ckptlab logged at WARNING (what a user with no logging set up sees on stderr)."""
    return "\n".join(
        r.getMessage() for r in caplog.records if r.name.startswith("ckptlab.") and r.levelno >= logging.WARNING
    )


def recorder(run_dir, trackers, **kw):
    model, opt = build_mlp()
    return ckptlab.Recorder(
        run_dir,
        model,
        opt,
        step_fn=step_mlp,
        build_fn=build_mlp,
        ckpt_every=5,
        on_nonfinite="record",
        on_anomaly=None,
        trackers=trackers,
        **kw,
    )


def test_recorder_logs_health_validation_params_and_one_alert_per_episode(tmp_path):
    ml = MLflow(tmp_path / "mlruns", experiment="live")
    wb = WandB(project="live", dir=tmp_path / "wb", mode="offline")
    assert isinstance(ml, Tracker) and isinstance(wb, Tracker)  # what live.py sends through
    assert all(issubclass(cls, ExportSink) for cls in (MLflow, WandB, TensorBoardSink))  # and exports write to
    with recorder(tmp_path / "run", [ml, wb]) as rec:
        train(rec, 14, nan_at=NAN_STEP)
    run = ckptlab.open_run(tmp_path / "run")
    m, name = run.metrics(), run.param_names[0]
    replay = f"ckptlab replay --run {tmp_path / 'run'} --step {NAN_STEP}"

    # MLflow, through its own client
    client, rid = ml.client, ml.run_id
    loss = mlflow_series(client, rid, "train/loss")
    assert [s for s, _ in loss] == list(range(14)) and same([v for _, v in loss], m.loss)
    assert same(
        [v for _, v in mlflow_series(client, rid, f"grad_norm/{name}")][:NAN_STEP], m.param_grad_norm[:NAN_STEP, 0]
    )
    measured = [s for s in range(14) if "update_ratio_global" in m.scalars[s]]  # every health_every=10 steps
    assert measured == [0, 10] and np.isnan(m.update_ratio[10]).all()  # the NaN step left the weights NaN
    assert [s for s, _ in mlflow_series(client, rid, f"update_ratio/{name}")] == [0]  # a NaN is not a point
    assert [s for s, _ in mlflow_series(client, rid, "val/val_loss")] == [4, 8, 12]
    found = client.get_run(rid)
    alerts = {k: v for k, v in found.data.tags.items() if k.startswith("ckptlab.anomaly.")}
    assert list(alerts) == [f"ckptlab.anomaly.{NAN_STEP:08d}"] and replay in alerts[f"ckptlab.anomaly.{NAN_STEP:08d}"]
    assert found.data.params["versions.torch"] == torch.__version__ and found.info.status == "FINISHED"

    # W&B, through `wandb leet inspect`
    records = wandb_records(wb.where)
    history = wandb_history(records)
    assert [s for s, _ in history["train/loss"]] == list(range(14))
    assert same([nan_or(v) for _, v in history["train/loss"]], m.loss)
    assert [s for s, _ in history["anomaly/nonfinite_loss"]][0] == NAN_STEP
    (line,) = wandb_summary(records)["ckptlab/anomalies"]
    assert line.startswith(f"step {NAN_STEP}: nonfinite loss") and line.endswith(replay)
    assert wandb_config(records)["ckptlab.ckpt_every"] == "5"


def test_a_tracker_failing_mid_run_is_reported_once_and_recording_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(live, "FLUSH_S", 0.02)
    store = tmp_path / "mlruns"
    ml = MLflow(store, experiment="live")
    sent = []

    def break_the_store(s):
        if s == 3:  # the store disappears under a running training
            sent.append(len(mlflow_series(ml.client, ml.run_id, "train/loss")))
            shutil.rmtree(store)
            store.write_text("not a store any more")

    with recorder(tmp_path / "run", [ml]) as rec:
        train(rec, 12, every=lambda s: (break_the_store(s), time.sleep(0.05)))  # let the sender run
        assert rec.live.failed.keys() == {"mlflow"}
    assert len(ckptlab.open_run(tmp_path / "run").metrics().step) == 12  # every step recorded
    err = warnings_of(caplog)
    assert err.count("ckptlab: mlflow stopped receiving points") == 1 and "training and recording go on" in err
    assert sent and sent[0] >= 1  # points went out while the store was there


def test_an_unreachable_server_or_a_missing_extra_fails_before_any_work(tmp_path, monkeypatch):
    with pytest.raises(ckptlab.CkptlabError, match="cannot reach the MLflow tracking store") as e:
        MLflow("http://127.0.0.1:9")
    assert "\n" not in str(e.value) and "127.0.0.1:9" in str(e.value)
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import` sees when it is not installed
    with pytest.raises(
        ckptlab.CkptlabError, match=r"pip install wandb; from ckptlab's clone: pip install -e '\.\[wandb\]'"
    ):
        WandB(project="x")
    with pytest.raises(ckptlab.RecordError, match="is not a tracker"):
        recorder(tmp_path / "run", [object()])
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_auto_finds_the_wandb_run_already_active_and_logs_under_ckptlab(tmp_path):
    import wandb

    from tests.trackers.readers import offline_runs

    user = wandb.init(project="mine", dir=tmp_path, mode="offline", settings=wandb.Settings(console="off", silent=True))
    try:
        with recorder(tmp_path / "run", "auto") as rec:
            for s in range(3):
                user.log({"my_metric": s})  # the user's own logging, stepless: untouched by ckptlab's
                train_one(rec, s)
    finally:
        user.finish()
    (offline,) = offline_runs(tmp_path)
    history = wandb_history(wandb_records(offline))
    assert [v for _, v in history["ckptlab/step"]] == [0, 1, 2]
    assert len(history["ckptlab/train/loss"]) == 3 and [v for _, v in history["my_metric"]] == [0, 1, 2]


def train_one(rec, s):
    x, y = fm._xy(s)
    rec.step((x, y), sample_ids=fm.ids(s))


@pytest.mark.filterwarnings("ignore:.*LeafSpec", "ignore:.*log_every_n_steps")
def test_lightning_logs_into_its_wandb_and_mlflow_loggers(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger

    from ckptlab.integrations import lightning as ckl
    from tests.integrations import lit_models as lm

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    wb = WandbLogger(project="lit", save_dir=str(tmp_path), offline=True)
    ml = MLFlowLogger(experiment_name="lit", tracking_uri=(tmp_path / "mlruns").as_uri())
    cb = ckl.CkptlabCallback(tmp_path / "run", build_fn=lm.build, sample_ids="idx", trackers="auto", on_anomaly=None)
    train, val = lm.loaders()
    torch.manual_seed(0)
    lm.trainer(tmp_path, callbacks=[cb], logger=[wb, ml], max_steps=6).fit(lm.LitMLP(), train, val)
    offline = wb.experiment.dir
    wb.experiment.finish()
    m = ckptlab.open_run(tmp_path / "run").metrics()
    history = wandb_history(wandb_records(Path(offline).parent))
    ours = [v for _, v in history["ckptlab/train/loss"]]
    assert [v for _, v in history["ckptlab/step"]] == list(range(6)) and same(ours, m.loss)
    assert "val_loss" in history and "trainer/global_step" in history  # Lightning's own logging, beside ours
    loss = mlflow_series(ml.experiment, ml.run_id, "ckptlab/train/loss")
    assert [s for s, _ in loss] == list(range(6)) and same([v for _, v in loss], m.loss)
    assert "val_loss" in ml.experiment.get_run(ml.run_id).data.metrics


def test_hf_trainer_logs_into_the_mlflow_run_report_to_started(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    import mlflow
    from mlflow.tracking import MlflowClient
    from transformers import GPT2LMHeadModel, Trainer

    from ckptlab.integrations import transformers as ckt
    from tests.integrations import hf_models as hm

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)  # the process-wide URI wins over the variable (Lightning's MLFlowLogger sets it)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    args = dataclasses.replace(
        hm.ARGS, report_to=["mlflow"], max_steps=6, eval_strategy="no", logging_strategy="steps", logging_steps=2
    )
    torch.manual_seed(0)
    trainer = Trainer(model=GPT2LMHeadModel(hm.config()), args=args, train_dataset=hm.Sequences())
    ckt.record(trainer, tmp_path / "run", build_fn=hm.build, sample_id_key="idx", trackers="auto", on_anomaly=None)
    trainer.train()
    client = MlflowClient(uri)
    (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    m = ckptlab.open_run(tmp_path / "run").metrics()
    ours = mlflow_series(client, found.info.run_id, "ckptlab/train/loss")
    assert [s for s, _ in ours] == list(range(6)) and same([v for _, v in ours], m.loss)
    assert "loss" in found.data.metrics  # the Trainer's own logging, beside ours
    assert not math.isnan(ours[0][1])


def test_a_hung_store_never_blocks_the_training(tmp_path, monkeypatch, caplog):
    """A metric file that blocks its writer, as a dead network mount does: the steps go on at
    their own pace, and close() gives up on the tracker after CLOSE_TIMEOUT_S, saying so."""
    monkeypatch.setattr(live, "FLUSH_S", 0.02)
    monkeypatch.setattr(live, "CLOSE_TIMEOUT_S", 0.3)
    ml = MLflow(tmp_path / "mlruns", experiment="live")
    run_folder = Path(ml.client.get_run(ml.run_id).info.artifact_uri.removeprefix("file://")).parent
    hang = run_folder / "metrics" / "train" / "loss"
    hang.parent.mkdir(parents=True)
    os.mkfifo(hang)  # opening it to write blocks until someone reads
    rec = recorder(tmp_path / "run", [ml])
    try:
        with rec:
            train(rec, 12, every=lambda s: time.sleep(0.02))
            assert rec.live._thread.is_alive()  # the sender is stuck in the store; the steps were not
        assert len(ckptlab.open_run(tmp_path / "run").metrics().step) == 12
        err = warnings_of(caplog)
        assert err.count("ckptlab: trackers did not finish sending within 0.3 s") == 1
    finally:  # let the stuck writer through (its line fits the pipe), then a plain file takes the name
        fd = os.open(hang, os.O_RDONLY | os.O_NONBLOCK)
        hang.unlink()
        hang.write_text("")
        rec.live._thread.join(30)
        os.close(fd)
    assert not rec.live._thread.is_alive() and rec.live.failed == {}
