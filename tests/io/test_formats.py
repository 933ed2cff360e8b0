"""Every format reads back exactly, lazily, from real files written here."""

import numpy as np
import pytest
import safetensors.torch
import torch

from ckptlab.io import LazyStateDict, open_checkpoint
from ckptlab.io.mapped import FileTensor
from tests import models
from tests.io.checkpoints import FORMATS, toy_state, write

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]


def _assert_same(sd: LazyStateDict, expected: dict[str, torch.Tensor]) -> None:
    for name, t in expected.items():
        got = sd[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got.view(torch.uint8), t.contiguous().view(torch.uint8)), name  # bit for bit (NaN too)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_reads_back_bit_for_bit(tmp_path, fmt):
    a = toy_state(blocks=2)
    sd = open_checkpoint(write(tmp_path / "a", a, fmt))
    expected = {k: v for k, v in a.items() if k != "lm_head.weight"}
    _assert_same(sd, expected)
    if fmt == "pt":  # torch.save keeps the tie: one tensor, two names
        assert sd.aliases == {"lm_head.weight": "wte.weight"}
        assert "lm_head.weight" in sd and torch.equal(sd["lm_head.weight"], a["wte.weight"])
    else:
        assert "lm_head.weight" not in sd
    assert sd.format == {"pt": "torch", "hf-safetensors": "hf-sharded", "hf-bin": "hf-sharded"}.get(fmt, fmt)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_low_precision_dtypes(tmp_path, fmt, dtype):
    a = {"w": torch.randn(5, 7).to(dtype), "b": torch.randn(3).to(dtype)}
    sd = open_checkpoint(write(tmp_path / "a", a, fmt))
    _assert_same(sd, a)


def test_info_reads_nothing_and_tensors_stream_in_segments(tmp_path):
    t = torch.arange(1000, dtype=torch.float32)
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"w": t}, path)
    for sequential in (False, True):
        sd = open_checkpoint(path, sequential=sequential)
        ref = sd.info("w")
        assert isinstance(ref, FileTensor) and ref.shape == (1000,) and ref.dtype == "float32"
        scratch = np.empty(4096, dtype=np.uint8)
        assert (ref.segment(990, 10, scratch) == t[990:].numpy()).all()
        ref.release(990, 10)
        assert (ref.segment(0, 3) == t[:3].numpy()).all()  # readable again after a release
        sd.close()


def test_pt_tensors_are_located_in_the_zip_and_strided_views_still_read(tmp_path):
    base = torch.arange(24.0).reshape(4, 6)
    sd_in = {"w": base, "t": base.t(), "part": torch.arange(10.0)[3:8]}
    path = tmp_path / "x.pt"
    torch.save(sd_in, path)
    for sequential in (False, True):
        sd = open_checkpoint(path, sequential=sequential)
        assert isinstance(sd.info("w"), FileTensor) and isinstance(sd.info("part"), FileTensor)
        for name, t in sd_in.items():
            assert torch.equal(sd[name], t), name
        assert (sd.info("part").segment(1, 3) == np.array([4.0, 5.0, 6.0])).all()


def test_nested_checkpoints_yield_the_model(tmp_path):
    w = torch.ones(2)
    cases = {
        "lightning.pt": (
            {"state_dict": {"fc.weight": w}, "optimizer_states": [{"state": {0: {"m": torch.zeros(9)}}}], "epoch": 3},
            "['state_dict']",
        ),
        "nested.pt": ({"model": {"fc": {"weight": w}}, "optimizer": {"state": {}}}, "['model']"),
        "ema.pt": ({"ema": {"fc.weight": w}, "opt": {"big": torch.zeros(100)}}, "['ema']"),
    }
    for name, (obj, where) in cases.items():
        torch.save(obj, tmp_path / name)
        sd = open_checkpoint(tmp_path / name)
        assert list(sd) == ["fc.weight"], name
        assert any(where in n for n in sd.notes), (name, sd.notes)
    sd = open_checkpoint({"model": {"fc.weight": w}, "step": 1})  # an in-memory checkpoint too
    assert list(sd) == ["fc.weight"]


def test_legacy_torch_format_is_read_into_memory(tmp_path):
    path = tmp_path / "old.pt"
    torch.save({"w": torch.arange(4.0)}, path, _use_new_zipfile_serialization=False)
    sd = open_checkpoint(path)
    assert torch.equal(sd["w"], torch.arange(4.0)) and "legacy" in sd.notes[0]


def test_content_decides_the_format_not_the_name(tmp_path):
    path = tmp_path / "weights.bin"  # a safetensors file with a .bin name
    safetensors.torch.save_file({"w": torch.ones(3)}, path)
    assert open_checkpoint(path).format == "safetensors"


def test_unsharded_save_pretrained_folder(tmp_path):
    safetensors.torch.save_file({"w": torch.ones(3)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    assert list(open_checkpoint(tmp_path)) == ["w"]


def test_dcp_metadata_paths_rebuild_the_nesting(tmp_path):
    sd = open_checkpoint(write(tmp_path / "dcp", toy_state(blocks=1), "dcp"))
    assert "wte.weight" in sd and not any(n.startswith(("optim", "model.")) for n in sd)
    assert any("['model']" in n for n in sd.notes)


def test_run_references(tmp_path):
    run = tmp_path / "run"
    models.record_run(run, models.build_lm, models.step_lm, models.lm_batches(11), ckpt_every=5)
    latest = open_checkpoint(f"{run}@latest")
    assert latest.label == f"{run}@10" and latest.format == "ckptlab-run"
    assert open_checkpoint(run).label == f"{run}@10"  # a run directory: its latest checkpoint
    at5 = open_checkpoint(f"{run}@5")
    assert at5.aliases == {"lm_head.weight": "wte.weight"}
    assert torch.equal(at5["lm_head.weight"], at5["wte.weight"])
