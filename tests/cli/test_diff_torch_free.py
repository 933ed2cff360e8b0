"""`ckptlab diff` of safetensors files never imports torch (it was most of the start-up), in a
fresh process: --help, a diff, --json, and a damaged file's one-line error."""

import json
import struct
import subprocess
import sys
from pathlib import Path

from tests.io.checkpoints import planted_faults, toy_state, write

ROOT = Path(__file__).resolve().parents[2]

# Each call's exit code, stdout and stderr, then whether torch was imported.
SCRIPT = r"""
import contextlib, io, json, sys
sys.path.insert(0, sys.argv[1])
from ckptlab.cli import main
results = []
for args in json.loads(sys.argv[2]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(args)
        except SystemExit as e:
            code = e.code
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps({"results": results, "torch": "torch" in sys.modules}))
"""


def test_safetensors_diff_runs_without_importing_torch(tmp_path):
    a = toy_state()
    path_a, path_b = write(tmp_path / "a", a, "safetensors"), write(tmp_path / "b", planted_faults(a), "safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(path_b.read_bytes()[:-50])  # truncated
    foreign = tmp_path / "foreign.safetensors"
    foreign.write_bytes(struct.pack("<Q", 4) + b"{no}")  # not JSON
    text = tmp_path / "text.safetensors"
    text.write_text("hello, not a checkpoint at all")
    header = b'{"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 4]}}'
    short = tmp_path / "short.safetensors"
    short.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))  # 4 bfloat16 need 8 bytes
    calls = [
        ["diff", "--help"],
        ["diff", str(path_a), str(path_b)],
        ["diff", str(path_a), str(path_b), "--json"],
        ["diff", str(path_b)],
        ["diff", str(path_a), str(bad)],
        ["diff", str(foreign), str(path_b)],
        ["diff", str(text), str(path_b)],
        ["diff", str(short), str(path_b)],
    ]
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT), json.dumps(calls)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.splitlines()[-1])
    helped, diffed, as_json, alone, *failed = doc["results"]
    assert helped[0] == 0 and "Compare checkpoint A with B" in helped[1]
    assert diffed[0] == 0 and "offending parameter: blocks.2.attn.weight" in diffed[1]
    assert as_json[0] == 0 and json.loads(as_json[1])["verdict"]["parameter"] == "blocks.2.attn.weight"
    assert alone[0] == 0 and "nonfinite" in alone[1]
    expected = [
        (bad, "truncated: tensor"),
        (foreign, "not JSON"),
        (text, "corrupt safetensors header: claims"),
        (short, "tensor 'w' (BF16[4]) should take 8 bytes, its offsets span 4"),
    ]
    for (code, out, err), (path, words) in zip(failed, expected, strict=True):
        assert code == 1 and out == "" and err.count("\n") == 1
        assert err.startswith(f"ckptlab: error: {path}: ") and words in err
    assert doc["torch"] is False, "a safetensors diff imported torch"


def test_a_run_checkpoint_diff_runs_without_importing_torch(tmp_path):
    """RUN@STEP of a committed single-file checkpoint is found and verified from its
    COMMIT.json alone; what needs the run reader (a step that is not there) still says so."""
    from tests.models import build_mlp, mlp_batches, record_run, step_mlp

    run = tmp_path / "run"
    record_run(run, build_mlp, step_mlp, mlp_batches(7), ckpt_every=3)  # checkpoints 0, 3, 6
    calls = [
        ["diff", f"{run}@0", f"{run}@latest"],
        ["diff", f"{run}@3", str(run), "--json"],
    ]
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT), json.dumps(calls)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.splitlines()[-1])
    (code, out, err), (jcode, jout, _) = doc["results"]
    assert code == 0 and f"{run}@0" in out and f"{run}@6" in out, err
    assert jcode == 0 and json.loads(jout)["b"] == f"{run}@6"
    assert doc["torch"] is False, "a diff of a run's checkpoints imported torch"
    missing = [["diff", f"{run}@4", f"{run}@6"]]
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT), json.dumps(missing)], capture_output=True, text=True, timeout=120
    )
    ((code, out, err),) = json.loads(proc.stdout.splitlines()[-1])["results"]
    assert code == 1 and out == "" and "no checkpoint at step 4 (checkpoints: [0, 3, 6])" in err
