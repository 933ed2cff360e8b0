"""ckptlab.stats: exact against float64 references, whatever the dtype or how it is cut up."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptlab.stats import kernels
from ckptlab.stats.histogram import HIST_EDGES, QUANTILES, hist_bins, symlog
from ckptlab.stats.kernels import BLOCK
from ckptlab.stats.pair import PairAccumulator, pair_stats
from ckptlab.stats.patterns import codec_for, pattern_codes
from ckptlab.stats.tensor import StatsAccumulator, tensor_stats

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


def _reference(t: torch.Tensor) -> dict:
    x = t.double().reshape(-1)
    f = x[torch.isfinite(x)]
    return dict(
        numel=x.numel(),
        nan=int(x.isnan().sum()),
        posinf=int(x.isposinf().sum()),
        neginf=int(x.isneginf().sum()),
        zeros=int((x == 0).sum()),
        mean=float(f.mean()),
        std=float(f.std(unbiased=False)),
        min=float(f.min()),
        max=float(f.max()),
        absmax=float(f.abs().max()),
        l2=float(f.norm()),
    )


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_tensor_stats_match_float64(dtype):
    t = (torch.randn(200_003) * 3).to(dtype)
    t[10:20] = 0
    if dtype not in (torch.float8_e4m3fn,):  # e4m3fn has no infinities
        t[5], t[7], t[100_000] = float("nan"), float("inf"), float("-inf")
    s = tensor_stats(t)
    for key, value in _reference(t).items():
        assert getattr(s, key) == pytest.approx(value, rel=1e-10, abs=1e-12), key
    assert s.hist.sum() == s.numel - s.nonfinite


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_histograms_and_quantiles_are_exact(dtype):
    t = (torch.randn(50_001) * 10).to(dtype)
    s = tensor_stats(t)
    assert (s.hist == np.bincount(hist_bins(t.double().numpy()), minlength=len(HIST_EDGES) - 1)).all()
    for q, got in zip(QUANTILES, s.quantiles):
        assert got == float(torch.quantile(t.double(), q, interpolation="lower"))


def test_histogram_bins_follow_symlog():
    values = np.array([0.0, 1e-12, -1e-12, 1e-10, 1.0, -1.0, 0.5, -0.5, 3e-4, 1e12, -1e12, 10.0, 1.7783e0])
    expected = np.histogram(np.clip(symlog(values), -20, 20), HIST_EDGES)[0]
    assert (np.bincount(hist_bins(values), minlength=len(HIST_EDGES) - 1) == expected).all()
    assert hist_bins(np.array([1.0]))[0] == 120 and hist_bins(np.array([-1.0]))[0] == 40  # decades land on edges


def test_float32_is_binned_by_its_bfloat16_prefix():
    t = torch.randn(100_000)
    s = tensor_stats(t)
    prefix = (t.view(torch.int32) & ~0xFFFF).view(torch.float32)  # truncated to bfloat16
    assert (s.hist == np.bincount(hist_bins(prefix.double().numpy()), minlength=len(HIST_EDGES) - 1)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pattern_counts_are_the_same_with_and_without_torch(dtype, monkeypatch):
    """Blocks of kernels.SMALL codes and more are counted by torch where it is imported and by
    numpy where it is not (a safetensors diff): the same counts either way."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3 * BLOCK // 2 + 7, generator=g) * 0.02).to(dtype)
    x[5] = math.nan
    codec = codec_for(dtype)
    codes = pattern_codes(
        x.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
        .numpy()
        .view(np.uint16 if dtype == torch.bfloat16 else np.float32),
        codec,
    )
    expected = np.bincount(codes.astype(np.int64), minlength=codec.size)
    with_torch = StatsAccumulator(dtype)
    with_torch.add(x)
    monkeypatch.setattr(kernels, "_loaded_torch", lambda: None)
    without = StatsAccumulator(dtype)
    without.add(x)
    assert (with_torch.counts == expected).all() and (without.counts == expected).all()
    assert with_torch.result().quantiles == without.result().quantiles


def test_integers_and_empty_tensors():
    s = tensor_stats(torch.tensor([3, -1, 0, 0], dtype=torch.int64))
    assert (s.mean, s.min, s.max, s.zeros, s.l2) == (0.5, -1.0, 3.0, 2, math.sqrt(10))
    e = tensor_stats(torch.zeros(0))
    assert e.numel == 0 and math.isnan(e.mean) and e.hist.sum() == 0


def test_pair_stats_match_float64():
    a = torch.randn(300_000)
    b = a + 1e-3 * torch.randn(300_000)
    b[:1000] = a[:1000]
    b[123_456] += 2
    p = pair_stats(a, b)
    a64, b64 = a.double(), b.double()
    assert p.delta.l2 == pytest.approx(float((b64 - a64).norm()), rel=1e-12)
    assert p.delta.unchanged == int((a == b).sum()) and p.delta.unchanged >= 1000
    assert p.delta.max_index == 123_456 and p.delta.max_b - p.delta.max_a == pytest.approx(
        float(b64[123_456] - a64[123_456])
    )
    assert 1 - p.cosine == pytest.approx(1 - float(a64 @ b64 / a64.norm() / b64.norm()), rel=1e-6)
    assert p.rel_change == pytest.approx(float((b64 - a64).norm() / a64.norm()), rel=1e-12)


def test_pair_with_nonfinite_values_compares_the_finite_pairs():
    a = torch.randn(1000)
    b = a + 1.0
    b[10], a[20] = float("nan"), float("inf")
    p = pair_stats(a, b)
    assert p.b.nan == 1 and p.a.posinf == 1 and p.delta.compared == 998
    assert p.delta.l2 == pytest.approx(math.sqrt(998), rel=1e-6) and math.isnan(p.cosine)


def test_bfloat16_pairs_are_exact():
    a = torch.randn(70_000).bfloat16()
    b = (a.float() + 0.01).bfloat16()
    p = pair_stats(a, b)
    d = b.double() - a.double()
    assert p.delta.l2 == pytest.approx(float(d.norm()), rel=1e-13)
    assert p.delta.unchanged == int((d == 0).sum())


def test_wasserstein1():
    a = torch.zeros(1000, dtype=torch.bfloat16)
    b = torch.ones(1000, dtype=torch.bfloat16)
    assert pair_stats(a, b).w1 == 1.0  # moving all mass by 1
    x = torch.randn(10_000).bfloat16()
    assert pair_stats(x, x).w1 == 0.0
    assert pair_stats(x, (x.float() + 0.5).bfloat16()).w1 == pytest.approx(0.5, rel=0.02)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 5000),
    cuts=st.lists(st.integers(0, 5000), max_size=4),
    bad=st.lists(st.tuples(st.integers(0, 4999), st.sampled_from([math.nan, math.inf, -math.inf, 0.0])), max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_any_cut_into_pieces_merges_to_the_whole(n, cuts, bad, dtype):
    g = torch.Generator().manual_seed(n)
    a = torch.randn(n, generator=g).to(dtype)
    b = (a.float() + torch.randn(n, generator=g) * 0.1).to(dtype)
    for i, v in bad:
        b[i % n] = v
    whole = pair_stats(a, b)
    edges = sorted({0, n, *(c % (n + 1) for c in cuts)})
    parts = []
    for lo, hi in zip(edges, edges[1:]):
        acc = PairAccumulator(dtype, dtype)
        acc.add(a[lo:hi], b[lo:hi], lo)
        parts.append(acc)
    merged = parts[0]
    for p in parts[1:]:
        merged.merge(p)
    r = merged.result()
    assert (r.delta.compared, r.delta.unchanged, r.delta.max_index, r.delta.max_abs) == (
        whole.delta.compared,
        whole.delta.unchanged,
        whole.delta.max_index,
        whole.delta.max_abs,
    )
    for side in ("a", "b"):
        x, y = getattr(r, side), getattr(whole, side)
        assert (x.numel, x.nan, x.posinf, x.neginf, x.zeros, x.quantiles) == (
            y.numel,
            y.nan,
            y.posinf,
            y.neginf,
            y.zeros,
            y.quantiles,
        )
        assert (x.hist == y.hist).all()
        assert x.l2 == pytest.approx(y.l2, rel=1e-12, nan_ok=True)
    single = StatsAccumulator(dtype)
    for lo, hi in zip(edges, edges[1:]):
        single.add(b[lo:hi])
    assert single.result().nonfinite == whole.b.nonfinite
