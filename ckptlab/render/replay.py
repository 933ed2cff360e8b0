"""Terminal rendering of a ReplayReport: verdict first, then the evidence."""

from __future__ import annotations

import math

from rich.table import Table

from ckptlab.numbers import LOSS_NOT_KNOWN, human_bytes, ranges, short_number, value
from ckptlab.render.text import safe
from ckptlab.replayer.counterfactuals import NOT_RUN
from ckptlab.replayer.findings import place


def render(r, term) -> None:
    """The verdict, then one labelled line (or table) per piece of evidence, in the order a
    reader checks them: how replay went, where the fault began, its origin, the blamed rows and
    parameters, the counterfactuals and the deeper searches."""
    colour = "red" if r.reproduced else ("yellow" if r.fault_recorded else "green")
    term.paragraph(f"[bold {colour}]{safe(r.verdict)}[/]")
    term.print()
    _replayed(r, term)
    _bits(r, term)
    if r.start_state:
        st = r.start_state
        bad = "; ".join(
            f"{safe(b['parameter'])}: {b['count']} non-finite"
            + (f" ({'row' if len(b['rows']) == 1 else 'rows'} {ranges(b['rows'])})" if b["rows"] else "")
            for b in st["nonfinite"]
        )
        since = f"; in the record since step {st['first_recorded']}" if st.get("first_recorded") is not None else ""
        users = ", ".join(
            f"{place(u['row'], u.get('micro_batch'))} (sample {safe(u['sample_id'])})" for u in st["used_by"]
        )
        term.field(
            "state",
            f"[yellow]already bad[/yellow] in checkpoint {st['checkpoint']}: {bad}{since}"
            + (f"; first used by {users}" if users else ""),
        )
    _root_step(r, term)
    d = r.divergence or r.run_to_run
    if d is not None:
        verdict = "[yellow]differ[/yellow]" if not d.replays_agree else "[green]agree[/green] with each other"
        term.field("twice", f"step {d.step} replayed twice, {d.ops_compared} ops hashed: {verdict}; {safe(d.detail)}")
    n = r.noise_check
    if n is not None:
        how = "[green]robust[/green]" if n.robust else "[yellow]only through the noise[/yellow]"
        term.field(
            "noise",
            f"step {n.step} from its state, as is and with parameters moved one ulp: faults in {n.faulted}/{n.replays} "
            f"({', '.join(n.perturbations)}): {how}",
        )
    if r.origin.kind != "none":
        _origin(r.origin, term)
    if r.chain:
        term.field("op chain", safe(_chain(r.chain)))
    if r.samples:
        _samples(r.samples, term)
    if r.parameters:
        _parameters(r, term)
    if r.nonfinite_buffers:
        bad = ", ".join(f"{safe(b['buffer'])} ({b['count']} non-finite)" for b in r.nonfinite_buffers)
        term.field("buffers", f"[yellow]left non-finite[/yellow] by step {r.root_step}: {bad}")
    for c in r.counterfactuals:
        if c.fault is None and c.detail.startswith(NOT_RUN):
            continue  # (the "not run" line names it, with the error)
        mark = "[red]fault[/red]" if c.fault else ("[green]no fault[/green]" if c.fault is False else "n/a")
        term.field("evidence", f"{safe(c.question)} {mark}: {safe(c.detail)}")
    _searches(r, term)
    for f in r.failed_experiments:
        at = f" at {safe(f['source'])}" if f.get("source") else ""
        term.field("not run", f"{safe(f['experiment'])}: [yellow]the step raised[/yellow] {safe(f['error'])}{at}")
    _written(r, term)


def _written(r, term) -> None:
    """What --dump and --profile found and wrote."""
    if r.dump is not None:
        render_dump_line(r.dump, term)
    if r.profile is not None:
        render_profile(r.profile, term)


def _replayed(r, term) -> None:
    """Which steps ran, how, and whether they matched the record."""
    matched = sum(1 for c in r.steps if c.match)
    det = (
        f"[green]bit-exact[/green]: {matched}/{len(r.steps)} replayed steps match the record"
        if r.deterministic
        else _equivalent(r)
        if r.agreement == "equivalent" and r.deviation
        else _beyond(r.diverged_at)
        if r.diverged_at
        else _diverged(r.first_divergence)
    )
    how = " compiled" if r.compiled else (" eagerly (recorded compiled)" if r.recorded_compiled else "")
    term.field(
        "replayed", f"steps {r.start_checkpoint}..{r.requested_step}{how} from checkpoint {r.start_checkpoint}; {det}"
    )


def _equivalent(r) -> str:
    """Numerically equivalent: how far from bit-exact, and where the deviation grows."""
    d = r.deviation
    at = d.get("max_at") or {}
    grows = f", beyond one rounding from step {d['grows_from']}" if d.get("grows_from") is not None else ""
    return (
        f"[green]equivalent[/green], not bit-exact: {d['bit_exact_steps']}/{d['steps']} steps before the fault match "
        f"bit for bit; largest relative deviation {short_number(r.max_rel_deviation or 0.0)} "
        f"({at.get('value')} at step {at.get('step')}){grows}, within {d['dtype']} round-off"
    )


def _beyond(d: dict) -> str:
    """Diverged: the first value beyond round-off, to full precision."""
    return (
        f"[yellow]diverged[/yellow] at step {d['step']}: {d['value']} {d['replayed']!r} vs recorded "
        f"{d['recorded']!r} (relative deviation {short_number(d['rel_deviation'])}, beyond round-off "
        f"{short_number(d['tolerance'])})"
    )


def _bits(r, term) -> None:
    """Why the bits differ (what differs from the recording machine among them)."""
    for reason in r.bits_differ:
        term.field("bits differ", safe(reason))


def _diverged(d: dict) -> str:
    scale = (
        f", grad scale {value(d['grad_scale'])} vs {value(d['recorded_grad_scale'])}"
        if d.get("grad_scale") != d.get("recorded_grad_scale")
        else ""
    )
    what = (
        f"loss {_loss(d['loss'])} vs recorded {_loss(d['recorded_loss'])}"
        if d.get("loss") != d.get("recorded_loss")
        else f"grad norm {d['grad_norm']!r} vs recorded {d['recorded_grad_norm']!r}"
    )
    return f"[yellow]diverged[/yellow] at step {d['step']}: {what}{scale}"


def _loss(x) -> str:
    """A loss to full precision; one the step did not return, as not known."""
    return LOSS_NOT_KNOWN if x is None else repr(x)


def _root_step(r, term) -> None:
    if r.root_step is not None and r.reproduced:
        term.field(
            "root step",
            f"{r.root_step}"
            + (f" (symptom at {r.requested_step})" if r.root_step != r.requested_step else "")
            + f": {', '.join(next((c.anomalies for c in r.steps if c.step == r.root_step), []))}",
        )
    elif r.root_step is not None:
        left = (
            f"; replay first leaves the record at step {r.left_record_step}" if r.left_record_step is not None else ""
        )
        term.field("root step", f"{r.root_step} as recorded (it did not reproduce{left})")


def _origin(o, term) -> None:
    where = " ".join(
        x
        for x in (
            f"module [bold]{safe(o.module or '<root>')}[/bold]" if o.module is not None else "",
            f"op [bold]{safe(o.op)}[/bold]" if o.op else "",
            f"at {safe(o.source)}" + (f" in {safe(o.call)}" if o.call and o.kind == "exception" else "")
            if o.source
            else "",
            f"parameter [bold]{safe(o.parameter)}[/bold]" if o.parameter else "",
        )
        if x
    )
    dtype = f" in {o.dtype}" if o.dtype and o.dtype != "float32" else ""
    phase = f" ({o.phase}{dtype})" if o.phase or dtype else ""
    term.field("origin", f"[bold]{o.kind}[/bold]{phase} {where}")
    if o.detail:
        term.field("", safe(o.detail))


CHAIN_SHOWN = 6  # links of the op chain on the terminal; --json lists them all


def _chain(chain: list[dict]) -> str:
    """The op chain in a few lines: its first links, then how many more (`--json` has them)."""
    shown = chain if len(chain) <= CHAIN_SHOWN + 1 else chain[:CHAIN_SHOWN]
    more = f" -> ... {len(chain) - len(shown)} more (--json lists them)" if len(shown) < len(chain) else ""
    return " -> ".join(_chain_link(c) for c in shown) + more


def _chain_link(c: dict) -> str:
    """One op of the chain: `module:op` (`<root>` the model itself, `<step_fn>` outside it)."""
    module = (c["module"] or "<root>") if c["module"] is not None else "<step_fn>"
    return f"{module}:{c['op'].removeprefix('aten.').removesuffix('.default')}"


def _samples(samples, term) -> None:
    t = Table(title="blamed rows", title_justify="left", show_edge=False)
    micro = any(s.micro_batch is not None for s in samples)  # gradient accumulation
    for col in ("micro-batch", "row", "sample_id", "loss", "grad norm", "why")[0 if micro else 1 :]:
        t.add_column(col)
    for s in samples[:16]:
        cells = (str(s.row), safe(str(s.sample_id)), value(s.loss), value(s.grad_norm), safe(s.reason))
        t.add_row(*((str(s.micro_batch),) if micro else ()), *cells)
    term.print(t)


def _parameters(r, term) -> None:
    nonfinite = [p for p in r.parameters if p.grad_norm is not None and not math.isfinite(p.grad_norm)]
    if len(nonfinite) > 5 and r.origin.kind in ("data", "numeric") and r.origin.phase == "forward":
        # A NaN from the forward pass poisons every gradient: the list says nothing more.
        term.field(
            "parameters",
            f"{len(nonfinite)} got non-finite gradients (the forward NaN reaches them all), "
            f"e.g. {safe(', '.join(p.name for p in nonfinite[:3]))}",
        )
        return
    t = Table(title="parameters", title_justify="left", show_edge=False)
    t.add_column("parameter", no_wrap=True)
    for col in ("grad norm", "typical", "update ratio", "why"):
        t.add_column(col)
    for p in r.parameters[:8]:
        t.add_row(safe(p.name), value(p.grad_norm), value(p.typical_grad_norm), value(p.update_ratio), safe(p.reason))
    if len(r.parameters) > 8:
        t.add_row(f"... {len(r.parameters) - 8} more", "", "", "", "")
    term.print(t)


def _searches(r, term) -> None:
    """The deeper searches (replayer/search.py): culprit, rewind, and the budget they used."""
    c = r.culprit
    if c is not None:
        term.field(
            "culprit",
            f"{safe(c.detail)}"
            + ("" if c.minimal else " [yellow](not minimal: the budget ran out)[/yellow]")
            + (f"; cause: [bold]{c.cause}[/bold]" if c.cause else ""),
        )
    w = r.rewind
    if w is not None:
        where = f"steps {w.searched[0]}..{w.searched[1]} searched" if w.searched else "not searched"
        term.field(
            "rewind",
            f"{where}: {safe(w.detail) or 'no answer'}"
            + ("" if w.complete else " [yellow](the budget ran out)[/yellow]"),
        )
    if r.budget:
        ran_out = f"; ran out: {', '.join(r.budget['ran_out'])}" if r.budget["ran_out"] else ""
        term.field("budget", f"{r.budget['used']}/{r.budget['replays']} extra replays{ran_out}")


def render_dump_line(d, term) -> None:
    """What `--dump` wrote, in a line or three (the whole index: `ckptlab show FILE`)."""
    left = (
        f"; {len(d.omitted)} left out ({human_bytes(sum(o['bytes'] for o in d.omitted))}, over --dump-max-bytes "
        f"{d.max_bytes}; `ckptlab show` lists them)"
        if d.omitted
        else ""
    )
    term.field(
        "dump",
        f"[bold]{safe(d.path)}[/bold]: {d.datasets} tensors, {human_bytes(d.data_bytes)} "
        f"({human_bytes(d.file_bytes)} on disk){left}",
    )
    for line in d.origin_came_from[:2]:
        term.field("", f"origin {safe(line)}")


def render_profile(p, term) -> None:
    """`--profile`: its verdict, the times, the slowest modules and ops, the trace."""
    colour = {True: "yellow", False: "green", None: "default"}[p.came_back]
    term.field("profile", f"[{colour}]{safe(p.verdict)}[/]")
    recorded = f"{p.recorded_step_time:.3g} s" if p.recorded_step_time is not None else "not recorded"
    term.field("", f"replayed {p.replayed_s:.3g} s (median of {p.repeats}) against step_time {recorded} when recorded")
    mods = ", ".join(f"{safe(m['module'] or '(root)')} {m['self_s']:.3g} s" for m in p.top_modules[:3])
    if mods:
        term.field("", f"modules: {mods}")
    for op in p.top_ops[:3]:
        at = f" at {safe(op['source'])}" if op.get("source") else ""
        term.field(
            "", f"{safe(op['op'])} {op['self_s']:.3g} s in {op['calls']} call{'s' if op['calls'] != 1 else ''}{at}"
        )
    term.field("", f"Chrome trace: [bold]{safe(p.trace)}[/bold] (chrome://tracing, ui.perfetto.dev)")
