"""How ckptlab writes a number for a person, and compares two as the record does: one place.

Base layer (no torch, no rich), so analysis/, replayer/ and render/ all use it. Each function
is one way a number is said; pick by what the number is, not by how it should look:

    value(0.123456)         "0.1235"     a measurement in a table or a line: 4 significant digits
    precise(2.34567891)     "2.34568"    a loss set against its record: 6 significant digits
    short_number(12345.6)   "1.23e4"     a tensor statistic in a diff: few characters
    tick(250000.0)          "2e+05"      a chart's axis label: integers stay integers
    human_bytes(3 << 20)    "3.0 MB"
    ranges([2, 3, 4, 7])    "2-4, 7"

    precise(None, LOSS_NOT_KNOWN)  "not known"  a loss the step did not return (recorded null)
    same(nan, nan)          True         bit for bit as the record compares (NaN is NaN)
    same_loss(None, None)   True         two losses not known agree; `same` otherwise
    absdiff(1.0, None)      None         |a - b| when both are finite
"""

from __future__ import annotations

import math

# --- writing ------------------------------------------------------------------------------------

# How a loss that is not known (a step that returned none: recorded null) is said; never "nan",
# which is a fault.
LOSS_NOT_KNOWN = "not known"


def value(x, missing: str = "-") -> str:
    """A measured value (loss, gradient norm, metric): 4 significant digits; `missing` for None,
    anything not a float as it is (an int, a string from the run)."""
    if x is None:
        return missing
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def precise(x, missing: str = "n/a") -> str:
    """A value to set against the record or another run (a replayed loss): 6 significant digits."""
    return missing if x is None else f"{x:.6g}"


def short_number(x: float, digits: int = 3) -> str:
    """A number in few characters: 0.0123, 4.56, 1.23e4 (not 1.23e+04), inf."""
    if not math.isfinite(x):
        return str(x)
    text = f"{x:.{digits}g}"
    if "e" in text:
        mantissa, exp = text.split("e")
        text = f"{mantissa}e{int(exp)}"
    return text


def tick(v: float) -> str:
    """A chart's axis label (and the step a point is at): short, integers without a point."""
    if v == 0:
        return "0"
    if abs(v) >= 1e5 or abs(v) < 1e-3:
        return f"{v:.0e}"
    if float(v).is_integer():
        return str(int(v))
    return f"{v:.3g}"


def human_bytes(n: float) -> str:
    """A size in powers of 1024: "512 B", "3.0 MB"."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def ranges(xs: list[int]) -> str:
    """Sorted integers as runs: [2, 3, 4, 7] -> "2-4, 7"."""
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out)


# --- comparing ----------------------------------------------------------------------------------


def same(a: float | None, b: float | None) -> bool:
    """Equal bit for bit as a replay is checked against its record: NaN matches NaN, None nothing."""
    if a is None or b is None:
        return False
    if math.isnan(a) and math.isnan(b):
        return True
    return a == b


def same_loss(a: float | None, b: float | None) -> bool:
    """Two losses as a replay is checked against its record (`same`), where None is a loss not
    known (the step returned none): two such agree."""
    return same(a, b) or (a is None and b is None)


def absdiff(a, b) -> float | None:
    """|a - b|, or None unless both are finite."""
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return None
    return abs(a - b)
