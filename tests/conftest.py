import json
import os

import pytest
import torch

from ckptlab.cli import main

# Tests run on the CPU with a fixed thread count: replay must match bits recorded here.
torch.set_num_threads(1)
os.environ.setdefault("CKPTLAB_DEBUG", "0")
# DeepSpeed (the `test` extra installs it; transformers and accelerate import it when present)
# prints which accelerator it detected to stdout, into the output the multi-process tests read,
# unless told: the CPU.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Output is piped here, and piped output is not wrapped, unless COLUMNS says a width: which
# pytest-xdist's workers set (80). Tests that look at wrapping set it themselves.
os.environ.pop("COLUMNS", None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Captured output as UTF-8 that can travel: a test on a path that is not UTF-8 captures
    log lines holding surrogates, which pytest-xdist cannot send from its worker."""
    outcome = yield
    report = outcome.get_result()
    report.sections = [(k, v.encode("utf-8", "backslashreplace").decode("utf-8")) for k, v in report.sections]


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"


@pytest.fixture(scope="session")
def fsdp_run(tmp_path_factory):
    """A 2-process FSDP2 run (tests/dist_models.py), recorded once for the session and shared by
    test_distributed.py and test_rollback_sharded.py: read it, or copy it before writing."""
    from tests.test_distributed import torchrun

    run_dir = tmp_path_factory.mktemp("fsdp") / "run"
    done = torchrun(run_dir, "fsdp")
    assert done.returncode == 0, done.stderr[-2000:]
    before = _tree_bytes(run_dir)
    yield run_dir
    assert _tree_bytes(run_dir) == before, "a test changed the shared fsdp_run: copy it first"


def _tree_bytes(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# --- the `ckptlab` command, in-process ---------------------------------------------------------


class Result:
    def __init__(self, code, out, err):
        self.code, self.out, self.err = code, out, err

    def json(self):
        return json.loads(self.out)


@pytest.fixture
def cli(capsys):
    """Run `ckptlab ARGS...` in-process; returns exit code, stdout and stderr."""

    def invoke(*args):
        capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        return Result(code, out, err)

    return invoke
