"""The writer thread's cost of one journal summary (ckptlab/run/columns.py): a segment's
summary built from the records as the Recorder appended them (checked against the segment's
frame headers) against one built by decoding the segment's frames, in the same run. CPU time
of the best of --repeat, per segment and per record.

    PYTHONPATH=. python scripts/bench_summary.py SEGMENT.log [--repeat 5]

SEGMENT: a journal segment of a run (e.g. one of scripts/bench_long_run.py's, 500 steps of a
148-tensor model); it is copied to a temporary folder, and its summary written there.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptlab.run import columns, framelog  # noqa: E402
from ckptlab.run.columns import Columns, Rows  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("segment", type=Path)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    copy = Path(tempfile.mkdtemp()) / args.segment.name
    shutil.copy(args.segment, copy)
    cols = Columns.from_frames(framelog.iter_payloads(copy), str(copy))
    # The records as the writer holds them: the scalars, the arrays as lists of floats (the
    # usual step's form, records.encode_step_floats).
    arrays: list[dict] = [{} for _ in range(len(cols))]
    for key, (rows, values) in cols.arrays.items():
        for i, a in zip(rows, values):
            arrays[i][key] = a.tolist()
    appended = ([(r["step"], r, a) for r, a in zip(Rows(cols), arrays)], list(cols.others))

    def best(fn) -> float:
        out = float("inf")
        for _ in range(args.repeat):
            t0 = time.process_time()
            fn()
            out = min(out, time.process_time() - t0)
        return out

    fast = best(lambda: columns.write_summary(copy, appended))
    slow = best(lambda: columns.write_summary(copy))
    n = len(cols)
    print(
        f"{n} records: from the appended records {fast * 1e3:.1f} ms CPU ({fast / n * 1e6:.0f} us a record), "
        f"decoding the frames {slow * 1e3:.1f} ms ({slow / n * 1e6:.0f} us), ratio {slow / fast:.2f}"
    )
    shutil.rmtree(copy.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
