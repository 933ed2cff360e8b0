"""What a newcomer sees in a first hour with `ckptlab replay` (#31): the report wrapped at the
terminal's width between words, each field's continuation lines under its value; a progress bar
that names the phase running; a clear line when --device cuda cannot run here.

One real run with a planted fault (a fully masked attention row at step 12), replayed once for
the module through the CLI's own progress path, and once more by the CLI at 80 columns."""

from __future__ import annotations

import io
import re

import pytest
import torch
from rich.cells import cell_len
from rich.console import Console

from ckptlab.cli.replay import _replay
from ckptlab.render.console import Terminal
from ckptlab.render.replay import render
from ckptlab.run.reader import open_run
from tests import fault_models as fm

FIELD = 11  # the value column: "root step  12: ..."
LABELS = {
    "replayed",
    "root step",
    "twice",
    "origin",
    "op chain",
    "parameters",
    "evidence",
    "culprit",
    "rewind",
    "budget",
}
TABLE = re.compile(r"[│┃━─╇┡]")
STYLE = re.compile(r"\x1b\[[0-9;]*m")  # colours: within a frame
MOVES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")  # cursor moves: between frames


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    """The run, its replay report, and every frame the CLI's progress bar drew meanwhile."""
    run_dir = tmp_path_factory.mktemp("newcomer") / "run"
    exp = fm.record_masked_attention(run_dir)
    term = Terminal()
    frames = io.StringIO()
    term.err = Console(file=frames, force_terminal=True, width=120, highlight=False)
    report = _replay(open_run(run_dir), exp.symptom, term)
    assert report.reproduced and report.chain and report.culprit is not None
    return run_dir, exp, report, frames.getvalue()


def _rendered(report, monkeypatch, capsys, columns: str | None) -> str:
    """The terminal view of `report` as the CLI prints it, with COLUMNS set (or piped)."""
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    capsys.readouterr()
    render(report, Terminal())
    return capsys.readouterr().out


def _words(text: str) -> list[str]:
    """The words of the report outside its tables, in order."""
    return " ".join(line for line in text.splitlines() if not _in_table(line)).split()


def _in_table(line: str) -> bool:
    return bool(TABLE.search(line)) or line.strip() in ("blamed rows", "parameters")


def _assert_wrapped(text: str, piped: str, width: int) -> None:
    """Every line fits; the words are the piped report's, none cut in two; the verdict's lines
    end in a word; each field line starts with its label and its further lines start under its
    value (FIELD columns in)."""
    lines = text.splitlines()
    assert max(cell_len(line) for line in lines) <= width
    assert _words(text) == _words(piped)
    blank = lines.index("")
    assert blank > 1, "the verdict wraps into a paragraph"
    assert all(line == line.rstrip() for line in lines[:blank])
    fields = [line for line in lines[blank + 1 :] if not _in_table(line)]
    assert fields[0].startswith("replayed")
    continued = 0
    for line in fields:
        label, rest = line[:FIELD].rstrip(), line[FIELD:]
        assert label in LABELS or label == "", line
        assert rest and not rest.startswith(" "), line
        continued += label == ""
    assert continued >= 3, "long values go on under their value column"


@pytest.mark.parametrize("columns", [80, 120])
def test_the_report_wraps_between_words_with_a_hanging_indent(replayed, monkeypatch, capsys, columns):
    _, _, report, _ = replayed
    piped = _rendered(report, monkeypatch, capsys, None)
    shown = _rendered(report, monkeypatch, capsys, str(columns))
    _assert_wrapped(shown, piped, columns)


def test_piped_output_keeps_each_field_on_one_line(replayed, monkeypatch, capsys):
    _, _, report, _ = replayed
    piped = _rendered(report, monkeypatch, capsys, None)
    chain = [line for line in piped.splitlines() if line.startswith("op chain")]
    assert len(chain) == 1 and chain[0].startswith("op chain   blocks.0.attn:_softmax -> blocks.0.attn.proj:addmm")
    assert not any(line.startswith(" " * FIELD) and line.strip() for line in piped.splitlines()[:3])


def test_the_op_chain_is_short_on_the_terminal(replayed, monkeypatch, capsys):
    """The first links of the chain (aten's `.default` overload left out), then how many more
    --json lists: three lines at 80 columns, not six."""
    _, _, report, _ = replayed
    assert len(report.chain) > 7
    shown = _rendered(report, monkeypatch, capsys, "80").splitlines()
    start = next(i for i, line in enumerate(shown) if line.startswith("op chain"))
    chain = [shown[start]] + [line for line in shown[start + 1 : start + 4] if line.startswith(" " * FIELD)]
    text = " ".join(" ".join(chain).split())
    assert len(chain) <= 3
    assert text.startswith("op chain blocks.0.attn:_softmax -> blocks.0.attn.proj:addmm -> ")
    assert text.endswith(f"-> ... {len(report.chain) - 6} more (--json lists them)") and ".default" not in text


def test_the_cli_report_at_80_columns(replayed, cli, monkeypatch, capsys):
    run_dir, exp, report, _ = replayed
    piped = _rendered(report, monkeypatch, capsys, None)
    monkeypatch.setenv("COLUMNS", "80")
    r = cli("replay", "--run", run_dir, "--step", exp.symptom)
    assert r.code == 0, r.err
    _assert_wrapped(r.out, piped, 80)


def test_the_progress_bar_names_the_phase_running(replayed):
    """After the replayed steps are counted, each later phase shows under its own name, its bar
    pulsing, without the steps' count beside it (which sat at "2/3" through them all)."""
    *_, frames = replayed
    lines = [line for line in MOVES.sub("\n", STYLE.sub("", frames)).splitlines() if line.strip()]
    for phase in ("tracing step 12 per op", "replaying each of the 6 rows", "searching for the minimal culprit"):
        shown = [line for line in lines if phase in line]
        assert shown, f"no frame shows {phase!r}"
        assert not any(re.search(r"\b\d+/\d+\b", line) for line in shown), shown


def test_device_cuda_where_cuda_is_not_available(replayed, cli, monkeypatch):
    """A CPU run replayed with --device cuda where CUDA is not available: one line that says
    so, and that the run replays on the CPU (not that a CPU replay of a GPU run is inexact)."""
    run_dir, exp, _, _ = replayed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = cli("replay", "--run", run_dir, "--step", exp.symptom, "--device", "cuda")
    assert r.code == 1 and r.out == ""
    assert r.err.strip().count("\n") == 0 and "Traceback" not in r.err
    assert "replay on cuda asked for, but CUDA is not available here" in r.err
    assert "the run was recorded on the CPU: replay it there, without --device or with --device cpu" in r.err
    assert "GPU run" not in r.err


def test_device_cuda_where_cuda_is_not_available_for_a_gpu_run(replayed):
    """The same for a run recorded on a GPU: what a CPU replay of it costs."""
    from ckptlab.replayer.driver import no_cuda

    run_dir, *_ = replayed
    e = no_cuda(open_run(run_dir), torch.device("cuda"), torch.device("cuda:0"))
    assert "CUDA is not available here" in str(e) and "recorded on cuda:0" in str(e)
    assert "--device cpu, which is not bit-exact for a GPU run" in str(e) and "((" not in str(e)


def test_info_wraps_its_fields_the_same_way(replayed, cli, monkeypatch):
    run_dir, *_ = replayed
    monkeypatch.setenv("COLUMNS", "60")
    r = cli("info", "--run", run_dir)
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert max(cell_len(line) for line in lines) <= 60
    build = next(
        i for i, line in enumerate(lines) if line.startswith("build_fn   tests.fault_models.build_transformer")
    )
    assert lines[build + 1].startswith(" " * FIELD + "(")  # the file, under the function's name


def test_report_wraps_its_findings_under_their_text(replayed, cli, monkeypatch):
    run_dir, *_ = replayed
    monkeypatch.setenv("COLUMNS", "70")
    r = cli("report", "--run", run_dir)
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert max(cell_len(line) for line in lines) <= 70
    evidence = next(i for i, line in enumerate(lines) if line.startswith("        evidence: first_step=12"))
    assert re.match(r" {18}\S", lines[evidence + 1]), lines[evidence + 1]  # under the evidence, not the label
    # (the verdict's last: on a loaded machine a slow_steps warning may add a wrapped "(+1 more: ...)")
    (at,) = [i for i, line in enumerate(lines) if line.startswith("verdict:")]
    assert lines[at].startswith("verdict: loss became nan at step 12")
    assert all(line.startswith(" " * 9) for line in lines[at + 1 :])
