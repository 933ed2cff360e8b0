"""ckptlab.diff: planted faults come out on top with the right reason, in every format."""

import json
import math

import pytest
import torch

import ckptlab
from ckptlab.analysis.diff.names import align, canonical
from ckptlab.analysis.diff.ranking import role
from ckptlab.errors import CkptlabError
from ckptlab.io import from_tensors
from ckptlab.render.jsonout import dumps
from tests import models
from tests.io.checkpoints import FAULTS, FORMATS, planted_faults, toy_state, untied, write

ORDER = ["nonfinite", "exploded", "drifted", "frozen"]  # the ranking's tiers, most severe first


def _check_planted(findings) -> None:
    top = findings.ranked[: len(FAULTS)]
    assert [f.flags[0] for f in top] == ORDER, [(f.name, f.flags) for f in top]
    for f in top:
        flag, words = FAULTS[f.name]
        assert f.flags[0] == flag and words in f.reason, (f.name, f.reason)
    assert all(not f.flags or f.flags == ["dtype_changed"] for f in findings.ranked[len(FAULTS) :])
    assert findings.verdict.parameter == "blocks.2.attn.weight"
    assert findings.verdict.module == "blocks.2.attn"
    assert findings.verdict.reason.startswith("1 NaN of 256 elements")


@pytest.mark.parametrize("fmt_b", FORMATS)
@pytest.mark.parametrize("fmt_a", ["pt", "safetensors"])
def test_planted_faults_in_every_format(tmp_path, fmt_a, fmt_b):
    a = toy_state()
    findings = ckptlab.diff(write(tmp_path / "a", a, fmt_a), write(tmp_path / "b", planted_faults(a), fmt_b))
    _check_planted(findings)
    assert not findings.missing and not findings.unexpected and not findings.mismatched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_planted_faults_in_16_bit(tmp_path, dtype):
    a = toy_state(dtype=dtype)
    _check_planted(
        ckptlab.diff(write(tmp_path / "a", a, "safetensors"), write(tmp_path / "b", planted_faults(a), "pt"), workers=1)
    )


def test_dtype_change_is_flagged_and_still_compared(tmp_path):
    a = toy_state()
    b = {k: v.to(torch.bfloat16) for k, v in planted_faults(a, step=1e-2).items()}
    findings = ckptlab.diff(a, b)
    # (nothing is frozen any more: rounding to bfloat16 moved every weight)
    assert [(f.name, f.flags[0]) for f in findings.ranked[:3]] == [
        (n, flag) for n, (flag, _) in FAULTS.items() if flag != "frozen"
    ]
    assert all("dtype_changed" in f.flags and f.dtype_b == "bfloat16" for f in findings.ranked)


def test_stats_of_one_pair_match_a_float64_reference():
    a = torch.randn(40, 50)
    b = a + 0.01 * torch.randn(40, 50)
    b[:, :5] = a[:, :5]
    b[17, 33] = a[17, 33] + 3
    f = ckptlab.diff({"w": a}, {"w": b}).ranked[0]
    a64, b64 = a.double(), b.double()
    d = f.delta
    assert d.l2 == pytest.approx(float((b64 - a64).norm()), rel=1e-12)
    assert d.rel_change == pytest.approx(float((b64 - a64).norm() / a64.norm()), rel=1e-12)
    assert d.cosine == pytest.approx(
        float(torch.nn.functional.cosine_similarity(a64.flatten(), b64.flatten(), dim=0)), abs=1e-12
    )
    assert d.unchanged == pytest.approx(200 / 2000)
    assert (
        d.max_index == [17, 33]
        and d.max_change == pytest.approx(3, rel=1e-6)
        and d.max_b - d.max_a == pytest.approx(3, rel=1e-6)
    )
    assert f.b.mean == pytest.approx(float(b64.mean()), rel=1e-12) and f.b.std == pytest.approx(
        float(b64.std(unbiased=False)), rel=1e-12
    )
    assert f.b.quantiles["p50"] == pytest.approx(float(b64.median()), rel=1e-2)  # bfloat16 resolution for float32


def test_identical_checkpoints_have_no_verdict(tmp_path):
    path = write(tmp_path / "a", toy_state(), "safetensors")
    findings = ckptlab.diff(path, path)
    assert findings.verdict is None
    assert all(f.delta.unchanged == 1 and not f.flags for f in findings.ranked)


def test_health_of_one_checkpoint(tmp_path):
    sd = untied(toy_state())
    assert ckptlab.diff(sd).verdict is None  # healthy: no verdict
    sd["blocks.0.attn.weight"][0, 0] = float("inf")
    sd["blocks.1.mlp.fc.weight"] = sd["blocks.1.mlp.fc.weight"] * 1e4
    sd["blocks.2.attn.weight"] = torch.zeros(16, 16)
    sd["blocks.3.ln.bias"] = torch.zeros(16)  # a zero bias is normal, not dead
    findings = ckptlab.diff(write(tmp_path / "a", sd, "safetensors"))
    assert findings.b is None
    assert [(f.name, f.flags) for f in findings.ranked[:3]] == [
        ("blocks.0.attn.weight", ["nonfinite"]),
        ("blocks.1.mlp.fc.weight", ["extreme"]),
        ("blocks.2.attn.weight", ["dead"]),
    ]
    assert findings.verdict.reason == "1 +Inf of 256 elements"
    assert "dead" not in findings.finding("blocks.3.ln.bias").flags


def test_fp16_near_overflow_is_extreme():
    sd = untied(toy_state(dtype=torch.float16))
    sd["blocks.0.attn.weight"][0, 0] = 50000.0
    f = ckptlab.diff(sd).ranked[0]
    assert f.name == "blocks.0.attn.weight" and "extreme" in f.flags and "float16's largest value" in f.reason


def test_wrapper_and_shared_prefixes_are_aligned():
    a = untied(toy_state(blocks=1))
    ddp = {f"module.{k}": v for k, v in a.items()}
    compiled = {f"_orig_mod.{k}": v for k, v in a.items()}
    lightning = {f"model.{k}": v for k, v in a.items()}
    for other in (ddp, compiled, lightning):
        findings = ckptlab.diff(a, other)
        assert findings.summary["compared"] == len(a) and not findings.missing and not findings.unexpected
        assert findings.verdict is None and any("aligned names" in n for n in findings.notes)
    assert canonical("module._orig_mod.blocks.0._orig_mod.w") == "blocks.0.w"


def test_tied_weights_are_compared_once_and_not_reported_missing(tmp_path):
    a = toy_state()  # torch.save keeps lm_head.weight tied to wte.weight
    findings = ckptlab.diff(write(tmp_path / "a", a, "pt"), write(tmp_path / "b", planted_faults(a), "safetensors"))
    wte = findings.finding("wte.weight")
    assert wte.tied == ["lm_head.weight"] and findings.finding("lm_head.weight") is wte
    assert not findings.missing and sum(f.name == "wte.weight" for f in findings.ranked) == 1
    run_tied = ckptlab.diff(write(tmp_path / "a2", a, "pt"), write(tmp_path / "b2", planted_faults(a), "pt"))
    assert run_tied.finding("wte.weight").tied == ["lm_head.weight"]


def test_missing_unexpected_and_mismatched_are_reported_not_fatal():
    a = untied(toy_state(blocks=2))
    b = dict(a)
    del b["blocks.1.attn.bias"]
    b["extra.weight"] = torch.ones(3)
    b["wte.weight"] = torch.zeros(40, 16)
    findings = ckptlab.diff(a, b)
    assert findings.missing == ["blocks.1.attn.bias"] and findings.unexpected == ["extra.weight"]
    (m,) = findings.mismatched
    assert (m.name, m.shape_a, m.shape_b) == ("wte.weight", [32, 16], [40, 16])
    assert findings.finding("wte.weight") is None


def test_unrelated_checkpoints_are_one_clear_error():
    with pytest.raises(CkptlabError, match="share no tensor names .* unrelated checkpoints"):
        ckptlab.diff({"fc.weight": torch.ones(2)}, {"encoder.layer.0.w": torch.ones(2)})
    with pytest.raises(CkptlabError, match="no tensor of the same shape"):
        ckptlab.diff({"fc.weight": torch.ones(2)}, {"fc.weight": torch.ones(3)})


def test_select_limits_the_comparison():
    a = untied(toy_state())
    findings = ckptlab.diff(a, planted_faults(a), select=r"mlp\.fc")
    assert [f.name for f in findings.ranked][0] == "blocks.1.mlp.fc.weight"
    assert all("mlp.fc" in f.name for f in findings.ranked) and len(findings.ranked) == 4
    with pytest.raises(CkptlabError, match="matches no tensor"):
        ckptlab.diff(a, a, select="nothing-like-this")


def test_json_has_the_public_keys_and_is_strict_json():
    a = untied(toy_state())
    doc = json.loads(dumps(ckptlab.diff(a, planted_faults(a))))
    assert list(doc)[:7] == ["a", "b", "verdict", "ranked", "missing", "unexpected", "mismatched"]
    assert set(doc["verdict"]) == {"parameter", "module", "reason", "kind"}
    top = doc["ranked"][0]
    assert top["name"] == "blocks.2.attn.weight" and top["flags"] == ["nonfinite"]
    assert {"a", "b", "delta", "shape", "dtype_a", "dtype_b", "tied", "reason", "module"} <= set(top)
    assert top["b"]["nan"] == 1 and top["delta"]["cosine"] == "nan"  # non-finite floats as strings
    assert not any(k.startswith("_") for k in top)
    assert json.loads(dumps(ckptlab.diff(a, a)))["verdict"] is None


def test_roles_group_layers():
    assert role("blocks.3.mlp.0.weight") == "blocks.*.mlp.0.weight"
    assert role("model.layers.11.self_attn.q_proj.weight") == "model.layers.*.self_attn.q_proj.weight"
    assert role("0.weight") == "*.weight" and role("wte.weight") == "wte.weight"


def test_real_runs_step_to_step(tmp_path):
    run = tmp_path / "run"
    models.record_run(run, models.build_lm, models.step_lm, models.lm_batches(11), ckpt_every=5)
    findings = ckptlab.diff(f"{run}@5", f"{run}@latest")
    assert (findings.a, findings.b) == (f"{run}@5", f"{run}@10")
    assert findings.finding("wte.weight").tied == ["lm_head.weight"] and not findings.missing
    assert findings.verdict is None or findings.verdict.reason  # healthy training: nothing non-finite
    assert not any("nonfinite" in f.flags or "exploded" in f.flags for f in findings.ranked)
    health = ckptlab.diff(run)
    assert health.a == f"{run}@10" and health.b is None and health.verdict is None


def test_alignment_plan_directly():
    a = from_tensors({"module.x": torch.ones(2), "module.y": torch.ones(2)})
    b = from_tensors({"x": torch.ones(2), "z": torch.ones(2)})
    plan = align(a, b)
    assert [(p.name, p.name_a, p.name_b) for p in plan.pairs] == [("x", "module.x", "x")]
    assert plan.missing == ["y"] and plan.unexpected == ["z"]


def test_empty_and_integer_tensors_do_not_break_anything():
    a = {
        "w": torch.randn(4, 4),
        "empty": torch.zeros(0, 3),
        "count": torch.tensor(5),
        "mask": torch.tensor([True, False]),
    }
    b = {"w": a["w"] * 2, "empty": torch.zeros(0, 3), "count": torch.tensor(6), "mask": torch.tensor([True, True])}
    findings = ckptlab.diff(a, b)
    count = findings.finding("count")
    assert count.delta.l2 == 1 and count.delta.max_index is None and count.shape == []
    assert math.isnan(findings.finding("empty").delta.l2)


def test_complex_tensors_are_skipped_not_fatal():
    a = {"w": torch.randn(4, 4), "freqs_cis": torch.randn(8, dtype=torch.complex64)}
    findings = ckptlab.diff(a, {k: v.clone() for k, v in a.items()})
    assert [f.name for f in findings.ranked] == ["w"]
    assert findings.skipped == [
        {"name": "freqs_cis", "side": "a", "reason": "dtype complex64 is not supported"},
        {"name": "freqs_cis", "side": "b", "reason": "dtype complex64 is not supported"},
    ]


def test_integer_buffers_are_compared_never_called_frozen():
    """A pretrained encoder after a small healthy update of every float tensor: its int64
    position_ids buffer is equal in both, and that is not a finding (integers do not train)."""
    g = torch.Generator().manual_seed(0)
    a = {f"encoder.layer.{i}.{n}.weight": torch.randn(32, 32, generator=g) for i in range(4) for n in ("q", "k")}
    a["embeddings.word_embeddings.weight"] = torch.randn(100, 32, generator=g)
    a["embeddings.position_ids"] = torch.arange(512).unsqueeze(0)
    b = {k: v + 1e-3 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone() for k, v in a.items()}
    findings = ckptlab.diff(a, b)
    assert findings.verdict is None
    ids = next(f for f in findings.ranked if f.name == "embeddings.position_ids")
    assert ids.flags == [] and ids.delta.unchanged == 1.0
