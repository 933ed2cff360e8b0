"""The origin rule and op placement of trace.Tracer, on small direct cases."""

import torch
import torch.nn as nn

from ckptlab.replayer.lineage import rows_of
from ckptlab.replayer.trace import Tracer, batch_slice, summarize


class Masked(nn.Module):
    def forward(self, scores, mask):
        return scores.masked_fill(mask, float("-inf")).softmax(dim=-1)


class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.att = Masked()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, mask):
        return self.lin(self.att(x, mask))


def test_intended_inf_is_not_an_origin_but_the_softmax_of_a_fully_masked_row_is():
    model = Root()
    x = torch.randn(3, 4)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    mask[:, 3] = True  # partial masking everywhere: -inf on purpose, no NaN
    with Tracer(model, rows=3) as tr:
        model(x, mask)
    assert tr.origin is None
    mask[1] = True  # row 1 fully masked
    with Tracer(model, rows=3) as tr:
        model(x, mask).sum().backward()
    o = tr.origin
    assert (o.op, o.module, o.phase, o.call) == ("aten._softmax.default", "att", "forward", "softmax")
    assert o.new_nan and o.bad_rows == {1: 4}
    assert o.source.startswith("test_trace.py:")


class SqrtNorm(nn.Module):
    def forward(self, x):
        return torch.sqrt((x * x).sum(dim=1))  # finite forward; at x = 0 the backward divides by 0


def test_backward_origin_is_charged_to_the_module_that_created_the_op():
    model = nn.Sequential(nn.Linear(3, 3), SqrtNorm())
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
    with Tracer(model, rows=2) as tr:
        out = model(torch.randn(2, 3))
        assert torch.isfinite(out).all()
        out.sum().backward()
    o = tr.origin
    assert o.phase == "backward"
    assert o.module == "1"  # the SqrtNorm, whose forward created the op
    assert o.call == "sqrt"


def test_uninitialized_memory_is_not_an_origin():
    with Tracer(nn.Identity()) as tr:
        e = torch.empty(1000)
        e.fill_(1.0)
    assert tr.origin is None


def test_overflow_from_finite_inputs_is_an_origin():
    lin = nn.Linear(2, 1)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    with Tracer(lin, rows=2) as tr:
        lin(torch.tensor([[3e38, 3e38], [1.0, 1.0]]))
    assert tr.origin.op == "aten.addmm.default" and tr.origin.new_inf and tr.origin.bad_rows == {0: 1}


def test_summaries_and_row_mapping():
    s = summarize(torch.tensor([1.0, -3.0, float("nan"), float("inf")]))
    assert (s.nan, s.posinf, s.neginf, s.absmax) == (1, 1, 0, 3.0)
    assert summarize(torch.tensor([1.0, -3.0])).finite
    assert rows_of((4, 10), [2, 7], 4) == 2  # (B, ...)
    assert rows_of((8, 5), [5, 0], 4) == 2  # (B*2, ...) batch-major
    assert rows_of((7, 4, 3), [0, 3, 1], 4) == 3  # (T, B, ...)
    assert rows_of((3, 3), [0, 0], 4) is None


def test_a_replayed_step_charges_no_op_to_ckptlab_itself(run_dir):
    """Ops that ckptlab runs around the user's step (the probe's copy of the weights for update
    ratios) are not the user's: no traced op is placed in ckptlab's own files."""
    import ckptlab
    from ckptlab.replayer.driver import Replayer
    from tests import models

    models.record_run(run_dir, models.build_mlp, models.step_mlp, models.mlp_batches(2))
    replayer = Replayer(ckptlab.open_run(run_dir))
    runner = replayer.build()
    replayer.load_checkpoint(runner, 0)
    tracer = Tracer(runner.model, runner.optimizer, rows=4)
    replayer.run_step(runner, replayer.batch(0), tracer=tracer, measure_update=True)
    replayer.close(runner)
    files = {e.source.split(":")[0] for e in tracer.events if e.source}
    assert files == {"models.py"}


def test_batch_slice_names_the_rows_a_view_into_the_batch_holds():
    seq = torch.arange(6 * 9).reshape(6, 9)
    x, y = seq[:, :-1], seq[:, 1:]  # two batch tensors sharing one storage
    assert batch_slice([x[2:3]], [x, y], 6) == (2, 1)
    assert batch_slice([y[4:6]], [x, y], 6) == (4, 2)
    assert batch_slice([x[3]], [x], 6) == (3, 1)  # a row without its batch dimension
    assert batch_slice([x[1:2, 2:]], [x], 6) == (1, 1)
    assert batch_slice([x], [x], 6) is None  # the whole batch: no micro-batch
    assert batch_slice([x[::2]], [x], 6) is None  # not a run of rows
    assert batch_slice([x[2:3].clone()], [x], 6) is None  # a copy


class LossModel(nn.Module):
    def forward(self, x, t):
        return (x.sum(dim=1) / t.sum(dim=1)).mean()  # a row with t == 0: 0/0 in its micro-batch


def test_a_micro_batch_loop_maps_each_micro_batch_loss_to_its_row():
    model = LossModel()
    x = torch.zeros(4, 3)
    t = torch.ones(4, 3)
    t[2] = 0.0
    with Tracer(model, rows=4, batch=(x, t)) as tr:
        for i in range(4):
            model(x[i : i + 1], t[i : i + 1])
    assert tr.micro_batches == 4
    assert tr.origin is not None and tr.origin.bad_rows == {2: 1}
    with Tracer(model, rows=4, batch=(x, t)) as tr:  # copies: micro-batches taken in order
        for i in range(0, 4, 2):
            model(x[i : i + 2].clone(), t[i : i + 2].clone())
    assert tr.origin is not None and tr.origin.bad_rows == {2: 1}  # the (2, 1) division, row 2 of 2..3
