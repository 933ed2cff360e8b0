"""A deliberate mask is not an origin (#25 item 7): a causal mask's -inf, softmaxed to 0, harms
nothing; the origin is the first op whose non-finite values reach the first NaN."""

import math

import pytest
import torch
import torch.nn as nn

from ckptlab.replayer.trace import Tracer
from tests import mask_models as mm


@pytest.fixture(scope="module", params=["log", "additive", "fill"])
def masked_run(request, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp(f"mask_{request.param}") / "run"
    mm.record(run_dir, request.param)
    return run_dir


def test_replay_names_the_layernorm_not_the_mask(masked_run, cli):
    r = cli("replay", "--run", masked_run, "--step", mm.BAD_STEP, "--json", "--no-counterfactuals")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["root_step"] == mm.BAD_STEP and doc["deterministic"]
    o = doc["origin"]
    assert (o["kind"], o["module"], o["op"]) == ("data", "blocks.0.ln1", "aten.native_layer_norm.default"), o
    assert doc["chain"][0]["module"] == "blocks.0.ln1" and doc["chain"][0]["rows"] == [mm.BAD_ROW]
    assert [(s["row"], s["sample_id"]) for s in doc["samples"]][:1] == [(mm.BAD_ROW, 100 * mm.BAD_STEP + mm.BAD_ROW)]


def _traced(kind: str, bad: bool) -> Tracer:
    model, opt = mm.BUILDS[kind]()
    batch = mm.batch(mm.BAD_STEP, mm.BAD_STEP if bad else None)
    with Tracer(model, opt, rows=mm.B, batch=batch) as tr:
        mm.step(model, opt, batch)
    return tr


@pytest.mark.parametrize("kind", ["log", "additive", "fill"])
def test_a_healthy_masked_step_has_no_origin(kind):
    """The log mask is made from finite inputs (a candidate), but the softmax makes its -inf
    finite again: no op is an origin, and replay's blame looks for a finite explosion."""
    tr = _traced(kind, bad=False)
    assert tr.origin is None and tr.chain() == []
    assert [c.op for c in tr.candidates] == (["aten.log.default"] if kind == "log" else [])


def test_the_chain_follows_the_fault_not_the_mask():
    tr = _traced("log", bad=True)
    assert all(tr.origin.index in e.roots for e in tr.chain())
    assert not any(e.op == "aten.log.default" for e in tr.chain())


class PostNorm(nn.Module):
    """Scores from the raw input, the log mask added, softmax: an absurd row overflows the
    scores (+Inf in its row, the mask's -Inf everywhere), and its softmax is NaN."""

    def forward(self, x):
        mask = torch.log(torch.tril(torch.ones(x.shape[1], x.shape[1])))
        att = (x @ x.transpose(1, 2) + mask).softmax(dim=-1)
        return att @ x


def test_when_a_mask_and_an_overflow_meet_in_a_nan_the_overflow_is_the_origin():
    x = torch.randn(4, 6, 3)
    x[2] *= 1e20  # row 2's scores overflow to +Inf; with the mask's -Inf: NaN
    with Tracer(PostNorm(), rows=4) as tr:
        out = PostNorm()(x)
    assert not bool(torch.isfinite(out[2]).all()) and bool(torch.isfinite(out[[0, 1, 3]]).all())
    o = tr.origin
    assert o.op == "aten.bmm.default" and o.new_inf and o.bad_rows is not None and set(o.bad_rows) == {2}


def test_an_inf_made_finite_again_is_no_origin_but_one_that_reaches_the_loss_is():
    """tanh(+Inf) = 1: an overflow absorbed, no origin. sigmoid(-Inf) = 0 absorbs it too, but
    the log of that 0 is -Inf in the loss: the log is the origin of what reaches the end."""
    lin = nn.Linear(2, 1)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    x = torch.tensor([[3e38, 3e38], [1.0, 1.0]])
    with Tracer(lin, rows=2) as tr:
        torch.tanh(lin(x)).sum()
    assert tr.candidates and tr.origin is None
    with Tracer(lin, rows=2) as tr:
        loss = -torch.log(torch.sigmoid(-lin(x))).sum()
    assert math.isinf(loss.item())
    assert [c.op for c in tr.candidates] == ["aten.addmm.default", "aten.log.default"]
    assert tr.origin is not None and tr.origin.op == "aten.log.default" and tr.origin.bad_rows == {0: 1}


class Preallocated(nn.Module):
    """Writes each position's result into a preallocated tensor (an RNN loop's `out[:, t] = h`)."""

    def forward(self, x):
        out = torch.zeros_like(x)
        for t in range(x.shape[1]):
            out[:, t] = torch.exp(x[:, t])  # exp(100) overflows float32
        return torch.log(out.sum(dim=1)) - out.sum(dim=1)  # inf - inf = NaN in the overflowed row


def test_values_written_into_a_preallocated_tensor_keep_their_origin():
    x = torch.zeros(3, 4)
    x[1, 2] = 100.0
    with Tracer(Preallocated(), rows=3) as tr:
        Preallocated()(x)
    assert tr.nan_events and tr.origin is not None
    assert tr.origin.op == "aten.exp.default" and tr.origin.bad_rows == {1: 1}
