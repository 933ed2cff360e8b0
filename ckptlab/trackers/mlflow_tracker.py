"""MLflow: ckptlab's points as metrics, anomalies as tagged events, through `MlflowClient`.

    tracker = MLflow("sqlite:///mlflow.db", experiment="exp1")   # or ./mlruns, http://host:5000, ...
    rec = ckptlab.Recorder(..., trackers=[tracker])

Steps are the ckptlab step (MLflow keeps each metric's history by step). An anomaly becomes the
point `anomaly/<kind>` and a run tag `ckptlab.anomaly.<step>` whose value is the one-line
verdict with the replay command (MLflow has no alerts; tags are what its UI searches).

The store is opened and checked here (`open_client`): MLflow 3's local default, an SQLite
file (`sqlite:///mlflow.db`, which needs sqlalchemy and alembic: the `[mlflow]` extra), a
folder (`file:` store, kept by MLflow 3 on an opt-in only), or a server. A store that cannot be
opened is one CkptlabError naming it, before any work.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import sqlite3
import time
from dataclasses import replace
from pathlib import Path

from ckptlab.errors import CkptlabError, install_hint
from ckptlab.trackers.points import Alert, Row

# MLflow's log_batch limits: 1000 metrics, 100 params and 100 tags per call.
METRICS_PER_CALL, PARAMS_PER_CALL = 1000, 100
# The reachability check must answer in seconds: MLflow's own client retries a failing
# server for minutes (7 retries with exponential back-off) before it gives up.
CHECK_TIMEOUT_S = 10
# MLflow's SQL stores (sqlalchemy's dialects); they need sqlalchemy and alembic.
SQL_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
HINT = install_hint("mlflow", "mlflow-skinny sqlalchemy alembic")


def require_mlflow():
    try:
        import mlflow  # noqa: F401 - mlflow-skinny provides it
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise CkptlabError("logging to MLflow needs the mlflow (or mlflow-skinny) package", hint=HINT) from None
    return MlflowClient


def open_client(uri: str):
    """An `MlflowClient` on the tracking store `uri` (from `tracking_uri`), checked that it
    opens: a missing package, an unknown scheme, an SQLite file that cannot be opened or
    written, a folder that cannot be made are each one CkptlabError naming the store (MLflow
    itself would retry an unopenable SQLite file for minutes, then raise from deep inside)."""
    client_cls = require_mlflow()
    scheme = uri.split(":", 1)[0].split("+", 1)[0].lower()
    if scheme in SQL_SCHEMES:
        missing = [m for m in ("sqlalchemy", "alembic") if not _importable(m)]
        if missing:
            raise CkptlabError(
                f"MLflow's {scheme} store needs the {' and '.join(missing)} package", path=uri, hint=HINT
            )
    if scheme == "sqlite":
        check_sqlite(uri)
    # "Creating initial MLflow database tables...": MLflow's INFO lines, not ckptlab's output.
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    try:
        return client_cls(uri)
    except Exception as e:  # noqa: BLE001 - whatever the store raised: one line, before any work
        if "Unsupported" in type(e).__name__ and "URI" in type(e).__name__:
            raise CkptlabError(
                f"MLflow cannot open a store with the scheme '{scheme}:' "
                "(use sqlite:///mlflow.db, a folder or file: URI, or http(s)://host:port)",
                path=uri,
            ) from None
        raise CkptlabError(f"cannot open the MLflow tracking store: {_first_line(e)}", path=uri) from None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules holds None for it
        return False


def check_sqlite(uri: str) -> None:
    """The SQLite file of `uri` opens as a database and takes a write lock (MLflow makes its
    folder, and the file when missing; its tables it adds itself)."""
    text = uri.split("?", 1)[0]
    path = text[len("sqlite:///") :] if text.startswith("sqlite:///") else ""
    if path in ("", ":memory:"):
        return
    db = Path(path)
    try:
        db.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CkptlabError(f"cannot make the MLflow store's folder {db.parent}: {e.strerror}", path=uri) from None
    if db.exists() and not db.is_file():
        raise CkptlabError("cannot open the MLflow store: not a regular file", path=uri)
    try:
        con = sqlite3.connect(db, timeout=CHECK_TIMEOUT_S)
        try:
            con.execute("SELECT name FROM sqlite_master LIMIT 1").fetchall()
            con.execute("BEGIN IMMEDIATE")  # the write lock: a read-only file fails here
            con.rollback()
        finally:
            con.close()
    except sqlite3.Error as e:
        raise CkptlabError(f"cannot open the MLflow store: {e}", path=uri) from None


def tracking_uri(uri: str | os.PathLike) -> str:
    """A URI MLflow takes: a plain local path becomes `file:<absolute path>`. MLflow 3 keeps
    its file store only on an opt-in (MLFLOW_ALLOW_FILE_STORE): a `file:` URI given here is
    that opt-in."""
    text = os.fspath(uri)
    if "://" not in text and not text.startswith(("file:", "databricks", "sqlite:", "postgresql:", "mysql:")):
        text = Path(text).resolve().as_uri()
    if text.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return text


@contextlib.contextmanager
def _quick_requests():
    """MLflow's HTTP client without retries and with a short timeout (for the check only)."""
    keys = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(CHECK_TIMEOUT_S)}
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class MLflow:
    """One MLflow run that ckptlab logs into.

    Args:
        uri: the tracking URI: `sqlite:///mlflow.db` (MLflow 3's local default), `http(s)://host:port`,
            a folder or `file:` URI (MLflow 3's file store), ...; None: MLflow's own default
            (MLFLOW_TRACKING_URI, else `sqlite:///mlflow.db`).
        experiment: the experiment (created when missing).
        run_name: the new run's name.
        run_id: log into this existing run instead of creating one (it is not ended on close).
        client: an `MlflowClient` to use (e.g. Lightning's `MLFlowLogger.experiment`).
        prefix: put before every name; "ckptlab/" by default when logging into a run that
            someone else owns (`run_id`), so ckptlab's `train/loss` never mixes with yours.
        tags: tags of a new run.

    The store is checked (and the run created) here: a missing package, a store that cannot be
    opened (`open_client`) or an unreachable tracking server is one CkptlabError before
    training starts. A Tracker (trackers/tracker.py)
    for the Recorder, and an ExportSink (render/export.py) for `ckptlab export --mlflow`.
    """

    kind = "mlflow"

    def __init__(
        self,
        uri: str | os.PathLike | None = None,
        *,
        experiment: str = "ckptlab",
        run_name: str | None = None,
        run_id: str | None = None,
        client=None,
        prefix: str | None = None,
        tags: dict[str, str] | None = None,
    ):
        self.uri = tracking_uri(uri) if uri is not None else None
        if client is None:
            require_mlflow()
            import mlflow

            client = open_client(self.uri or mlflow.get_tracking_uri())
        self.client = client
        self.owned = run_id is None
        self.prefix = ("" if self.owned else "ckptlab/") if prefix is None else prefix
        where = self.uri or getattr(self.client, "tracking_uri", None) or "the MLflow tracking store"
        try:
            with _quick_requests():
                if run_id is None:
                    found = self.client.get_experiment_by_name(experiment)
                    exp_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
                    run_id = self.client.create_run(exp_id, run_name=run_name, tags=tags or {}).info.run_id
                else:
                    self.client.get_run(run_id)
        except CkptlabError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the store raised: one line, before any work
            raise CkptlabError(f"cannot reach the MLflow tracking store: {_first_line(e)}", path=where) from None
        self.run_id = run_id
        self.where = where

    # --- what the Recorder and the exports send ------------------------------------------

    def log_rows(self, rows: list[Row]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # The step's own recording time: MLflow's "relative time" axis is training time, and
        # the same point sent again is the same metric row.
        metrics = [
            Metric(self.prefix + k, float(v), int(r.time * 1000) if r.time else now, r.step)
            for r in rows
            for k, v in r.scalars.items()
        ]
        for i in range(0, len(metrics), METRICS_PER_CALL):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + METRICS_PER_CALL])
        for r in rows:
            for a in r.alerts:
                self.alert(a)
            if r.histograms:
                self.client.log_dict(self.run_id, _histograms_doc(r), f"histograms/step_{r.step:08d}.json")

    def log_rows_once(self, rows: list[Row]) -> int:
        """`log_rows` for rows that an interrupted export may have sent in part: a point
        whose (name, step) the run already holds is not sent again. Returns how many were not.

        An export sends a batch's points in step order (`log_rows`: row by row, in calls of
        METRICS_PER_CALL that each land whole in a SQL store, or as a prefix in a folder), so
        what a killed export left of a name is its points up to the highest step the run holds
        of it: one `get_run`, not every name's history, tells what is there."""
        last = self._last_steps({self.prefix + k for r in rows for k in r.scalars})
        held = 0
        again = []
        for r in rows:
            keep = {k: v for k, v in r.scalars.items() if r.step > last.get(self.prefix + k, -1)}
            held += len(r.scalars) - len(keep)
            again.append(replace(r, scalars=keep))
        self.log_rows(again)
        return held

    def _last_steps(self, names: set[str]) -> dict[str, int]:
        """name -> the highest step of it the run holds (MLflow's latest metric is the one of
        the highest step); from each name's history where the run's data does not say."""
        latest = getattr(self.client.get_run(self.run_id).data, "_metric_objs", None)
        if latest is None:
            history = self.client.get_metric_history
            return {n: max((m.step for m in history(self.run_id, n)), default=-1) for n in names}
        last: dict[str, int] = {}
        for m in latest:
            last[m.key] = max(last.get(m.key, -1), m.step)
        return last

    def alert(self, a: Alert) -> None:
        self.client.set_tag(self.run_id, f"ckptlab.anomaly.{a.step:08d}", a.text)

    def log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        # A param logged again with the same value is accepted (a re-export sends the same
        # manifest's); reading the run first would read every metric file of it.
        new = [Param(k, str(v)) for k, v in params.items()]
        for i in range(0, len(new), PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=new[i : i + PARAMS_PER_CALL])

    def log_file(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self, status: str = "FINISHED") -> None:
        if self.owned:
            self.client.set_terminated(self.run_id, status=status)

    # --- exports: where the previous export stopped --------------------------------------

    CURSOR_TAG = "ckptlab.export_cursor"

    def cursor(self) -> dict:
        tags = self.client.get_run(self.run_id).data.tags
        return json.loads(tags.get(self.CURSOR_TAG, "{}"))

    def save_cursor(self, cursor: dict) -> None:
        self.client.set_tag(self.run_id, self.CURSOR_TAG, json.dumps(cursor, sort_keys=True))

    @classmethod
    def for_export(cls, uri, *, experiment: str, run_name: str, run_key: str) -> MLflow:
        """The run that holds this ckptlab run's export (tag `ckptlab.run` = `run_key`):
        the one a previous export created, else a new one."""
        uri = tracking_uri(uri)
        client = open_client(uri)
        try:
            with _quick_requests():
                found = client.get_experiment_by_name(experiment)
                runs = (
                    client.search_runs(
                        [found.experiment_id], filter_string=f"tags.`ckptlab.run` = '{run_key}'", max_results=1
                    )
                    if found is not None
                    else []
                )
        except Exception as e:  # noqa: BLE001
            raise CkptlabError(f"cannot reach the MLflow tracking store: {_first_line(e)}", path=uri) from None
        if runs:
            out = cls(uri, client=client, run_id=runs[0].info.run_id, prefix="")
            out.owned = True
            out.client.update_run(out.run_id, status="RUNNING")
            return out
        return cls(uri, client=client, experiment=experiment, run_name=run_name, tags={"ckptlab.run": run_key})


def _histograms_doc(row: Row) -> dict:
    return {
        "step": row.step,
        "histograms": {
            name: {"edges": h.edges, "counts": h.counts, "min": h.min, "max": h.max, "num": h.num}
            for name, h in row.histograms.items()
        },
    }


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
