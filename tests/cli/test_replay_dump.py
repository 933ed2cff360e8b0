"""`ckptlab replay --dump FILE.h5` and `ckptlab show FILE.h5` on a real run with a planted fault:
a tiny transformer whose attention softmax gets a fully masked row (row 5 of step 12)."""

import h5py
import numpy as np
import pytest

import ckptlab
from tests import fault_models as fm


@pytest.fixture(scope="module")
def masked(tmp_path_factory):
    run = tmp_path_factory.mktemp("dump") / "run"
    return run, fm.record_masked_attention(run)


def _index(f) -> dict[str, dict]:
    rows = {}
    for rec in f["index"][()]:
        row = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in zip(rec.dtype.names, rec)}
        rows[row["path"]] = row
    return rows


def test_dump_holds_the_origin_op_its_first_nonfinite_elements_the_batch_and_the_index(cli, masked, tmp_path):
    run, exp = masked
    path = tmp_path / "nan.h5"
    r = cli("replay", "--run", run, "--step", exp.symptom, "--dump", path, "--json")
    assert r.code == 0, r.err
    doc = r.json()
    d = doc["dump"]
    assert d["path"] == str(path) and d["omitted"] == [] and d["datasets"] > 10
    # The origin: softmax over row (5, i, :) of the scores, every key masked: all -inf in, NaN out.
    assert d["origin_first_nonfinite"][0] == {"dataset": "origin/output0", "index": [5, 0, 0]}
    assert d["origin_came_from"][0] == "output0[5, 0, 0] = nan <- input0[5, 0, :] all -inf (8 elements)"
    assert not [n for n in doc["notes"] if "dump" in n]
    with h5py.File(path, "r") as f:
        assert f.attrs["format"] == "ckptlab-dump" and f.attrs["root_step"] == exp.step
        assert f.attrs["origin_op"] == "aten._softmax.default" and f.attrs["origin_module"] == "blocks.0.attn"
        scores, probs = f["origin/input0"][()], f["origin/output0"][()]
        assert scores.shape == probs.shape == (6, 8, 8)
        assert np.isneginf(scores[5]).all() and np.isnan(probs[5]).all()  # the masked row
        assert np.isfinite(probs[:5]).all()  # the other rows are fine
        assert f["origin/output0"].attrs["first_nonfinite"][0].tolist() == [5, 0, 0]
        assert f["origin/output0"].compression == "gzip"
        # The batch, as recorded, and who is blamed.
        batch, ids = ckptlab.open_run(run).batch(exp.step)
        assert (f["batch/['ids']"][()] == batch["ids"].numpy()).all()
        assert f["batch/sample_ids"][()].tolist() == ids
        assert f["batch/blamed_rows"][()].tolist() == exp.rows
        # Every module's output and the gradient that reached it; parameter gradients.
        attn = f["modules/blocks.0.attn/forward/0/output0"][()]
        assert attn.shape == (6, 8, 16) and np.isnan(attn[5]).all() and np.isfinite(attn[:5]).all()
        assert "modules/blocks.0.attn/backward/0/grad_output0" in f
        assert f["modules/blocks.0.attn.qkv/param_grad/weight"].shape == (48, 16)
        index = _index(f)
    origin = index["origin/output0"]
    assert (origin["module"], origin["op"], origin["phase"]) == ("blocks.0.attn", "aten._softmax.default", "forward")
    assert origin["source"].startswith("fault_models.py:") and origin["written"]
    assert origin["nonfinite"] == 64 and origin["first_nonfinite"].startswith("[5, 0, 0]")
    qkv = index["modules/blocks.0.attn.qkv/forward/0/output0"]
    assert (qkv["module"], qkv["phase"], qkv["call"], qkv["nonfinite"]) == ("blocks.0.attn.qkv", "forward", 0, 0)
    grad = index["modules/blocks.0.attn/backward/0/grad_output0"]
    assert grad["phase"] == "backward" and grad["written"]

    shown = cli("show", path)
    assert shown.code == 0, shown.err
    assert "aten._softmax.default" in shown.out and "input0[5, 0, :] all -inf" in shown.out
    assert "origin/output0  float32[6, 8, 8]" in shown.out and "64 non-finite, first at [5, 0, 0]" in shown.out
    attrs = cli("show", path, "--json").json()["attrs"]
    assert attrs["root_step"] == exp.step and attrs["format"] == "ckptlab-dump"


def test_dump_select_and_byte_budget_say_what_was_left_out(cli, masked, tmp_path):
    run, exp = masked
    path = tmp_path / "small.h5"
    path.write_bytes(b"an older dump")  # replaced: --force
    # 4000 bytes: the origin's two 1536-byte tensors and the batch fit, no module output does.
    r = cli(
        "replay", "--run", run, "--step", exp.symptom, "--dump", path, "--force",
        "--dump-select", r"attn$", "--dump-max-bytes", "4000",
    )  # fmt: skip
    assert r.code == 0, r.err
    assert "left out" in r.out and "over --dump-max-bytes 4000" in r.out
    with h5py.File(path, "r") as f:
        index = _index(f)
        assert f.attrs["data_bytes"] <= 4000 and "origin/input0" in f and "batch/['ids']" in f
    modules = {row["module"] for row in index.values() if row["role"] == "forward_output"}
    assert modules == {"blocks.0.attn", "blocks.1.attn"}  # --dump-select
    left = [row for row in index.values() if not row["written"]]
    assert left and all(row["bytes"] > 0 and row["path"] not in f for row in left)
    assert index["modules/blocks.0.attn/forward/0/output0"]["bytes"] == 6 * 8 * 16 * 4
    shown = cli("show", path)
    assert shown.code == 0 and f"left out {len(left)} tensors" in shown.out


def test_an_existing_dump_is_not_overwritten(cli, masked, tmp_path):
    run, exp = masked
    path = tmp_path / "kept.h5"
    path.write_bytes(b"precious")
    r = cli("replay", "--run", run, "--step", exp.symptom, "--dump", path)
    assert r.code == 1 and "already exists" in r.err and "--force" in r.err
    assert path.read_bytes() == b"precious"
    assert not list(tmp_path.glob(".kept.h5.tmp-*"))


@pytest.mark.parametrize(
    "args, says",
    [
        (["--dump", "x.h5", "--no-trace"], "--no-trace"),
        (["--dump", "x.h5", "--dump-select", "("], "regular expression"),
        (["--dump", "x.h5", "--dump-max-bytes", "lots"], "size in bytes"),
        (["--dump-select", "attn"], "go with --dump"),
    ],
)
def test_dump_usage_errors(cli, tmp_path, args, says):
    r = cli("replay", "--run", tmp_path, "--step", 1, *args)
    assert r.code == 2 and says in r.err


def test_show_does_not_import_torch():
    """`ckptlab show` reads an HDF5 file: h5py and numpy, not the seconds torch takes to load."""
    import subprocess
    import sys

    code = "import sys, ckptlab.cli.show, ckptlab.render.show, ckptlab.run.dumpfile; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_the_origin_keeps_its_room_when_modules_before_it_fill_the_budget(masked, tmp_path):
    """The embedding's output (3072 bytes) runs before the origin softmax and would fit alone;
    the origin's 3072 bytes are kept free for it, so the file holds the origin, not wte."""
    from ckptlab.replayer.dump import DumpRequest

    run, exp = masked
    path = tmp_path / "tight.h5"
    report = ckptlab.replay(run, exp.symptom, dump=DumpRequest(path, max_bytes=5000), counterfactuals=False)
    left = {o["path"]: o["bytes"] for o in report.dump.omitted}
    assert left["modules/wte/forward/0/output0"] == 3072
    assert "origin/input0" not in left and "origin/output0" not in left
    assert report.dump.data_bytes <= 5000
    with h5py.File(path, "r") as f:
        assert np.isneginf(f["origin/input0"][5]).all()


def test_the_cli_budget_default_is_the_librarys():
    from ckptlab.cli.replay import command
    from ckptlab.replayer.search import DEFAULT_BUDGET

    (budget,) = [p for p in command.params if p.name == "budget"]
    assert budget.default == DEFAULT_BUDGET
