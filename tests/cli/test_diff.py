"""`ckptlab diff` from the command line: exit codes, output, --json, bad input as one line."""

import json
import struct

import pytest
import torch

from ckptlab.cli import main
from tests import models
from tests.io.checkpoints import planted_faults, toy_state, untied, write


def run(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main(["diff", *map(str, args)])
    out, err = capsys.readouterr()
    return e.value.code, out, err


@pytest.fixture
def pair(tmp_path):
    a = toy_state()
    return write(tmp_path / "a", a, "pt"), write(tmp_path / "b", planted_faults(a), "safetensors")


def test_terminal_report_names_the_offending_parameter(capsys, pair, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    code, out, err = run(capsys, *pair)
    assert code == 0
    lines = out.splitlines()
    k = next(i for i, line in enumerate(lines) if line.startswith("offending parameter"))
    words = " ".join(lines[:k]).split()  # A and B with their paths (a long temp path wraps)
    assert words[:1] == ["A"] and words[1].endswith("a.pt") and words[2] == "(torch)", words
    assert words[3] == "B" and words[4].endswith("b.safetensors") and words[5:] == ["(safetensors)"], words
    assert (
        lines[k]
        == "offending parameter: blocks.2.attn.weight (module blocks.2.attn): 1 NaN of 256 elements (A had none)"
    )
    assert lines[k + 1].split() == ["tensor", "shape", "flags", "|B-A|/|A|", "max|w|", "A→B", "NaN/Inf"]
    table = "\n".join(lines)
    assert "  weight (= lm_head.weight)" in table  # tied names shown on the stored one
    row = next(line for line in lines if line.strip().startswith("mlp.fc.weight") and "exploded" in line)
    assert "exploded,drifted" in row and "→3.3" in row
    assert any(line.strip().startswith("ln.weight") and "frozen" in line for line in lines)
    assert "values of blocks.2.attn.weight in A (█) and B (█)" in out
    assert "B: 1 NaN, 0 +Inf, 0 -Inf (not binned)" in out
    assert "model weights taken from checkpoint['model']" in err  # notes go to stderr


@pytest.fixture(scope="module")
def lm_head_jump(tmp_path_factory):
    """A, a healthy B, and a B whose lone lm_head.weight moved 15x its norm (an LR fault on a
    litgpt-style GPT): safetensors files. Two blocks, so no parameter has the 3 peers `drifted`
    needs; lm_head starts at std 0.02, so its max |B| stays under 10x the model's median max |A|
    and `exploded` does not hold. In both B's two vectors move far more than their norm, as a
    bias that starts at zero does in healthy training: the zero bias and a zero-initialised
    matrix (LoRA's B; infinite ratios), and a shift 50x its norm."""
    g = torch.Generator().manual_seed(3)
    a = untied(toy_state(blocks=2))
    a["lm_head.weight"] = 0.02 * torch.randn(32, 16, generator=g)
    a["lm_head.bias"] = torch.zeros(32)
    a["adapter.weight"] = torch.zeros(16, 4)
    healthy = {k: v + 1e-3 * v.abs().mean() * torch.randn(v.shape, generator=g) for k, v in a.items()}
    healthy["lm_head.bias"] = 0.01 * torch.randn(32, generator=g)
    healthy["adapter.weight"] = 0.01 * torch.randn(16, 4, generator=g)
    shift = a["blocks.0.ln.bias"]
    healthy["blocks.0.ln.bias"] = shift + 50 * shift.norm() * _unit(shift.shape, g)
    faulty = dict(healthy)
    head = a["lm_head.weight"]
    faulty["lm_head.weight"] = head + 15 * head.norm() * _unit(head.shape, g)
    folder = tmp_path_factory.mktemp("jump")
    return [write(folder / name, sd, "safetensors") for name, sd in (("a", a), ("ok", healthy), ("b", faulty))]


def _unit(shape, g):
    x = torch.randn(shape, generator=g)
    return x / x.norm()


def test_a_lone_matrix_that_moved_15x_its_norm_is_the_verdict(capsys, lm_head_jump, monkeypatch):
    a, healthy, faulty = lm_head_jump
    code, out, _ = run(capsys, a, faulty, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["verdict"]["parameter"] == "lm_head.weight", doc["verdict"]
    assert doc["verdict"]["module"] == "lm_head" and doc["verdict"]["kind"] == "flagged"
    assert doc["verdict"]["reason"].startswith("moved 15x its own norm (||B-A|| = "), doc["verdict"]
    assert [(r["name"], r["flags"]) for r in doc["ranked"] if r["flags"]] == [("lm_head.weight", ["jumped"])]
    assert doc["summary"]["flagged"] == 1
    monkeypatch.setenv("COLUMNS", "100")
    code, out, _ = run(capsys, a, faulty)
    assert "offending parameter: lm_head.weight (module lm_head): moved 15x its own norm" in out
    assert any(line.strip().startswith("weight") and "jumped" in line for line in out.splitlines())
    code, out, _ = run(capsys, a, healthy, "--json")
    assert code == 0 and json.loads(out)["verdict"] is None
    code, out, _ = run(capsys, a, healthy)
    assert "nothing wrong found: 16 tensors compared; largest update ratio 50 (blocks.0.ln.bias)" in out


def test_wide_terminal_adds_columns(capsys, pair, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")
    code, out, _ = run(capsys, *pair)
    header = next(line for line in out.splitlines() if line.startswith("tensor"))
    assert header.split() == [
        "tensor",
        "shape",
        "flags",
        "|B-A|/|A|",
        "max|w|",
        "A→B",
        "cos",
        "same",
        "largest",
        "change",
        "NaN/Inf",
    ]


def test_json_is_alone_on_stdout(capsys, pair):
    code, out, err = run(capsys, *pair, "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["verdict"] == {
        "parameter": "blocks.2.attn.weight",
        "module": "blocks.2.attn",
        "reason": "1 NaN of 256 elements (A had none)",
        "kind": "flagged",
    }
    assert [r["name"] for r in doc["ranked"][:4]] == [
        "blocks.2.attn.weight",
        "blocks.1.mlp.fc.weight",
        "blocks.0.mlp.proj.weight",
        "blocks.3.ln.weight",
    ]
    assert doc["a"].endswith("a.pt") and doc["missing"] == [] and doc["unexpected"] == [] and doc["mismatched"] == []
    assert "taken from checkpoint['model']" in err


def test_hist_of_any_tensor_and_a_clear_usage_error(capsys, pair):
    code, out, _ = run(capsys, *pair, "--hist", "blocks.1.mlp.fc.weight")
    assert code == 0 and "values of blocks.1.mlp.fc.weight" in out and "empty bins" in out
    code, out, err = run(capsys, *pair, "--hist", "blocks.1.mlp.fc.weigth")
    assert code == 2 and "did you mean blocks.1.mlp.fc.weight" in err


def test_select_and_bad_regex(capsys, pair):
    code, out, _ = run(capsys, *pair, "--select", r"\.ln\.", "--json")
    assert code == 0 and {r["name"].split(".")[2] for r in json.loads(out)["ranked"]} == {"ln"}
    code, _, err = run(capsys, *pair, "--select", "(")
    assert code == 2 and "not a regular expression" in err


def test_sequential_reads_give_the_same_answer(capsys, pair, monkeypatch):
    _, plain, _ = run(capsys, *pair, "--json")
    monkeypatch.setenv("CKPTLAB_SEQUENTIAL", "1")
    _, seq, _ = run(capsys, *pair, "--json", "--workers", "1")
    a, b = json.loads(plain), json.loads(seq)
    assert a["ranked"] == b["ranked"] and b["summary"]["read"] == "sequential" and b["summary"]["workers"] == 1


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-50]), "truncated: tensor"),
        (lambda p: p.write_bytes(struct.pack("<Q", 4) + b"{no}"), "not JSON"),
    ],
    ids=["truncated", "corrupt header"],
)
def test_bad_safetensors_is_one_line_exit_1(capsys, pair, make, words):
    make(pair[1])
    code, out, err = run(capsys, *pair)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"ckptlab: error: {pair[1]}: ") and words in err
    assert "Traceback" not in err


def test_pickle_with_code_is_refused(capsys, tmp_path, pair):
    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "evil.pt"
    torch.save({"model": {"wte.weight": torch.zeros(2)}, "x": Payload()}, evil)
    code, _, err = run(capsys, evil, pair[1])
    assert code == 1 and err.count("\n") == 1 and "refused" in err and not marker.exists()


def test_unknown_format_and_unrelated_checkpoints(capsys, tmp_path, pair):
    junk = tmp_path / "junk.ckpt"
    junk.write_text("not a checkpoint")
    code, _, err = run(capsys, junk, pair[1])
    assert code == 1 and err.startswith(f"ckptlab: error: {junk}: not a checkpoint format") and err.count("\n") == 1
    other = write(tmp_path / "other", {"encoder.w": torch.ones(3)}, "safetensors")
    code, _, err = run(capsys, pair[0], other)
    assert code == 1 and "share no tensor names" in err and "unrelated checkpoints?" in err
    code, _, err = run(capsys)
    assert code == 2 and "Missing argument" in err


def test_one_run_alone_and_run_at_step(capsys, tmp_path):
    run_dir = tmp_path / "run"
    models.record_run(run_dir, models.build_mlp, models.step_mlp, models.mlp_batches(21), ckpt_every=10)
    code, out, _ = run(capsys, run_dir)
    assert code == 0 and out.startswith(f"A  {run_dir}@20  (ckptlab-run)") and "healthy: 4 tensors" in out
    code, out, _ = run(capsys, f"{run_dir}@0", f"{run_dir}@latest", "--json", "--no-verify")
    doc = json.loads(out)
    assert code == 0 and (doc["a"], doc["b"]) == (f"{run_dir}@0", f"{run_dir}@20") and len(doc["ranked"]) == 4
    code, out, _ = run(capsys, "@10", "@latest", "--run", run_dir, "--json")  # @STEP: a step of --run's run
    assert code == 0 and (json.loads(out)["a"], json.loads(out)["b"]) == (f"{run_dir}@10", f"{run_dir}@20")


def test_plot_writes_a_png(capsys, pair, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "diff.png"
    code, _, err = run(capsys, *pair, "--plot", out)
    assert code == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {out}" in err


def test_plot_without_matplotlib_says_how_to_get_it(capsys, pair, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    code, _, err = run(capsys, *pair, "--plot", tmp_path / "x.png")
    assert (
        code == 1
        and "--plot needs matplotlib (pip install matplotlib; from ckptlab's clone: pip install -e '.[plot]')" in err
    )
