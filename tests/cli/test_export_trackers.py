"""`ckptlab export --mlflow / --wandb`: read back with MLflow's own client and W&B's own
reader, checked against the run; exporting again sends nothing twice, also after an export
that was killed at any instant (the kills: tests/cli/kill_export.py)."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("wandb")

import ckptlab  # noqa: E402
from ckptlab.render.export import ExportSummary, rows  # noqa: E402
from tests import fault_models as fm  # noqa: E402
from tests.models import build_mlp, record_run, step_mlp  # noqa: E402
from tests.trackers.readers import (  # noqa: E402
    QUIET_WANDB,
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

ROOT = Path(__file__).resolve().parents[2]
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


def sqlite_template(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store, made once a session (MLflow creates its tables in
    seconds): tests copy it."""
    path = tmp_path_factory.getbasetemp() / "mlflow-template.db"
    if not path.exists():
        from mlflow.tracking import MlflowClient

        MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


def mlflow_run(uri):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("ckptlab")
    (found,) = client.search_runs([exp.experiment_id])
    return client, found


def test_mlflow_export_reads_back_and_exporting_again_adds_nothing(cli, run, tmp_path, tmp_path_factory, monkeypatch):
    # MLflow 3's local default: an SQLite file (its artifacts in ./mlruns), the README's line.
    monkeypatch.chdir(tmp_path)
    shutil.copyfile(sqlite_template(tmp_path_factory), tmp_path / "mlflow.db")
    store = "sqlite:///mlflow.db"
    r = cli("export", "--run", run.path, "--mlflow", store, "--no-grads")
    assert r.code == 0, r.err
    assert r.err == ""  # none of MLflow's "Creating initial MLflow database tables..." lines
    client, found = mlflow_run(store)
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


@pytest.mark.parametrize(
    ("case", "problem"),
    [
        ("foo://host/x", "cannot open a store with the scheme 'foo:'"),
        ("sqlite:///{tmp}/junk.db", "cannot open the MLflow store: file is not a database"),
        ("sqlite:///{tmp}", "cannot open the MLflow store: not a regular file"),
        ("sqlite:///{tmp}/afile/sub/x.db", "cannot make the MLflow store's folder"),
        ("{tmp}/afile/mlruns", "cannot open the MLflow tracking store"),
        ("sqlite:///{tmp}/new.db", "MLflow's sqlite store needs the sqlalchemy package"),
    ],
)
def test_a_store_that_cannot_be_opened_is_one_line(cli, run, tmp_path, monkeypatch, case, problem):
    (tmp_path / "junk.db").write_text("not a database, whatever its name\n")
    (tmp_path / "afile").write_text("a file where a folder would be\n")
    if "sqlalchemy" in problem:  # the [mlflow] extra not installed: mlflow-skinny alone
        monkeypatch.setitem(sys.modules, "sqlalchemy", None)
    uri = case.format(tmp=tmp_path)
    r = cli("export", "--run", run.path, "--mlflow", uri, "--no-grads")
    assert r.code == 1 and r.out == ""
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and problem in lines[0] and "internal error" not in lines[0], r.err
    assert uri.split("///")[-1] in lines[0]  # names the store
    if "sqlalchemy" in problem:
        assert (
            "pip install mlflow-skinny sqlalchemy alembic; from ckptlab's clone: pip install -e '.[mlflow]'" in lines[0]
        )


def test_a_store_that_fails_midway_is_one_line_and_the_mlflow_run_says_failed(cli, run, tmp_path, monkeypatch):
    from ckptlab.trackers.mlflow_tracker import MLflow

    def disk_full(self, rows):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(MLflow, "log_rows", disk_full)
    store = tmp_path / "mlruns"
    r = cli("export", "--run", run.path, "--mlflow", store, "--no-grads", "--no-html")
    assert r.code == 1 and r.out == ""
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and "the MLflow store failed while exporting" in lines[0], r.err
    assert "No space left on device" in lines[0] and str(store) in lines[0]
    _, found = mlflow_run(store.resolve().as_uri())
    assert found.info.status == "FAILED"  # not FINISHED: the next export goes on from its cursor


@pytest.mark.parametrize(("flag", "package"), [("--mlflow", "mlflow"), ("--wandb", "wandb")])
def test_a_missing_extra_is_one_line(cli, run, tmp_path, monkeypatch, flag, package):
    monkeypatch.setitem(sys.modules, package, None)  # what `import` sees when it is not installed
    r = cli("export", "--run", run.path, flag, tmp_path / "out", "--no-grads")
    assert r.code == 1 and r.out == ""
    assert r.err.strip() == next(line for line in r.err.splitlines() if line)
    assert f"from ckptlab's clone: pip install -e '.[{package}]'" in r.err
    assert not (tmp_path / "out").exists()


def test_one_target_at_a_time(cli, run, tmp_path):
    r = cli("export", "--run", run.path, "--wandb", tmp_path / "a", "--tensorboard", tmp_path / "b")
    assert r.code == 2 and "choose one of" in r.err


# --- killed exports (#28): SIGKILL at several instants (no except, no finally runs), then again

SMALL = {"rows": 5, "metrics": 20}  # 5 batches of rows, ~3 MLflow calls each
# Per batch: set_tag (the batch announced), log_batch x ~3, set_tag (the cursor saved); the
# anomaly's tag comes between them in batch 5: set_tag 1-4 are batches 1-2's, 9-11 batch 5's.
MLFLOW_KILLS = {  # name: (where it dies, the store)
    "sent-but-not-saved": ("before:set_tag:4", "sqlite"),  # batch 2 wholly sent, its cursor not saved
    "mid-batch": ("after:log_batch:5", "file"),  # batch 2 partly sent
    "announced-only": ("after:set_tag:3", "file"),  # batch 2 announced, none of it sent
    "last-batch": ("before:set_tag:11", "sqlite"),  # everything sent, the final cursor not saved
}
WANDB_KILLS = {
    "mid-fragment": "after:log_rows:2",
    "finished-not-listed": "after:close:1",  # the fragment is whole, the state file not updated
}


def forked_export(args: list[str], kill: str) -> int:
    """`ckptlab ARGS` in a forked child that SIGKILLs itself at `kill` (tests/cli/kill_export.py)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            from ckptlab.cli import main
            from tests.cli.kill_export import arm

            sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115
            arm(kill, **SMALL)
            main(args)
        finally:
            os._exit(3)  # not killed where it was meant to be
    return pid


def wait_child(pid: int, timeout: float) -> int:
    """The forked child's wait status; one that hangs (a lock some thread held at the fork)
    is killed after `timeout` s and fails its test, rather than the whole run hanging."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGTERM)
            return os.waitpid(pid, 0)[1]
        time.sleep(0.05)


@pytest.fixture(scope="module")
def killed(run, tmp_path_factory):
    """Every export below, started at once and killed at its instant: name -> its store. The
    W&B ones run as subprocesses (wandb's service must not be shared with a forked child)."""
    folder = tmp_path_factory.mktemp("killed")
    stores: dict = {name: folder / name for name in WANDB_KILLS}
    # Not WANDB_SERVICE: a W&B run made in this process left its service's address there.
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    env.update(QUIET_WANDB, PYTHONPATH=str(ROOT), CKPTLAB_TEST_ROWS=str(SMALL["rows"]))
    env.update(CKPTLAB_TEST_METRICS=str(SMALL["metrics"]))
    command = [sys.executable, "-m", "tests.cli.kill_export", "export", "--run", str(run.path), "--no-grads"]
    procs = {
        name: subprocess.Popen(
            [*command, "--wandb", str(stores[name])],
            env={**env, "CKPTLAB_TEST_KILL": kill},
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, kill in WANDB_KILLS.items()
    }
    pids = {}
    for name, (kill, kind) in MLFLOW_KILLS.items():
        if kind == "sqlite":
            shutil.copyfile(sqlite_template(tmp_path_factory), folder / f"{name}.db")
            stores[name] = f"sqlite:///{folder / name}.db"
        else:
            stores[name] = (folder / name).resolve().as_uri()
        cwd = os.getcwd()
        os.chdir(folder)  # MLflow puts an SQLite store's artifacts in ./mlruns
        try:
            pids[name] = forked_export(["export", "--run", str(run.path), "--mlflow", stores[name], "--no-grads"], kill)
        finally:
            os.chdir(cwd)
    killed = {}  # name -> whether it died at its instant (each test checks its own)
    for name, pid in pids.items():
        status = wait_child(pid, timeout=120)
        killed[name] = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    for name, p in procs.items():
        p.communicate(timeout=120)
        killed[name] = p.returncode == -signal.SIGKILL
    return stores, folder, killed


def expected(run) -> set[tuple[str, int]]:
    """Every (name, step) that one whole export sends (as --no-grads)."""
    out = ExportSummary("", 0, 0, 0, [], [])
    return {(k, r.step) for r, _ in rows(run, out) for k in r.scalars}


def held(uri: str) -> tuple[Counter, object]:
    client, found = mlflow_run(uri)
    rid = found.info.run_id
    names = client.get_run(rid).data.metrics
    return Counter((k, m.step) for k in names for m in client.get_metric_history(rid, k)), found


@pytest.mark.parametrize("name", list(MLFLOW_KILLS))
def test_an_mlflow_export_killed_at_any_instant_then_run_again_holds_every_point_once(
    cli, run, killed, name, monkeypatch
):
    stores, folder, died = killed
    assert died[name], "not killed at its instant"
    monkeypatch.chdir(folder)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # to read the file: stores back
    want, uri = expected(run), stores[name]
    points, found = held(uri)
    # What the store says of the killed export is true: still RUNNING (nobody ended it);
    # every step up to the cursor is there, nothing past the batch it announced.
    assert found.info.status == "RUNNING"
    cursor = json.loads(found.data.tags["ckptlab.export_cursor"])
    done = max(cursor[k] for k in ("health", "validation", "events", "checkpoints"))
    assert {p for p in want if p[1] <= done} <= set(points) <= want
    assert max(s for _, s in points) <= max(cursor.get("sending", {}).values(), default=done)
    before = len(points)

    r = cli("export", "--run", run.path, "--mlflow", uri, "--no-grads", "--no-html", "--json")
    assert r.code == 0, r.err
    points, found = held(uri)
    assert set(points) == want and max(points.values()) == 1, [p for p, n in points.items() if n > 1][:5]
    assert any("stopped while sending" in n for n in r.json()["notes"])
    assert r.json()["scalars"] == len(want) - before  # what it sent, not what it skipped
    assert found.info.status == "FINISHED" and "sending" not in found.data.tags["ckptlab.export_cursor"]
    again = cli("export", "--run", run.path, "--mlflow", uri, "--no-grads", "--json")
    assert again.code == 0 and again.json()["already_exported"] is True


@pytest.mark.parametrize("name", list(WANDB_KILLS))
def test_a_wandb_export_killed_midway_then_run_again_holds_every_point_once(cli, run, killed, name):
    folder = killed[0][name]
    assert killed[2][name], "not killed at its instant"
    assert len(offline_runs(folder)) == 1 and not (folder / "ckptlab-export.json").exists()
    r = cli("export", "--run", run.path, "--wandb", folder, "--no-grads", "--no-html", "--json")
    assert r.code == 0, r.err
    # What `wandb sync` would upload: every fragment left in the folder.
    points = Counter(
        (k, s)
        for fragment in offline_runs(folder)
        for k, series in wandb_history(wandb_records(fragment)).items()
        for s, _ in series
        if "/" in k and not k.startswith(("weights/", "grads/"))
    )
    want = expected(run)
    assert set(points) == want and max(points.values()) == 1, [p for p, n in points.items() if n > 1][:5]
    assert any("unfinished fragment" in n for n in r.json()["notes"])
