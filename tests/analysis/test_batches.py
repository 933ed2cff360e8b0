"""analysis/batches.py: a step recorded as micro-batches is counted, split and selected by the
rows numbered across its micro-batches."""

import torch

from ckptlab.analysis.batches import batch_rows, micro_row, row_groups, select_rows


def accumulated():
    """Three micro-batches of 2, 3 and 1 rows; row r of the step holds the value r."""
    rows = [[0, 1], [2, 3, 4], [5]]
    parts = [
        {"x": torch.tensor(r, dtype=torch.float32)[:, None].repeat(1, 4), "batch_idx": i} for i, r in enumerate(rows)
    ]
    return {"micro_batches": parts, "micro_rows": [2, 3, 1], "how": {"k": 3}}


def test_rows_are_numbered_across_the_micro_batches():
    batch = accumulated()
    assert batch_rows(batch, None) == 6
    assert [(first, n) for first, _, n in row_groups(batch, 6)] == [(0, 2), (2, 3), (5, 1)]
    assert [micro_row(batch, r) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (2, 0)]
    assert micro_row({"x": torch.zeros(3)}, 1) is None  # a plain batch has no micro-batches


def test_select_rows_keeps_the_micro_batches_that_keep_a_row():
    picked = select_rows(accumulated(), [1, 3, 4], 6)
    assert picked["micro_rows"] == [1, 2] and picked["how"] == {"k": 3}
    assert [p["batch_idx"] for p in picked["micro_batches"]] == [0, 1]  # micro-batch 2 had none
    assert [p["x"][:, 0].tolist() for p in picked["micro_batches"]] == [[1.0], [3.0, 4.0]]
