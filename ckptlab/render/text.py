"""Small text helpers for terminal rendering: inert run text (`safe`) and sparklines.

Numbers are written by ckptlab.numbers."""

from __future__ import annotations

import math
import re

# Control characters (C0 but tab and newline, DEL, C1): a terminal acts on them (ESC starts
# the sequences that clear the screen or retitle the window), so text from a run never
# reaches it with them.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")

_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values, width: int = 40) -> str:
    """A one-line plot; non-finite values show as '!'."""
    vals = list(values)
    if not vals:
        return ""
    if len(vals) > width:  # bucket by max, so spikes stay visible
        step = len(vals) / width
        vals = [
            max(
                vals[int(i * step) : max(int((i + 1) * step), int(i * step) + 1)],
                key=lambda v: v if math.isfinite(v) else math.inf,
            )
            for i in range(width)
        ]
    finite = [v for v in vals if math.isfinite(v)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    span = hi - lo or 1.0
    return "".join(
        "!" if not math.isfinite(v) else _BARS[min(len(_BARS) - 1, int((v - lo) / span * (len(_BARS) - 1) + 0.5))]
        for v in vals
    )


def safe(text) -> str:
    """Text read from a run or a file, made inert for the terminal: control characters shown
    as escapes (\\x1b), rich markup shown as typed. Every run-sourced string goes through it."""
    from rich.markup import escape

    return escape(_CONTROL.sub(lambda m: repr(m.group())[1:-1], str(text)))
