"""analysis/batches.py: a step recorded as micro-batches is counted, split and selected by the
rows numbered across its micro-batches; a flattened (T*B,) target by the rows of its data."""

import torch

from ckptlab.analysis.batches import batch_rows, micro_row, replace_rows, row_batch, row_groups, select_rows


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


def test_rows_are_taken_out_of_and_put_back_into_their_micro_batches():
    """The minimal culprit's rows, from different micro-batches, into another step's batch
    recorded as micro-batches of other sizes (or a plain one): each goes into the micro-batch
    that holds its row number."""
    root, other = accumulated(), accumulated()
    for part in other["micro_batches"]:
        part["x"] = part["x"] + 10  # row r of `other` holds r + 10
    one = row_batch(root, 3, 6)
    assert one["x"].tolist() == [[3.0] * 4] and one["batch_idx"] == 1  # micro-batch 1's row 1, alone
    rows = [1, 5]  # micro-batches 0 and 2
    moved = other
    for r in rows:
        moved = replace_rows(moved, 6, [r], row_batch(root, r, 6), 1)
    assert moved["micro_rows"] == [2, 3, 1] and moved["how"] == {"k": 3}
    assert [p["x"][:, 0].tolist() for p in moved["micro_batches"]] == [[10.0, 1.0], [12.0, 13.0, 14.0], [5.0]]
    assert other["micro_batches"][0]["x"][1, 0] == 11.0  # `other` itself is left as it was
    # the rows of two micro-batches at once, taken from a batch selected across them
    both = replace_rows(other, 6, rows, select_rows(root, rows, 6), 2)
    assert [p["x"][:, 0].tolist() for p in both["micro_batches"]] == [[10.0, 1.0], [12.0, 13.0, 14.0], [5.0]]
    plain = {"x": torch.arange(6.0)[:, None].repeat(1, 4) + 20, "batch_idx": 0}  # built as a micro-batch is
    into_plain = replace_rows(plain, 6, rows, select_rows(root, rows, 6), 2)
    assert into_plain["x"][:, 0].tolist() == [20.0, 1.0, 22.0, 23.0, 24.0, 5.0]


def test_a_flattened_target_loses_the_same_rows_as_the_data_it_was_flattened_from():
    """The word-level LM's `targets = source[i+1:i+1+bptt].view(-1)` beside `data` (bptt, B): a
    row is a column of data and every B-th element of targets; a batch-first (B, T) leaf's
    flattening gives each row T consecutive elements."""
    T, B = 5, 4
    data = torch.arange(T * B).view(T, B)
    hidden = torch.randn(2, B, 3)
    kept = select_rows((data, (data + 100).view(-1), hidden), [1, 3], B)
    assert torch.equal(kept[1], (kept[0] + 100).reshape(-1)) and kept[2].shape == (2, 2, 3)
    x = torch.arange(B * T).view(B, T)
    kept = select_rows({"x": x, "y": (x + 100).view(-1)}, [2], B)
    assert torch.equal(kept["y"], kept["x"].reshape(-1) + 100)
    donor = select_rows((data, (data + 100).view(-1), hidden), [1], B)
    mixed = replace_rows((data, (data + 100).view(-1), hidden), B, [2], (-donor[0], -donor[1], donor[2]), 1)
    assert torch.equal(mixed[1].view(T, B)[:, 2], -(data[:, 1] + 100)) and torch.equal(mixed[0][:, 2], -data[:, 1])


def test_an_image_batch_flattens_no_target():
    """(B, 3, H, W) images are no (B, T) leaf: a 1-D per-class weight of length 3 * B stays whole."""
    B = 4
    images, weights = torch.randn(B, 3, 2, 2), torch.ones(3 * B)
    assert select_rows((images, weights), [0, 1], B)[1].shape == (3 * B,)
