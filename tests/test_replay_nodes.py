"""Replay as a distributed job: a 4-rank DDP run replayed by two torchrun "nodes" on this
machine (2 processes each, gloo on the CPU), as a Slurm job would replay it across two machines.

`python -m torch.distributed.run --standalone --nproc_per_node=4 tests/test_replay_nodes.py RUN`
records the run (tests/dist_models.py's wide DDP model), with the NaN in rank 3's batch: on the
second node, so the state the root step started in travels from there to rank 0. The replay
starts from a checkpoint in the middle of the run, where DDP's buckets had been rebuilt.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import ckptlab
from tests import dist_models as dm

ROOT = Path(__file__).resolve().parent.parent
NAN_RANK = 3  # on node 1 (ranks 2 and 3)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(node_rank: int, port: int, run_dir: Path, *args: str, nproc: int = 2) -> subprocess.Popen:
    """One "node": torchrun with `nproc` processes, joining the other node at 127.0.0.1:port."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        f"--nproc_per_node={nproc}",
        f"--node-rank={node_rank}",
        "--rdzv-backend=static",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "-m",
        "ckptlab",
        *args,
    ]
    env = {**_env(), "CKPTLAB_RUN": str(run_dir)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def two_nodes(run_dir: Path, *args: str, nproc: int = 2) -> list[tuple[int, str, str]]:
    """`ckptlab ARGS` on `run_dir` as a job of two torchrun nodes started together, `nproc`
    processes each: (code, stdout, stderr) of each."""
    port = _free_port()
    nodes = [_node(n, port, run_dir, *args, nproc=nproc) for n in (0, 1)]
    done = []
    for p in nodes:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in nodes:
                q.kill()
            raise
        done.append((p.returncode, out, err))
    return done


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ddp4") / "run"
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", __file__]
    done = subprocess.run([*args, str(run_dir)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return run_dir


def test_two_nodes_replay_a_four_rank_run_bit_exactly_and_name_the_rank_row_and_sample(run4):
    """Each node runs its two ranks; rank 0 (node 0) prints the report, node 1 prints nothing.
    The run is named by CKPTLAB_RUN: torchrun's own options would take `--run` for `--run-path`."""
    replay = ["replay", "--step", str(dm.NAN_STEP), "--json", "--budget", "0"]
    (code0, out0, err0), (code1, out1, err1) = two_nodes(run4, *replay)
    assert code0 == 0 and code1 == 0, (err0[-2000:], err1[-2000:])
    assert out1.strip() == "" and "warning" not in err1, (out1[-500:], err1[-500:])
    doc = json.loads(out0)
    assert doc["deterministic"] and doc["bit_exact"] and all(c["match"] for c in doc["steps"]), doc["verdict"]
    assert doc["start_checkpoint"] == 15  # mid-run: DDP's buckets rebuilt as the recording's were
    assert [len(c["rank_loss"]) for c in doc["steps"]] == [4] * len(doc["steps"])  # every rank's loss, checked
    assert doc["root_step"] == dm.NAN_STEP and doc["rank"] == NAN_RANK
    nan_id = dm.sample_ids(dm.NAN_STEP, NAN_RANK)[dm.NAN_ROW]
    assert [(s["row"], s["sample_id"]) for s in doc["samples"]] == [(dm.NAN_ROW, nan_id)]
    assert doc["origin"]["kind"] == "data" and doc["counterfactuals"][0]["fault"] is False  # proven without the row
    # as the single-machine replay says it (tests/test_distributed.py)
    assert (
        doc["verdict"].startswith(f"Step {dm.NAN_STEP} on rank {NAN_RANK}: ") and f"sample {nan_id}" in doc["verdict"]
    )


def test_two_nodes_of_one_process_fold_the_four_ranks(run4):
    """`--world-size 2` under torchrun: the job's two processes (one a node) are the fold's,
    each running two ranks' turns (0 and 2, 1 and 3): the same root step, rank and sample."""
    replay = ["replay", "--step", str(dm.NAN_STEP), "--json", "--budget", "0", "--world-size", "2"]
    (code0, out0, err0), (code1, out1, err1) = two_nodes(run4, *replay, nproc=1)
    assert code0 == 0 and code1 == 0, (err0[-2000:], err1[-2000:])
    assert out1.strip() == "", out1[-500:]
    doc = json.loads(out0)
    nan_id = dm.sample_ids(dm.NAN_STEP, NAN_RANK)[dm.NAN_ROW]
    assert (doc["root_step"], doc["rank"], doc["world_size"]) == (dm.NAN_STEP, NAN_RANK, 2), doc["verdict"]
    assert [(s["row"], s["sample_id"]) for s in doc["samples"]] == [(dm.NAN_ROW, nan_id)]
    assert [len(c["rank_loss"]) for c in doc["steps"]] == [4] * len(doc["steps"])  # every rank's turn
    assert doc["agreement"] in ("bit-exact", "equivalent") and "diverged" not in doc["verdict"]
    assert any("replayed on 2 processes for the recorded 4" in n for n in doc["notes"])


def test_a_fold_under_a_launcher_of_another_size_is_refused(run4, monkeypatch):
    _launched(monkeypatch, 1, 4)
    with pytest.raises(ckptlab.CkptlabError, match=r"--world-size 2: this job has 4 processes \(WORLD_SIZE\)"):
        ckptlab.replay(run4, dm.NAN_STEP, world_size=2)
    with pytest.raises(ckptlab.CkptlabError, match=r"--world-size 1 replays in this one process, and this is one of 4"):
        ckptlab.replay(run4, dm.NAN_STEP, world_size=1)


def _launched(monkeypatch, rank: int, size: int) -> None:
    """This process as rank `rank` of `size` that torchrun started (its environment)."""
    env = {"RANK": rank, "WORLD_SIZE": size, "LOCAL_RANK": rank % 2, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 1}
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))


def test_a_job_of_another_size_is_refused_in_one_line(run4, monkeypatch):
    """Two launched processes for a 4-rank run: a clear error before any process group, not a hang."""
    _launched(monkeypatch, 1, 2)
    with pytest.raises(ckptlab.CkptlabError, match=r"recorded on 4 processes, and this job has 2 \(WORLD_SIZE\)"):
        ckptlab.replay(run4, dm.NAN_STEP)


def test_a_one_process_replay_is_refused_under_a_launcher(run4, monkeypatch, cli):
    """`--rank R` replays in one process: under torchrun every process would do it again."""
    _launched(monkeypatch, 0, 4)
    done = cli("replay", "--run", run4, "--step", dm.NAN_STEP, "--rank", 1)
    assert done.code == 2 and "--rank 1 replays in one process, and this is one of 4" in done.err, done.err


def test_every_rank_that_stops_names_the_first_rank_whose_step_raised():
    """A step that raises on one rank makes its peers' collectives fail after it: each rank that
    stops posts its crash to the job's store, and all of them name the first one posted."""
    from torch.distributed import HashStore

    from ckptlab.replayer.distributed import _first_crash

    store = HashStore()
    first = {"rank": 3, "step": 12, "error": "ValueError: input out of range"}
    later = {"rank": 0, "step": 12, "error": "RuntimeError: Connection closed by peer"}
    assert _first_crash(store, first)["rank"] == 3
    assert _first_crash(store, later) == _first_crash(store, first) and _first_crash(store, later)["rank"] == 3


if __name__ == "__main__":  # torchrun --nproc_per_node=4 tests/test_replay_nodes.py RUN: record
    dm.NAN_RANK = NAN_RANK
    dm.main(sys.argv[1], "ddp-wide")
