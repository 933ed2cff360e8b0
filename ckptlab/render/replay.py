"""Terminal rendering of a ReplayReport: verdict first, then the evidence."""

from __future__ import annotations

import math

from rich.table import Table

from ckptlab.render.text import human_bytes, safe


def _num(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}" if math.isfinite(x) else str(x)
    return str(x)


def render(r, term) -> None:
    colour = "red" if r.reproduced else ("yellow" if r.fault_recorded else "green")
    term.print(f"[bold {colour}]{safe(r.verdict)}[/]")
    term.print()
    matched = sum(1 for c in r.steps if c.match)
    det = (
        f"[green]bit-exact[/green]: {matched}/{len(r.steps)} replayed steps match the record"
        if r.deterministic
        else f"[yellow]diverged[/yellow] at step {r.first_divergence['step']}: loss {_num(r.first_divergence['loss'])} "
        f"vs recorded {_num(r.first_divergence['recorded_loss'])}"
        + (
            f", grad scale {_num(r.first_divergence['grad_scale'])} vs {_num(r.first_divergence['recorded_grad_scale'])}"
            if r.first_divergence.get("grad_scale") != r.first_divergence.get("recorded_grad_scale")
            else ""
        )
    )
    how = " compiled" if r.compiled else (" eagerly (recorded compiled)" if r.recorded_compiled else "")
    term.print(
        f"replayed   steps {r.start_checkpoint}..{r.requested_step}{how} from checkpoint {r.start_checkpoint}; {det}"
    )
    if r.root_step is not None and r.reproduced:
        term.print(
            f"root step  {r.root_step}"
            + (f" (symptom at {r.requested_step})" if r.root_step != r.requested_step else "")
            + f": {', '.join(next((c.anomalies for c in r.steps if c.step == r.root_step), []))}"
        )
    elif r.root_step is not None:
        left = (
            f"; replay first leaves the record at step {r.left_record_step}" if r.left_record_step is not None else ""
        )
        term.print(f"root step  {r.root_step} as recorded (it did not reproduce{left})")
    if r.divergence is not None:
        d = r.divergence
        verdict = "[yellow]differ[/yellow]" if not d.replays_agree else "[green]agree[/green] with each other"
        term.print(f"twice      step {d.step} replayed twice, {d.ops_compared} ops hashed: {verdict}; {safe(d.detail)}")
    o = r.origin
    if o.kind != "none":
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
        term.print(f"origin     [bold]{o.kind}[/bold]{phase} {where}")
        if o.detail:
            term.print(f"           {safe(o.detail)}")
    if r.chain:
        term.print(
            "op chain   "
            + " -> ".join(
                safe(
                    f"{c['module'] or '<root>' if c['module'] is not None else '<step_fn>'}:{c['op'].removeprefix('aten.')}"
                )
                for c in r.chain
            )
        )
    if r.samples:
        t = Table(title="blamed rows", title_justify="left", show_edge=False)
        micro = any(s.micro_batch is not None for s in r.samples)  # gradient accumulation
        for col in ("micro-batch", "row", "sample_id", "loss", "grad norm", "why")[0 if micro else 1 :]:
            t.add_column(col)
        for s in r.samples[:16]:
            cells = (str(s.row), safe(str(s.sample_id)), _num(s.loss), _num(s.grad_norm), safe(s.reason))
            t.add_row(*((str(s.micro_batch),) if micro else ()), *cells)
        term.print(t)
    if r.parameters:
        nonfinite = [p for p in r.parameters if p.grad_norm is not None and not math.isfinite(p.grad_norm)]
        if len(nonfinite) > 5 and o.kind in ("data", "numeric") and o.phase == "forward":
            # A NaN from the forward pass poisons every gradient: the list says nothing more.
            term.print(
                f"parameters {len(nonfinite)} got non-finite gradients (the forward NaN reaches them all), "
                f"e.g. {safe(', '.join(p.name for p in nonfinite[:3]))}"
            )
        else:
            t = Table(title="parameters", title_justify="left", show_edge=False)
            t.add_column("parameter", no_wrap=True)
            for col in ("grad norm", "typical", "update ratio", "why"):
                t.add_column(col)
            for p in r.parameters[:8]:
                t.add_row(
                    safe(p.name), _num(p.grad_norm), _num(p.typical_grad_norm), _num(p.update_ratio), safe(p.reason)
                )
            if len(r.parameters) > 8:
                t.add_row(f"... {len(r.parameters) - 8} more", "", "", "", "")
            term.print(t)
    for c in r.counterfactuals:
        mark = "[red]fault[/red]" if c.fault else ("[green]no fault[/green]" if c.fault is False else "n/a")
        term.print(f"evidence   {safe(c.question)} {mark}: {safe(c.detail)}")
    c = r.culprit
    if c is not None:
        term.print(
            f"culprit    {safe(c.detail)}"
            + ("" if c.minimal else " [yellow](not minimal: the budget ran out)[/yellow]")
            + (f"; cause: [bold]{c.cause}[/bold]" if c.cause else "")
        )
    w = r.rewind
    if w is not None:
        first, last = w.searched
        term.print(
            f"rewind     steps {first}..{last} searched: {safe(w.detail) or 'no answer'}"
            + ("" if w.complete else " [yellow](the budget ran out)[/yellow]")
        )
    if r.budget:
        ran_out = f"; ran out: {', '.join(r.budget['ran_out'])}" if r.budget["ran_out"] else ""
        term.print(f"budget     {r.budget['used']}/{r.budget['replays']} extra replays{ran_out}")
    if r.dump is not None:
        render_dump_line(r.dump, term)


def render_dump_line(d, term) -> None:
    """What `--dump` wrote, in a line or three (the whole index: `ckptlab show FILE`)."""
    left = (
        f"; {len(d.omitted)} left out ({human_bytes(sum(o['bytes'] for o in d.omitted))}, over --dump-max-bytes "
        f"{d.max_bytes}; `ckptlab show` lists them)"
        if d.omitted
        else ""
    )
    term.print(
        f"dump       [bold]{safe(d.path)}[/bold]: {d.datasets} tensors, {human_bytes(d.data_bytes)} "
        f"({human_bytes(d.file_bytes)} on disk){left}"
    )
    for line in d.origin_came_from[:2]:
        term.print(f"           origin {safe(line)}")
