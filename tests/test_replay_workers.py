"""The processes a distributed replay starts for its ranks (ckptlab/replayer/workers.py): forked
from one server that has imported torch, yet each as a spawned process would be, with this
process's environment and standard streams as they are when the replay starts, not as they were
when the server started."""

from __future__ import annotations

import os
import sys

import pytest

from ckptlab.replayer import workers


def say(rank: int, name: str) -> None:
    """A rank's work here: say what it sees, on fd 1 and fd 2 (as C code and child processes
    write) and through sys.stdout."""
    line = f"rank {rank} sees {name}={os.environ.get(name)} torch={'torch' in sys.modules}\n"
    os.write(1, line.encode())
    os.write(2, ("err " + line).encode())
    print("print", line, end="", flush=True)


def fail(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 failed here")


@pytest.mark.skipif(workers.start_method() != "forkserver", reason="the ranks are spawned on this platform")
def test_ranks_see_the_environment_and_streams_of_the_replay_not_of_the_server(monkeypatch, capfd):
    monkeypatch.setenv("CKPTLAB_TEST_WORKERS", "first")
    workers.run_ranks(say, ("CKPTLAB_TEST_WORKERS",), 1)  # the server is running from here on
    first = capfd.readouterr()
    assert "rank 0 sees CKPTLAB_TEST_WORKERS=first" in first.out, first
    monkeypatch.setenv("CKPTLAB_TEST_WORKERS", "second")
    monkeypatch.delenv("CKPTLAB_TEST_GONE", raising=False)
    saved = os.dup(1)
    try:
        os.dup2(2, 1)  # what `--json` does while it runs: fd 1 to stderr
        workers.run_ranks(say, ("CKPTLAB_TEST_WORKERS",), 2)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    out, err = capfd.readouterr()
    assert out == "", out  # nothing where the document goes
    for rank in (0, 1):
        assert f"rank {rank} sees CKPTLAB_TEST_WORKERS=second torch=True" in err, err  # torch: preloaded
        assert f"err rank {rank} sees CKPTLAB_TEST_WORKERS=second" in err
        assert f"print rank {rank} sees CKPTLAB_TEST_WORKERS=second" in err


def test_a_rank_that_raises_stops_the_replay_with_its_error():
    import torch.multiprocessing as mp

    with pytest.raises(mp.ProcessRaisedException, match="rank 1 failed here"):
        workers.run_ranks(fail, (), 2)
