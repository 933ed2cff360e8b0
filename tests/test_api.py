"""The public API: lazy, fast to import, and names that stay what they say."""

import subprocess
import sys


def test_public_functions_stay_functions_whatever_was_imported_first():
    import ckptlab
    import ckptlab.replayer  # noqa: F401
    import ckptlab.training.sample_ids  # noqa: F401 - the module behind ckptlab.skip_samples

    assert callable(ckptlab.replay) and ckptlab.replay.__module__ == "ckptlab.replayer"
    assert callable(ckptlab.open_run) and callable(ckptlab.diff) and callable(ckptlab.skip_samples)
    assert isinstance(ckptlab.Recorder, type)


def test_import_and_help_do_not_import_torch():
    code = "import sys, ckptlab, ckptlab.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    out = subprocess.run([sys.executable, "-m", "ckptlab", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for command in ("info", "replay", "diff", "dirty", "rollback", "report"):
        assert command in out.stdout
