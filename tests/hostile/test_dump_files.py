"""Hostile dump files for `ckptlab show`: anything but a dump we wrote, whole, is one line and
exit 1 (never a traceback), and the file is left as it was."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from ckptlab.run.dumpfile import DumpEntry, write_dump
from tests.hostile.conftest import refused, run_cli


def _dump(path):
    """A real dump (written by ckptlab's writer), small: no replay needed."""
    x = np.full((64, 32), -np.inf, dtype=np.float32)
    entries = [
        DumpEntry("origin/input0", "origin_input", x, x.nbytes, x.shape, "float32", op="aten._softmax.default"),
        DumpEntry("origin/output0", "origin_output", np.zeros_like(x), x.nbytes, x.shape, "float32", nonfinite=2048),
    ]
    write_dump(path, entries, attrs={"root_step": 12, "origin_op": "aten._softmax.default"}, max_bytes=10**6)
    return path


def test_a_real_dump_is_shown(tmp_path):
    r = run_cli("show", _dump(tmp_path / "ok.h5"))
    assert r.code == 0, r.err
    assert "origin/input0  float32[64, 32]" in r.out


def test_random_bytes(tmp_path):
    path = tmp_path / "noise.h5"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    refused(path, "show", path, names="noise.h5", says="not a readable HDF5 file")


def test_truncated_dump(tmp_path):
    path = _dump(tmp_path / "cut.h5")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    refused(path, "show", path, names="cut.h5")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.h5"
    path.write_bytes(b"")
    refused(path, "show", path, names="empty.h5", says="not a readable HDF5 file")


def test_foreign_hdf5_file(tmp_path):
    path = tmp_path / "foreign.h5"
    with h5py.File(path, "w") as f:
        f["weights"] = np.zeros(3)
    refused(path, "show", path, names="foreign.h5", says="not a ckptlab dump")


def _index_behind_a_soft_link(f):
    f.move("index", "real_index")
    f["index"] = h5py.SoftLink("/real_index")


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda f: f.__delitem__("index"), "no /index table"),
        (lambda f: (f.__delitem__("index"), f.create_dataset("index", data=np.zeros(3))), "not the dump's table"),
        (lambda f: f.__delitem__("origin/input0"), "no such dataset"),
        (lambda f: f.attrs.__setitem__("version", 99), "newer than this ckptlab reads"),
        (lambda f: f.attrs.__setitem__("root_step", "twelve"), "'root_step' is not int"),
        (lambda f: f.attrs.__setitem__("version", np.zeros(1000)), "'version' is not int"),
        (lambda f: (f.__delitem__("origin/output0"), f.create_dataset("origin/output0", data=np.zeros(3))), "shape"),
        (lambda f: f.create_dataset("origin/came_from", data=np.zeros((2, 2))), "came_from"),
        # Links are not followed: an external one could point anywhere on this machine.
        (
            lambda f: (f.__delitem__("origin/input0"), f.__setitem__("origin/input0", h5py.ExternalLink("o.h5", "/x"))),
            "only a link",
        ),
        (_index_behind_a_soft_link, "no /index"),
    ],
)
def test_damaged_dump(tmp_path, damage, says):
    path = _dump(tmp_path / "bad.h5")
    with h5py.File(path, "a") as f:
        damage(f)
    refused(path, "show", path, names="bad.h5", says=says)


def test_unknown_role_in_index(tmp_path):
    path = _dump(tmp_path / "role.h5")
    with h5py.File(path, "a") as f:
        rows = f["index"][()]
        rows["role"][0] = b"\x1b]0;pwned\x07"
        f["index"][...] = rows
    refused(path, "show", path, names="role.h5", says="unknown role")


def test_missing_file_and_folder(tmp_path):
    refused(tmp_path, "show", tmp_path / "nope.h5", names="nope.h5", says="no such file")
    refused(tmp_path, "show", tmp_path, names=str(tmp_path), says="not a file")
