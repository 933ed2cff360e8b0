"""ZeRO's per-rank checkpoints (ckptlab/training/zero_parts.py): a range of a parameter's
elements, as a rank's flat partition holds it, is cut into the boxes DCP stores."""

import math

import pytest
import torch

from ckptlab.training.zero_parts import boxes


@pytest.mark.parametrize("shape", [(16, 8), (3, 4, 5), (7,), (2, 1, 3, 2), (1, 16)])
def test_boxes_hold_exactly_the_range_in_row_major_order(shape):
    whole = torch.arange(math.prod(shape)).reshape(shape)
    n = whole.numel()
    for start in range(n):
        for stop in range(start + 1, n + 1):
            found = boxes(shape, start, stop)
            got = torch.cat([whole[tuple(slice(o, o + s) for o, s in zip(off, size))].flatten() for off, size in found])
            assert torch.equal(got, torch.arange(start, stop)), (start, stop, found)
    assert len(boxes(shape, 1, n - 1)) <= 2 * len(shape) - 1  # (a partial row, whole rows, a partial row)


def test_a_zero_dim_tensor_is_one_box_and_an_empty_range_none():
    assert boxes((), 0, 1) == [((), ())]
    assert boxes((4, 4), 5, 5) == []
