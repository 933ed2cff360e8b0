"""Where each step's time went, as an inline SVG of stacked bars: one bar a step (or a bucket
of steps past MAX_BARS: the mean of each part over it), its parts stacked from the axis up.

    svg = stacked_bars(steps, [("data wait", wait, "#d62728"), ("step", step_time, "#1f77b4")],
                       title="where each step's time went", markers=[Marker(14, "slow step")])

Hovering a bar shows its step and each part in seconds (SVG <title>, no script).
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

import numpy as np

from ckptlab.numbers import precise
from ckptlab.render.svg import Frame, Marker, Series, _axes, _empty, _legend, _marker, _open

MAX_BARS = 400  # more steps are averaged in buckets: a bar narrower than ~2 px says nothing


def stacked_bars(
    steps: np.ndarray,
    parts: Sequence[tuple[str, np.ndarray, str]],
    *,
    title: str = "",
    markers: Sequence[Marker] = (),
    width: int = 760,
    height: int = 260,
) -> str:
    """`parts`: (label, values per step, color), NaN counted as 0, negative values as 0."""
    if not len(steps) or not parts:
        return _empty(title, width, height, "no step times recorded")
    x, values = _buckets(np.asarray(steps, dtype=np.float64), [np.asarray(v, dtype=np.float64) for _, v, _ in parts])
    tops = np.cumsum(values, axis=0)  # (parts, bars)
    y1 = float(tops[-1].max()) * 1.05 or 1.0
    half = (x[1] - x[0]) / 2 if len(x) > 1 else 0.5
    f = Frame(float(x[0]) - half, float(x[-1]) + half, 0.0, y1, False, width=width, height=height)
    out = [_open(width, height, title), _axes(f, "step")]
    bar = max((width - f.left - f.right) / len(x) * 0.85, 0.6)
    for j in range(len(x)):
        out.append(_bar(f, x[j], bar, [(p[0], p[2]) for p in parts], values[:, j], tops[:, j]))
    for mk in markers:
        out.append(_marker(f, mk))
    out.append(_legend([Series(label, [], [], color=color) for label, _, color in parts], width))
    out.append("</svg>")
    return "\n".join(out)


def _buckets(steps: np.ndarray, values: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(bar positions, values[parts, bars]): one bar a step, or the means over buckets of steps."""
    v = np.nan_to_num(np.maximum(np.stack(values), 0.0), nan=0.0)
    if len(steps) <= MAX_BARS:
        return steps, v
    edges = np.linspace(0, len(steps), MAX_BARS + 1).astype(int)
    x = np.array([steps[a:b].mean() for a, b in zip(edges[:-1], edges[1:])])
    return x, np.stack([[row[a:b].mean() for a, b in zip(edges[:-1], edges[1:])] for row in v])


def _bar(f: Frame, x: float, width: float, parts: list[tuple[str, str]], values, tops) -> str:
    """One bar: its parts stacked, and a <title> with each."""
    px = f.px(x) - width / 2
    rects = []
    for (_, color), value, top in zip(parts, values, tops):
        if value <= 0:
            continue
        y_top, y_base = f.py(float(top)), f.py(float(top - value))
        rects.append(
            f'<rect x="{px:.1f}" y="{y_top:.1f}" width="{width:.1f}" height="{max(y_base - y_top, 0.3):.1f}" fill="{color}"/>'
        )
    label = f"step {x:g}: " + ", ".join(f"{name} {precise(float(v))} s" for (name, _), v in zip(parts, values))
    return f"<g>{''.join(rects)}<title>{escape(label)}</title></g>"
