import json

import pytest

from ckptlab.cli import main


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
