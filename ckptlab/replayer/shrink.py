"""What the deeper searches (search.py, rewind.py) share: their budget of replays, delta
debugging to shrink a set that still faults, what counts as the same fault again, and how a row of a step's batch is named (a row
counted across an accumulated step's micro-batches is "micro-batch i row j")."""

from __future__ import annotations

from collections.abc import Callable

from ckptlab.analysis.batches import micro_row
from ckptlab.replayer.findings import place


class Budget:
    """How many more replays the deeper searches may spend, and which ones it cut short."""

    def __init__(self, replays: int):
        self.limit, self.used = max(0, int(replays)), 0
        self.ran_out: list[str] = []

    def take(self, search: str) -> bool:
        if self.used >= self.limit:
            if search not in self.ran_out:
                self.ran_out.append(search)
            return False
        self.used += 1
        return True

    def to_json(self) -> dict:
        return {"replays": self.limit, "used": self.used, "ran_out": list(self.ran_out)}


def ddmin(items: list, test: Callable[[list], bool | None]) -> tuple[list, bool]:
    """Zeller's delta debugging: a 1-minimal sublist of `items` for which `test` is true
    (`test(items)` is taken to be true). `test` returns None when it may not run any more
    (budget): the smallest list found so far comes back, with complete=False."""
    c, n = list(items), 2
    while len(c) >= 2:
        size = -(-len(c) // n)
        chunks = [c[i : i + size] for i in range(0, len(c), size)]
        for candidate in chunks + ([[x for x in c if x not in ch] for ch in chunks] if len(chunks) > 2 else []):
            found = test(candidate)
            if found is None:
                return c, False
            if found:
                n = 2 if candidate in chunks else max(n - 1, 2)
                c = candidate
                break
        else:
            if n >= len(c):
                break
            n = min(2 * n, len(c))
    return c, True


def negate(x: bool | None) -> bool | None:
    return None if x is None else not x


def where(batch, row: int, n: int | None = None) -> str:
    """'row 5', or 'micro-batch 1 row 2' for a row counted across a step's micro-batches (of
    `n` rows in all: a plain list of micro-batches is told apart by it)."""
    w = micro_row(batch, row, n)
    return place(row) if w is None else place(w[1], w[0])


def localize(found, batch, n: int | None = None):
    """Rows counted across an accumulated step's micro-batches (of `n` rows) -> (micro_batches,
    rows within them), as SampleBlame says them; unchanged for a plain batch."""
    places = [micro_row(batch, r, n) for r in found.rows]
    known = [w for w in places if w is not None]
    if known and len(known) == len(places):
        found.micro_batches, found.rows = [w[0] for w in known], [w[1] for w in known]
    return found


def same_fault(original: list[str]) -> Callable[[list[str]], bool]:
    """Whether a replay's anomalies are the original fault again: for a non-finite original,
    a non-finite loss, gradient or weight (a spike alone is another fault: one row's loss
    against the run's batch-mean history spikes easily); else one of the original's kinds
    (any anomaly where the original showed none)."""
    nonfinite = any(k.startswith("nonfinite") for k in original)
    kinds = set(original)

    def again(found: list[str]) -> bool:
        if nonfinite:
            return any(k.startswith("nonfinite") for k in found)
        return bool(kinds & set(found)) if kinds else bool(found)

    return again
