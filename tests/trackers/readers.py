"""Read what ckptlab wrote to MLflow and W&B back with the tools' own readers:
`MlflowClient` on the store, and W&B's `wandb leet inspect --json` on an offline run's log."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

# No network, no terminal output, no console capture: for every W&B run a test starts.
QUIET_WANDB = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true"}


def quiet_wandb(monkeypatch, home: Path) -> None:
    """W&B quiet and offline, its config, cache and logs under `home` (not the user's ~)."""
    for k, v in QUIET_WANDB.items():
        monkeypatch.setenv(k, v)
    for k, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(k, str(home / sub))


def wandb_records(run_dir) -> list[dict]:
    """Every record of the offline run(s) under `run_dir` (a run folder, or a `wandb` folder)."""
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **QUIET_WANDB},
    )
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def wandb_history(records: list[dict]) -> dict[str, list[tuple[int, object]]]:
    """name -> [(step, value)] from the history records, in order."""
    series: dict[str, list] = {}
    for r in records:
        if r.get("type") != "history":
            continue
        step = int(r["history"]["step"].get("num", 0))
        item = r["history"]["item"]
        for k, v in item.items():
            if not k.startswith("_"):
                series.setdefault(k, []).append((step, v))
    return series


def wandb_summary(records: list[dict]) -> dict:
    summary: dict = {}
    for r in records:
        if r.get("type") == "summary":
            summary.update(r["summary"].get("update", {}))
    return summary


def wandb_config(records: list[dict]) -> dict:
    """The run's config: set at `wandb.init`, then updated."""
    config: dict = {}
    for r in records:
        if r.get("type") == "run":
            config.update(r["run"].get("config", {}).get("update", {}))
        elif r.get("type") == "config":
            config.update(r["config"].get("update", {}))
    return config


def offline_runs(folder) -> list[Path]:
    return sorted(Path(folder).glob("wandb/offline-run-*"))


def mlflow_series(client, run_id: str, name: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))


def same(a, b) -> bool:
    """Equal values, NaN equal to NaN, float32 rounding allowed."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-6, equal_nan=True))


def nan_or(v) -> float:
    """W&B's JSON writes NaN as the string "NaN"."""
    return math.nan if isinstance(v, str) and v.lower() == "nan" else float(v)
