"""Terminal and image rendering of `ckptlab diff` findings (the JSON is jsonout's, unchanged).

render(findings, term, hist="blocks.3.mlp.fc.weight", show_all=False)
plot(findings, "diff.png", names=[...])
"""

from __future__ import annotations

import math
import re

import numpy as np

from ckptlab.analysis.diff.findings import UNFLAGGED, DiffFindings, TensorFinding
from ckptlab.errors import CkptlabError, install_hint
from ckptlab.numbers import human_bytes, short_number
from ckptlab.render.text import safe
from ckptlab.stats.histogram import DECADES, HIST_EDGES

TIER_STYLE = {0: "bold red", 1: "red", 2: "dark_orange", 3: "yellow", 4: "magenta", 5: "cyan"}
DEFAULT_ROWS = 40  # beyond this many tensors, the table shows flagged layers and the top of the ranking
TOP_UNFLAGGED = 10
BAR = 28  # characters per histogram bar


def render(f: DiffFindings, term, *, hist: str | None = None, show_all: bool = False) -> None:
    _header(f, term)
    _verdict(f, term)
    term.print(_table(f, show_all, term.out.width))
    target = f.finding(hist) if hist else _top_flagged(f)
    if target is not None:
        _histogram(target, term, pair=f.b is not None)
    _unmatched(f, term)
    s = f.summary
    rate = f", {s['gb_per_s']:.2f} GB/s" if s.get("gb_per_s") and s["bytes"] >= 1 << 26 else ""
    term.print(
        f"[dim]{s['compared']} tensors ({human_bytes(s['bytes'])}) in {s['seconds']:.2f} s{rate}, "
        f"{s['workers']} thread(s), {s['read']} reads[/dim]"
    )


def _header(f: DiffFindings, term) -> None:
    s = f.summary
    term.print(f"[bold]A[/bold]  {_esc(f.a)}  [dim]({s['format_a']})[/dim]")
    if f.b is not None:
        term.print(f"[bold]B[/bold]  {_esc(f.b)}  [dim]({s['format_b']})[/dim]")
    for note in f.notes:
        term.note(note)
    for sk in f.skipped:
        term.warn(f"{sk['side'].upper()}: {sk['name']} not compared: {sk['reason']}")


def _top_flagged(f: DiffFindings) -> TensorFinding | None:
    return f.ranked[0] if f.ranked and f.ranked[0].tier < UNFLAGGED else None


def _verdict(f: DiffFindings, term) -> None:
    if f.verdict:
        v = f.verdict
        shape = v.kind == "shape_changed"
        head, reason = (
            ("shape changed", v.reason.removeprefix("shape changed ")) if shape else ("offending parameter", v.reason)
        )
        term.print(
            f"[bold red]{head}:[/bold red] [bold]{_esc(v.parameter)}[/bold] "
            f"(module {_esc(v.module) or '<root>'}): {_esc(reason)}"
        )
        flagged = _top_flagged(f)
        if v.kind == "shape_changed" and flagged is not None:  # the ranking's own headline comes next
            term.print(f"[bold]top flagged tensor:[/bold] {_esc(flagged.name)}: {_esc(flagged.reason or '')}")
        return
    if f.b is None:
        term.print(f"[bold green]healthy:[/bold green] {len(f.ranked)} tensors, none non-finite, extreme or dead")
        return
    moved = [(x.delta.rel_change, x) for x in f.ranked if x.delta and math.isfinite(x.delta.rel_change)]
    if moved and max(ratio for ratio, _ in moved) == 0:
        term.print(f"[bold green]identical:[/bold green] all {len(f.ranked)} compared tensors are bit-for-bit equal")
        return
    top = max(moved, key=lambda rx: rx[0]) if moved else None
    most = f"; largest update ratio {_n(top[0])} ({_esc(top[1].name)})" if top else ""
    term.print(f"[bold green]nothing wrong found:[/bold green] {len(f.ranked)} tensors compared{most}")


def layer_of(name: str) -> str:
    """The layer a tensor belongs to: up to its first numeric component (blocks.3), else its
    first component (wte), else "" for a top-level tensor."""
    m = re.match(r"^(.*?\.\d+)(\.|$)", name)
    if m:
        return m.group(1)
    return name.partition(".")[0] if "." in name else ""


WIDE = 120  # terminal columns from which the table adds cos, same and the largest change


def _table(f: DiffFindings, show_all: bool, width: int):
    from rich.table import Table

    pair = f.b is not None
    wide = width >= WIDE
    t = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    cols = ["tensor", "shape", "flags"]
    if pair:
        cols += ["|B-A|/|A|", "max|w| A→B"] + (["cos", "same", "largest change"] if wide else []) + ["NaN/Inf"]
    else:
        cols += ["dtype", "max|w|"] + (["mean", "std", "zeros"] if wide else []) + ["NaN/Inf"]
    for c in cols:
        t.add_column(
            c,
            justify="left" if c in ("tensor", "flags", "dtype", "largest change") else "right",
            no_wrap=c in ("tensor", "max|w| A→B", "largest change"),
        )
    rows = _rows_to_show(f, show_all)
    current = None
    for x in sorted(rows, key=lambda r: r.order):
        layer = layer_of(x.name)
        if layer != current:
            current = layer
            if layer:
                t.add_row(f"[bold]{_esc(layer)}[/bold]")
        label = x.name[len(layer) + 1 :] if layer and x.name.startswith(layer + ".") else x.name
        label = ("  " if layer else "") + _esc(label) + (f" [dim](= {_esc(', '.join(x.tied))})[/dim]" if x.tied else "")
        style = TIER_STYLE.get(x.tier, "")
        flags = ",".join(x.flags)
        cells = [label, "x".join(map(str, x.shape)) or "scalar", f"[{style}]{flags}[/{style}]" if style else flags]
        t.add_row(*cells, *(_pair_cells(x, wide) if pair else _single_cells(x, wide)))
    hidden = len(f.ranked) - len(rows)
    if hidden:
        t.caption = f"{hidden} more tensors not shown (--all shows every one)"
    return t


def _rows_to_show(f: DiffFindings, show_all: bool) -> list[TensorFinding]:
    if show_all or len(f.ranked) <= DEFAULT_ROWS:
        return f.ranked
    flagged_layers = {layer_of(x.name) for x in f.ranked if x.tier < UNFLAGGED}
    keep = {id(x) for x in f.ranked if layer_of(x.name) in flagged_layers and x.tier < UNFLAGGED}
    keep |= {id(x) for x in f.ranked[: len(keep) + TOP_UNFLAGGED]}
    return [x for x in f.ranked if id(x) in keep]


def _pair_cells(x: TensorFinding, wide: bool) -> list[str]:
    d, a, b = x.delta, x.a, x.b
    assert d is not None and b is not None  # every finding of a pair diff has its B side
    cells = [_n(d.rel_change), f"{_n(a.absmax)}→{_n(b.absmax)}"]
    if wide:
        where = ""
        if d.max_index is not None and math.isfinite(d.max_change):
            where = f"{_n(d.max_change)} at [{','.join(map(str, d.max_index))}]"
        cells += [_cos(d.cosine), f"{d.unchanged:.0%}" if math.isfinite(d.unchanged) else "", where]
    return cells + [f"[red]{b.nonfinite}[/red]" if b.nonfinite else "0"]


def _single_cells(x: TensorFinding, wide: bool) -> list[str]:
    a = x.a
    cells = [x.dtype_a, _n(a.absmax)]
    if wide:
        cells += [_n(a.mean), _n(a.std), f"{a.zeros / a.numel:.0%}" if a.numel else ""]
    return cells + [f"[red]{a.nonfinite}[/red]" if a.nonfinite else "0"]


def _cos(c: float) -> str:
    if not math.isfinite(c):
        return "—"
    if c > 0.9999:  # 1 - cos says more than 0.99999...
        return f"1-{_n(1 - c)}" if c < 1 else "1"
    return f"{c:.4f}"


# --- histogram ------------------------------------------------------------------------------------


def bin_range(i: int) -> tuple[float, float]:
    """The values a HIST_EDGES bin holds, from the end nearer zero to the far end."""
    mid = len(HIST_EDGES) // 2  # 80: the bin of zero
    lo, hi = HIST_EDGES[i], HIST_EDGES[i + 1]
    if i >= mid:
        return (0.0 if i == mid else 10 ** (lo - DECADES), 10 ** (hi - DECADES))
    return (-(10 ** (-hi - DECADES)), -(10 ** (-lo - DECADES)))


def _histogram(x: TensorFinding, term, *, pair: bool) -> None:
    ha = x.hist_a
    assert ha is not None  # diff bins every tensor it compares
    hb = x.hist_b if pair else None
    both = ha + (hb if hb is not None else 0)
    present = np.flatnonzero(both)
    legend = " in A ([blue]█[/blue]) and B ([red]█[/red])" if pair else ""
    term.print(f"\n[bold]values of {_esc(x.name)}[/bold]{legend} [dim](log-scale bins, 4 per decade)[/dim]")
    if not len(present):
        term.print("  no finite values")
    peak = max(int(ha.max()), int(hb.max()) if hb is not None else 0)
    i = present[0] if len(present) else 0
    while len(present) and i <= present[-1]:
        if both[i] == 0:  # a run of empty bins (e.g. between a bulk and an exploded tail): one line
            run = int(np.flatnonzero(both[i:])[0])
            if run >= 3:
                term.print(
                    f"  [dim]{'⋮':>19} {run} empty bins ({_n(bin_range(i)[0]) or 0}..{_n(bin_range(i + run - 1)[1])})[/dim]"
                )
                i += run
                continue
        near, far = bin_range(i)
        label = f"{_n(near)}..{_n(far)}" if near else f"|v|<{_n(far)}"
        line = f"  {label:>19} [blue]{_bar(ha[i], peak)}[/blue] {ha[i]:>9}"
        if hb is not None:
            line += f"  [red]{_bar(hb[i], peak)}[/red] {hb[i]:>9}"
        term.print(line)
        i += 1
    for side, st in (("A", x.a), ("B", x.b)):
        if st is not None and st.nonfinite:
            term.print(f"  [red]{side}: {st.nan} NaN, {st.posinf} +Inf, {st.neginf} -Inf (not binned)[/red]")


def _bar(count: int, peak: int) -> str:
    if count == 0:
        return " " * BAR
    n = max(1, round(BAR * count / peak))  # a lone element still shows
    return ("█" * n).ljust(BAR)


def _unmatched(f: DiffFindings, term) -> None:
    for label, names in (("missing from B", f.missing), ("only in B", f.unexpected)):
        if names:
            shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
            term.print(f"[yellow]{label}:[/yellow] {_esc(shown)}")
    for m in f.mismatched[:8]:
        term.print(
            f"[yellow]shape changed, not compared:[/yellow] {_esc(m.name)} {m.shape_a} {m.dtype_a} -> {m.shape_b} {m.dtype_b}"
        )
    if len(f.mismatched) > 8:
        term.print(f"[yellow]... {len(f.mismatched) - 8} more shape changes (--json lists all)[/yellow]")


# --- plot -------------------------------------------------------------------------------------------


def plot(f: DiffFindings, path, *, names: list[str]) -> None:
    """Overlaid A/B histograms of the given tensors (matplotlib, the `plot` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CkptlabError("--plot needs matplotlib", hint=install_hint("plot", "matplotlib")) from None
    picked = [x for x in (f.finding(n) for n in names) if x is not None]
    if not picked:
        raise CkptlabError("--plot: nothing to plot")
    fig, axes = plt.subplots(len(picked), 1, figsize=(9, 2.6 * len(picked)), squeeze=False)
    centers = (HIST_EDGES[:-1] + HIST_EDGES[1:]) / 2
    for ax, x in zip(axes[:, 0], picked):
        assert x.hist_a is not None  # diff bins every tensor it compares
        for hist, label, color in ((x.hist_a, f"A {f.a}", "tab:blue"), (x.hist_b, f"B {f.b}", "tab:red")):
            if hist is not None:
                ax.step(centers, hist, where="mid", label=label, color=color)
        ax.set_yscale("symlog")
        present = np.flatnonzero((x.hist_a + (x.hist_b if x.hist_b is not None else 0)) > 0)
        lo, hi = (
            (HIST_EDGES[max(present[0] - 4, 0)], HIST_EDGES[min(present[-1] + 5, len(HIST_EDGES) - 1)])
            if len(present)
            else (-1, 1)
        )
        ax.set_xlim(lo, hi)
        ticks = np.arange(math.ceil(lo), math.floor(hi) + 1, 1 if hi - lo <= 12 else 4)  # x is symlog: 1 = a decade
        ax.set_xticks(ticks, [_tick(t) for t in ticks], fontsize=7)
        ax.set_title(f"{x.name}  [{', '.join(x.flags) or 'ok'}]", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _tick(s: float) -> str:
    if s == 0:
        return "0"
    return f"{'-' if s < 0 else ''}1e{int(abs(s) - DECADES)}"


def _n(x: float | None) -> str:
    return "" if x is None or x != x else short_number(x)


def _esc(text) -> str:

    return safe(str(text))
