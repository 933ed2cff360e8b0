"""Inline SVG plots, written as text: no matplotlib, no JavaScript, no network.

    svg = line_chart([Series("loss", steps, loss), Series("EMA", steps, ema, width=2)],
                     log_y=True, markers=[Marker(152, "loss spike", "#d62728")])
    svg = heatmap(ratios, row_labels=names, col_values=steps, lo=-6, hi=0)
    svg = histogram_lines([(step, counts), ...], edges)

Every chart is a self-contained `<svg>` element sized in CSS pixels (with a viewBox, so it
scales). Hovering a point, cell or marker shows its value (SVG <title>, no script needed).
Non-finite values break a line and appear as red triangles along the top edge, so a NaN is
visible rather than silently dropped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape

import numpy as np

from ckptlab.numbers import precise, tick

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
BAD = "#d62728"
MAX_POINTS = 1500  # per series: more are bucketed (min and max per bucket, so spikes survive)


@dataclass
class Series:
    name: str
    x: Sequence[float] | np.ndarray
    y: Sequence[float] | np.ndarray
    color: str | None = None
    width: float = 1.0
    dash: str | None = None
    dots: bool = False  # draw points (validation), not only a line
    opacity: float = 1.0


@dataclass
class Marker:
    x: float
    label: str
    color: str = BAD


@dataclass
class Frame:
    """Maps data to pixels inside the plot area."""

    x0: float
    x1: float
    y0: float
    y1: float
    log_y: bool
    left: float = 64
    right: float = 16
    top: float = 28
    bottom: float = 36
    width: float = 760
    height: float = 240
    extra: dict = field(default_factory=dict)

    def px(self, x: float) -> float:
        span = (self.x1 - self.x0) or 1.0
        return self.left + (x - self.x0) / span * (self.width - self.left - self.right)

    def py(self, y: float) -> float:
        v, lo, hi = (math.log10(y), math.log10(self.y0), math.log10(self.y1)) if self.log_y else (y, self.y0, self.y1)
        span = (hi - lo) or 1.0
        return self.height - self.bottom - (v - lo) / span * (self.height - self.top - self.bottom)


def line_chart(
    series: list[Series],
    *,
    title: str = "",
    log_y: bool = False,
    markers: Sequence[Marker] = (),
    hlines: Sequence[tuple[float, str]] = (),
    vlines: Sequence[tuple[float, str]] = (),
    x_label: str = "step",
    width: int = 760,
    height: int = 240,
) -> str:
    xs = np.concatenate([np.asarray(s.x, dtype=np.float64) for s in series]) if series else np.zeros(0)
    ys = np.concatenate([np.asarray(s.y, dtype=np.float64) for s in series]) if series else np.zeros(0)
    good = np.isfinite(ys) & ((ys > 0) if log_y else True)
    if not good.any():
        return _empty(title, width, height, "no finite values to plot")
    y0, y1 = float(ys[good].min()), float(ys[good].max())
    y0, y1 = _pad_range(y0, y1, log_y)
    x0, x1 = float(np.nanmin(xs)), float(np.nanmax(xs))
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1
    f = Frame(x0, x1, y0, y1, log_y, width=width, height=height)
    parts = [_open(width, height, title), _axes(f, x_label)]
    for value, label in hlines:
        if y0 <= value <= y1:
            parts.append(
                f'<line x1="{f.left}" x2="{width - f.right}" y1="{f.py(value):.1f}" y2="{f.py(value):.1f}" '
                f'stroke="#999" stroke-dasharray="4 3"><title>{escape(label)}</title></line>'
            )
    for value, label in vlines:
        parts.append(_vline(f, value, label, "#555"))
    for i, s in enumerate(series):
        parts.append(_series(f, s, s.color or PALETTE[i % len(PALETTE)]))
    for mk in markers:
        parts.append(_marker(f, mk))
    parts.append(_legend(series, width))
    parts.append("</svg>")
    return "\n".join(parts)


def _pad_range(lo: float, hi: float, log_y: bool) -> tuple[float, float]:
    if log_y:
        lo, hi = math.log10(lo), math.log10(hi)
        pad = max((hi - lo) * 0.05, 0.1)
        return 10 ** (lo - pad), 10 ** (hi + pad)
    pad = (hi - lo) * 0.05 or max(abs(hi) * 0.05, 1e-12)
    return lo - pad, hi + pad


def _open(width: int, height: int, title: str) -> str:
    head = f'<svg class="chart" role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">'
    if title:
        head += f'\n<text x="8" y="16" font-size="13" font-weight="bold">{escape(title)}</text>'
    return head


def _empty(title: str, width: int, height: int, note: str) -> str:
    return f'{_open(width, height // 3, title)}\n<text x="8" y="40" fill="#777">{escape(note)}</text>\n</svg>'


def _axes(f: Frame, x_label: str) -> str:
    out = [
        f'<rect x="{f.left}" y="{f.top}" width="{f.width - f.left - f.right}" height="{f.height - f.top - f.bottom}" fill="none" stroke="#ccc"/>'
    ]
    for x in nice_ticks(f.x0, f.x1, 8):
        px = f.px(x)
        out.append(
            f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{f.height - f.bottom}" y2="{f.height - f.bottom + 4}" stroke="#888"/>'
            f'<text x="{px:.1f}" y="{f.height - f.bottom + 15}" text-anchor="middle">{tick(x)}</text>'
        )
    ticks = log_ticks(f.y0, f.y1) if f.log_y else nice_ticks(f.y0, f.y1, 5)
    for y in ticks:
        py = f.py(y)
        out.append(
            f'<line x1="{f.left}" x2="{f.width - f.right}" y1="{py:.1f}" y2="{py:.1f}" stroke="#eee"/>'
            f'<text x="{f.left - 4}" y="{py + 4:.1f}" text-anchor="end">{tick(y)}</text>'
        )
    out.append(
        f'<text x="{f.width - f.right}" y="{f.height - 4}" text-anchor="end" fill="#555">{escape(x_label)}</text>'
    )
    return "\n".join(out)


def _series(f: Frame, s: Series, color: str) -> str:
    x = np.asarray(s.x, dtype=np.float64)
    y = np.asarray(s.y, dtype=np.float64)
    x, y = _bucket(x, y)
    ok = np.isfinite(y) & ((y > 0) if f.log_y else True)
    out = []
    path, pen = [], "M"
    for xi, yi, good in zip(x, y, ok):
        if not good:
            pen = "M"
            continue
        path.append(f"{pen}{f.px(xi):.1f},{f.py(yi):.1f}")
        pen = "L"
    dash = f' stroke-dasharray="{s.dash}"' if s.dash else ""
    if path and not s.dots:
        out.append(
            f'<path d="{" ".join(path)}" fill="none" stroke="{color}" stroke-width="{s.width}" '
            f'stroke-opacity="{s.opacity}"{dash}><title>{escape(s.name)}</title></path>'
        )
    if s.dots:
        for xi, yi, good in zip(x, y, ok):
            if good:
                out.append(
                    f'<circle cx="{f.px(xi):.1f}" cy="{f.py(yi):.1f}" r="3" fill="{color}">'
                    f"<title>{escape(s.name)} @ {tick(xi)}: {precise(yi)}</title></circle>"
                )
        if path:
            out.append(
                f'<path d="{" ".join(path)}" fill="none" stroke="{color}" stroke-width="1" stroke-opacity="0.6"/>'
            )
    for xi, yi in zip(x[~np.isfinite(y)], y[~np.isfinite(y)]):  # NaN/Inf: a red triangle on top
        px = f.px(xi)
        out.append(
            f'<path d="M{px - 4:.1f},{f.top + 1} L{px + 4:.1f},{f.top + 1} L{px:.1f},{f.top + 8}" fill="{BAD}">'
            f"<title>{escape(s.name)} @ {tick(xi)}: {yi}</title></path>"
        )
    return "\n".join(out)


def _bucket(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """At most MAX_POINTS points: per bucket the min and the max (in x order), and every
    non-finite value."""
    n = len(x)
    if n <= MAX_POINTS:
        return x, y
    edges = np.linspace(0, n, MAX_POINTS // 2 + 1).astype(int)
    keep = set(np.flatnonzero(~np.isfinite(y)).tolist())
    for a, b in zip(edges[:-1], edges[1:]):
        seg = y[a:b]
        fin = np.isfinite(seg)
        if fin.any():
            idx = np.flatnonzero(fin)
            keep.add(a + int(idx[np.argmin(seg[fin])]))
            keep.add(a + int(idx[np.argmax(seg[fin])]))
    order = np.array(sorted(keep))
    return x[order], y[order]


def _vline(f: Frame, x: float, label: str, color: str) -> str:
    px = f.px(x)
    return (
        f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{f.top}" y2="{f.height - f.bottom}" stroke="{color}" stroke-dasharray="3 3">'
        f'<title>{escape(label)}</title></line><text x="{px + 3:.1f}" y="{f.top + 11}" fill="{color}">{escape(label)}</text>'
    )


def _marker(f: Frame, mk: Marker) -> str:
    px = f.px(mk.x)
    return (
        f'<g><line x1="{px:.1f}" x2="{px:.1f}" y1="{f.top}" y2="{f.height - f.bottom}" stroke="{mk.color}" stroke-opacity="0.35"/>'
        f'<circle cx="{px:.1f}" cy="{f.height - f.bottom}" r="4" fill="{mk.color}"/>'
        f"<title>{escape(mk.label)} at step {tick(mk.x)}</title></g>"
    )


def _legend(series: list[Series], width: int) -> str:
    out: list[str] = []
    x: float = width - 16
    for i, s in reversed(list(enumerate(series))):
        color = s.color or PALETTE[i % len(PALETTE)]
        label = escape(s.name)
        x -= 14 + 6.5 * len(s.name) + (12 if i < len(series) - 1 else 0)
        out.append(
            f'<rect x="{x:.0f}" y="8" width="10" height="10" fill="{color}"/><text x="{x + 13:.0f}" y="17">{label}</text>'
        )
    return "\n".join(out)


# --- heat map -----------------------------------------------------------------------------------------


def heatmap(
    matrix: np.ndarray,
    *,
    row_labels: Sequence[str],
    col_values: Sequence[float] | np.ndarray,
    lo: float,
    hi: float,
    title: str = "",
    band: tuple[float, float] | None = None,
    value_name: str = "value",
    max_cols: int = 160,
    width: int = 760,
) -> str:
    """Rows x columns of values coloured by log10 between 10**lo and 10**hi. Exact zeros
    are black (e.g. a frozen layer's update ratio), NaN light grey, non-finite red."""
    m = np.asarray(matrix, dtype=np.float64)
    cols = np.asarray(col_values, dtype=np.float64)
    if m.size == 0:
        return _empty(title, width, 120, "nothing measured")
    if m.shape[1] > max_cols:  # median-pool columns
        edges = np.linspace(0, m.shape[1], max_cols + 1).astype(int)
        with np.errstate(all="ignore"):
            m = np.stack([_nanmedian_rows(m[:, a:b]) for a, b in zip(edges[:-1], edges[1:])], 1)
        cols = np.array([cols[a] for a in edges[:-1]])
    label_w = min(260, 8 + 6.4 * max((len(s) for s in row_labels), default=4))
    cell_h = 14
    plot_w = width - label_w - 16
    cw = plot_w / m.shape[1]
    top = 28
    height = int(top + cell_h * m.shape[0] + 58)
    out = [_open(width, height, title)]
    for i, label in enumerate(row_labels):
        y = top + i * cell_h
        out.append(f'<text x="{label_w - 4:.0f}" y="{y + 11}" text-anchor="end">{escape(label)}</text>')
        for j in range(m.shape[1]):
            v = m[i, j]
            out.append(
                f'<rect x="{label_w + j * cw:.2f}" y="{y}" width="{cw + 0.3:.2f}" height="{cell_h - 1}" fill="{_heat(v, lo, hi)}">'
                f"<title>{escape(label)} @ {tick(cols[j])}: {value_name} {v:.3g}</title></rect>"
            )
    y = top + m.shape[0] * cell_h + 6
    out.append(_color_bar(label_w, y, plot_w, lo, hi, band))
    out.append("</svg>")
    return "\n".join(out)


def _nanmedian_rows(block: np.ndarray) -> np.ndarray:
    out = np.full(block.shape[0], np.nan)
    for i, row in enumerate(block):
        fin = row[~np.isnan(row)]
        if len(fin):
            out[i] = np.median(fin)
    return out


def _heat(v: float, lo: float, hi: float) -> str:
    if np.isnan(v):
        return "#eeeeee"
    if not np.isfinite(v):
        return BAD
    if v <= 0:
        return "#000000"
    t = (math.log10(v) - lo) / ((hi - lo) or 1.0)
    return viridis(min(1.0, max(0.0, t)))


_VIRIDIS = [
    (68, 1, 84),
    (72, 40, 120),
    (62, 74, 137),
    (49, 104, 142),
    (38, 130, 142),
    (31, 158, 137),
    (53, 183, 121),
    (109, 205, 89),
    (180, 222, 44),
    (253, 231, 37),
]


def viridis(t: float) -> str:
    pos = t * (len(_VIRIDIS) - 1)
    i = min(int(pos), len(_VIRIDIS) - 2)
    a, b, w = _VIRIDIS[i], _VIRIDIS[i + 1], pos - i
    return "#" + "".join(f"{round(ca + (cb - ca) * w):02x}" for ca, cb in zip(a, b))


def _color_bar(x: float, y: float, w: float, lo: float, hi: float, band) -> str:
    steps = 40
    out = [
        f'<rect x="{x + k * w / steps:.2f}" y="{y}" width="{w / steps + 0.3:.2f}" height="10" fill="{viridis(k / (steps - 1))}"/>'
        for k in range(steps)
    ]
    for e in range(math.ceil(lo), math.floor(hi) + 1):
        px = x + (e - lo) / (hi - lo) * w
        out.append(f'<text x="{px:.1f}" y="{y + 22}" text-anchor="middle">1e{e}</text>')
    if band:
        a, b = (x + (math.log10(v) - lo) / (hi - lo) * w for v in band)
        out.append(
            f'<rect x="{a:.1f}" y="{y - 2}" width="{b - a:.1f}" height="14" fill="none" stroke="#000" stroke-width="1.5">'
            f"<title>healthy band {band[0]:g}..{band[1]:g}</title></rect>"
            f'<text x="{(a + b) / 2:.1f}" y="{y + 34}" text-anchor="middle">healthy band</text>'
        )
    out.append(
        f'<rect x="{x - 62}" y="{y}" width="10" height="10" fill="#000"/><text x="{x - 48}" y="{y + 9}">0</text>'
    )
    return "\n".join(out)


# --- histograms -----------------------------------------------------------------------------------------


def histogram_lines(
    hists: list[tuple[str, np.ndarray]], edges: np.ndarray, *, title: str = "", width: int = 370, height: int = 150
) -> str:
    """One line per histogram (same bins), light to dark in order: how a distribution moved.
    Bins are trimmed to the range any histogram uses."""
    counts = np.array([h for _, h in hists], dtype=np.float64)
    if counts.size == 0 or counts.sum() == 0:
        return _empty(title, width, height, "no values")
    used = np.flatnonzero(counts.sum(0) > 0)
    a, b = max(0, used[0] - 1), min(counts.shape[1], used[-1] + 2)
    frac = counts[:, a:b] / np.maximum(counts[:, a:b].sum(1, keepdims=True), 1)
    centers = (edges[a:b] + edges[a + 1 : b + 1]) / 2
    f = Frame(
        float(centers[0]),
        float(centers[-1]),
        0.0,
        float(frac.max()) * 1.08 or 1.0,
        False,
        left=36,
        right=8,
        top=22,
        bottom=30,
        width=width,
        height=height,
    )
    out = [_open(width, height, title)]
    out.append(
        f'<rect x="{f.left}" y="{f.top}" width="{width - f.left - f.right}" height="{height - f.top - f.bottom}" fill="none" stroke="#ccc"/>'
    )
    every = max(1, math.ceil((centers[-1] - centers[0]) / 7))  # whole decades
    for x in range(math.ceil(centers[0]), math.floor(centers[-1]) + 1):
        if x % every:
            continue
        out.append(
            f'<text x="{f.px(x):.1f}" y="{height - f.bottom + 13}" text-anchor="middle">{symlog_label(x)}</text>'
        )
    shades = len(hists)
    for k, ((label, _), row) in enumerate(zip(hists, frac)):
        shade = 0.25 + 0.75 * (k + 1) / shades
        color = f"rgba(31,119,180,{shade:.2f})" if k < shades - 1 else "#08306b"
        pts = " ".join(f"{f.px(c):.1f},{f.py(v):.1f}" for c, v in zip(centers, row))
        out.append(
            f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="{1.8 if k == shades - 1 else 1.1}">'
            f"<title>{escape(label)}</title></polyline>"
        )
    out.append(f'<text x="{width - 8}" y="{height - 4}" text-anchor="end" fill="#555">value (signed log scale)</text>')
    out.append("</svg>")
    return "\n".join(out)


def symlog_label(v: float) -> str:
    """Inverse of stats.symlog for an axis label: s*(log10|x| + 10) -> x."""
    if abs(v) < 1e-9:
        return "0"
    mag = abs(v) - 10
    return f"{'-' if v < 0 else ''}1e{mag:.0f}"


# --- ticks -------------------------------------------------------------------------------------------


def nice_ticks(lo: float, hi: float, n: int) -> list[float]:
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo] if math.isfinite(lo) else []
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def log_ticks(lo: float, hi: float) -> list[float]:
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    every = max(1, (b - a) // 6)
    return [10.0**e for e in range(a, b + 1, every) if lo <= 10.0**e <= hi]
