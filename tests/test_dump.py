"""The dump's capture (replayer/dump.py) on small direct cases: which input elements a
non-finite output came from, and the copies a watcher makes inside a traced step."""

from pathlib import Path

import torch
import torch.nn as nn

from ckptlab.replayer.dump import Capture, DumpRequest, explain_elements
from ckptlab.replayer.trace import Tracer


def test_a_softmax_nan_comes_from_its_row_all_neg_inf():
    scores = torch.randn(2, 3, 4)
    scores[1, 2] = float("-inf")
    out = scores.softmax(dim=-1)
    lines = explain_elements("aten._softmax.default", [scores, -1, False], [scores], out, 0)
    assert lines == ["output0[1, 2, 0] = nan <- input0[1, 2, :] all -inf (4 elements)"]


def test_a_matmul_inf_comes_from_a_row_and_a_column():
    bias, a, b = torch.zeros(3), torch.ones(2, 4), torch.ones(4, 3)
    a[1, 2:] = 3e38  # their sum overflows float32
    out = torch.addmm(bias, a, b)
    lines = explain_elements("aten.addmm.default", [bias, a, b], [bias, a, b], out, 0)
    assert lines[0] == (
        "output0[1, 0] = inf <- input0[0] = 0.0; input1[1, :] (4 elements: all finite, |x| max 3e+38); "
        "input2[:, 0] all 1.0 (4 elements)"
    )
    assert len(lines) == 3  # one per output element: each comes from another column


def test_an_elementwise_nan_comes_from_the_broadcast_elements_and_a_loss_from_all_of_its_inputs():
    summed, lengths = torch.zeros(4, 2), torch.tensor([[2.0], [1.0], [0.0], [3.0]])
    out = summed / lengths
    assert explain_elements("aten.div.Tensor", [summed, lengths], [summed, lengths], out, 0)[0] == (
        "output0[2, 0] = nan <- input0[2, 0] = 0.0; input1[2, 0] = 0.0"
    )
    logits, targets = torch.randn(3, 5), torch.full((3,), -100)
    loss = torch.tensor(float("nan"))
    lines = explain_elements("aten.nll_loss_forward.default", [logits, targets], [logits, targets], loss, 0)
    assert lines[0].startswith("output0 = nan <- input0[...] (15 elements: all finite")
    assert lines[0].endswith("input1[...] all -100 (3 elements)")


def test_capture_counts_calls_keeps_gradients_and_leaves_the_trace_unchanged():
    """Two micro-batches through one model: each module call is numbered; the gradients that
    reach its outputs and its accumulated parameter gradients are kept; and the trace's op
    indices are those of the step traced without the watcher (its copies are not traced)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    x = torch.randn(4, 3)

    def step():
        for i in (0, 2):
            model(x[i : i + 2]).sum().backward()

    with Tracer(model, rows=4, batch=x) as plain:
        step()
    model.zero_grad(set_to_none=True)
    capture = Capture(model, None, DumpRequest(Path("unused.h5"), select=r"^0$|^2$"))
    traced = Tracer(model, rows=4, batch=x, watch=capture)
    with capture.hooks(traced), traced:
        step()
    assert [e.op for e in traced.events] == [e.op for e in plain.events]
    paths = [e.path for e in capture.entries()]
    assert "modules/0/forward/1/output0" in paths and "modules/2/backward/1/grad_output0" in paths
    assert not any(p.startswith("modules/1/") for p in paths)  # not selected
    first = next(e for e in capture.forward if e.path == "modules/0/forward/0/output0")
    assert first.call == 0 and first.phase == "forward" and first.source.startswith("test_dump.py:")
    assert torch.equal(torch.from_numpy(first.data), model[0](x[0:2]).detach())
    grad = next(e for e in capture.entries() if e.path == "modules/2/param_grad/weight")
    assert torch.equal(torch.from_numpy(grad.data), model[2].weight.grad)  # both micro-batches
