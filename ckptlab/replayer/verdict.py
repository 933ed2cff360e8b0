"""A replay's conclusion in words: the one place that says what a ReplayReport found.

    report.verdict = verdict(report)   # one line a person can act on

The investigation fills the report's kinds and numbers (findings.py) and then asks this module
for its `verdict`, which the terminal view, `--json` (the `verdict` key) and the HDF5 dump all
carry. It lives in replayer/, not render/, because that string is part of the report itself.

The sentence is chosen top down: a healthy step; a crash or a fault that did not reproduce;
else the origin's kind (a crash, the data, an op's numerics, reduced precision, the optimizer),
followed by the counterfactual proof, the deeper searches and a note when replay diverged.
"""

from __future__ import annotations

from ckptlab.analysis.anomalies import is_record_warning
from ckptlab.numbers import LOSS_NOT_KNOWN, precise, ranges, short_number
from ckptlab.replayer.findings import FIRST_UPDATE, DivergenceCheck, Origin, ReplayReport, place

# A culprit's `cause` (search.py), as the sentence says it.
CAUSES = {
    "data alone": "it faults in another batch and from an older model state too: the data alone",
    "data x model state": "it faults in another batch but not from an older model state: data x this model state",
    "data x batch": "it does not fault without the rest of its batch",
}


def verdict(r: ReplayReport) -> str:
    """One line a person can act on, for any combination of the report's fields (a property
    test, tests/test_verdict.py, holds it to that): user text in it (sample ids, reasons) has
    its line breaks folded into spaces."""
    return " ".join((_start_state(r) + _sentence(r)).split())


def _start_state(r: ReplayReport) -> str:
    """A state already bad when the replay began comes first: it is the cause to fix."""
    st = r.start_state
    if not st:
        return ""
    bad = st["nonfinite"]
    what = ", ".join(
        f"{b['count']} in `{b['parameter']}`"
        + (f" ({'row' if len(b['rows']) == 1 else 'rows'} {ranges(b['rows'])})" if b["rows"] else "")
        for b in bad[:3]
    )
    since = (
        f", non-finite in the record since step {st['first_recorded']}" if st.get("first_recorded") is not None else ""
    )
    users = ", ".join(
        f"{place(u['row'], u.get('micro_batch'))} (sample {u['sample_id']})" for u in st.get("used_by", [])[:4]
    )
    first = f" The first to use it: {users}." if users else ""
    return (
        f"The state was already bad when the replay began: checkpoint {st['checkpoint']} holds non-finite "
        f"weights ({what}{since}); every step that reads them inherits the fault.{first} "
    )


def _sentence(r: ReplayReport) -> str:
    if not r.fault_recorded and r.root_step is None:
        return _healthy(r)
    if r.noise_check is not None and not r.noise_check.robust:
        return _only_through_noise(r)
    if not r.reproduced and r.recorded_error:
        return _crash_not_reproduced(r)
    if not r.reproduced:
        return _fault_not_reproduced(r)
    return _reproduced(r)


def _healthy(r: ReplayReport) -> str:
    """A step healthy when recorded and replayed; a replay that left the record says little,
    and why it left comes with it (the Recorder's own warning, when it gave one)."""
    div = _divergence_step(r)
    head = f"Step {r.requested_step} was healthy when recorded and when replayed from checkpoint {r.start_checkpoint}"
    if r.deterministic or r.agreement == "equivalent" or div is None:
        return head + ": nothing to explain."
    warned = next((n for n in r.notes if is_record_warning(n)), None)
    why = warned or (
        "the state changed outside the recorded computation (code outside step_fn, or an optimizer or state "
        "the checkpoints do not hold)"
    )
    return f"{head}, but the replay left the record at step {div}, so it tells little: {why}."


# --- did not reproduce ----------------------------------------------------------------------------


def _crash_not_reproduced(r: ReplayReport) -> str:
    div = _divergence_step(r)
    last = r.steps[-1] if r.steps else None
    ran = f" (loss {precise(last.loss, LOSS_NOT_KNOWN)})" if last is not None and last.error is None else ""
    det = (
        "every replayed step before it matched the record bit for bit"
        if r.deterministic
        else f"every replayed step before it is numerically equivalent to the record ({_why_bits(r)})"
        if r.agreement == "equivalent"
        else f"replay left the record at step {div}"
        if div is not None
        else "replay did not match the record"
    )
    return (
        f"The crash did not reproduce: step {r.requested_step} raised {r.recorded_error} when recorded, but "
        f"replayed from checkpoint {r.start_checkpoint} it runs{ran}; {det}. Suspect a transient failure "
        "(out of memory, a hardware, I/O or network error, a signal) or code outside step_fn."
    )


def _fault_not_reproduced(r: ReplayReport) -> str:
    div = _divergence_step(r)
    rec = r.steps[-1].recorded_loss if r.steps else None
    got = r.steps[-1].loss if r.steps else None
    where = (
        f"replay is numerically equivalent to the record before it, not bit-exact ({_why_bits(r)})"
        if r.agreement == "equivalent"
        else f"replay matched the record bit for bit until step {div - 1} and diverged at step {div}"
        if div is not None and div > r.start_checkpoint
        else f"replay diverged from the record at its first step, {div}"
        if div is not None
        else "every replayed step before it matched the record bit for bit"
    )
    began = (
        f" (the record shows the fault from step {r.root_step})"
        if r.root_step is not None and r.root_step != r.requested_step
        else ""
    )
    left = f", and first leaves the record at step {r.left_record_step}" if r.left_record_step is not None else ""
    if r.origin.parameter and r.origin.detail:  # what the record itself shows
        left += f"; {r.origin.detail}"
    head = (
        f"The fault did not reproduce{began}: replaying step {r.requested_step} from checkpoint {r.start_checkpoint} "
        f"gives loss {precise(got, LOSS_NOT_KNOWN)} (recorded {precise(rec, LOSS_NOT_KNOWN)}); {where}{left}."
    )
    return head + " " + _why_not_reproduced(r.divergence)


def _why_not_reproduced(d: DivergenceCheck | None) -> str:
    if d is not None and d.first_nondeterministic_op is not None:
        op = d.first_nondeterministic_op
        mod = op.get("module")
        at = (f" in `{mod or '<root>'}`" if mod is not None else "") + (
            f" ({op['source']})" if op.get("source") else ""
        )
        return (
            f"The fault is transient: replaying step {d.step} twice from the same state gives different results; "
            f"the first nondeterministic op is {op.get('op')}{at} ({op.get('phase')}, op {op.get('index')}): "
            "a nondeterministic kernel, or an input the recording does not hold."
        )
    if d is not None and d.replays_agree:
        return (
            f"The fault is transient: two replays of step {d.step} agree op for op, bit for bit, but not with the "
            "record, so the state changed outside the recorded computation (hardware or memory error, or code "
            "outside step_fn)."
        )
    return (
        "Suspect a transient fault: state changed outside the recorded computation (hardware/memory error, "
        "non-determinism, or code outside step_fn)."
    )


# --- reproduced: the cause, its proof, the searches -----------------------------------------------


def _reproduced(r: ReplayReport) -> str:
    s = _cause(r, _lead(r), _rows(r)) + _raised(r) + _buffers(r)
    if r.samples and r.counterfactuals and r.counterfactuals[0].fault is False and r.origin.kind != "exception":
        # (a crash's verdict says it its own way: "Without those rows the step runs")
        s += " Without those rows the step is healthy: skip them and resume from a checkpoint before it."
    s += _searches(r) + _not_run(r)
    return s + _agreement(r)


def _raised(r: ReplayReport) -> str:
    """The exception the fault ended in, when it is not the origin itself: the root step's own
    (it raised once a value went non-finite), or a later step's of the episode."""
    o = r.origin
    if o.raised is not None:
        at = f" at {o.raised['source']}" if o.raised.get("source") else ""
        return f" The step then raised {o.raised['error']}{at}."
    later = next((c for c in r.steps if c.error and r.root_step is not None and c.step > r.root_step), None)
    return f" Step {later.step} then raised {later.error}." if later is not None else ""


def _buffers(r: ReplayReport) -> str:
    """Buffers the root step left non-finite: damage no optimizer step repairs."""
    if not r.nonfinite_buffers:
        return ""
    names = ", ".join(f"`{b['buffer']}`" for b in r.nonfinite_buffers[:3])
    more = f" and {len(r.nonfinite_buffers) - 3} more" if len(r.nonfinite_buffers) > 3 else ""
    return (
        f" It left {names}{more} non-finite: lasting damage that every later step and evaluation read "
        "(restore them from a checkpoint before it)."
    )


def _not_run(r: ReplayReport) -> str:
    """The experiments the user's code refused, with the first error."""
    if not r.failed_experiments:
        return ""
    names = ", ".join(dict.fromkeys(f["experiment"] for f in r.failed_experiments))
    kinds = ", ".join(dict.fromkeys(f["error"].split(":", 1)[0] for f in r.failed_experiments))
    return f" Not run (the step raised {kinds} on them): {names}."


def _agreement(r: ReplayReport) -> str:
    """How the replay agreed with the record, when not bit for bit: equivalent (and why the bits
    differ), or diverged (the first value beyond round-off, to full precision)."""
    if r.deterministic:
        return ""
    if r.agreement == "equivalent":
        return (
            f" The replay is numerically equivalent to the record, not bit-exact "
            f"(largest relative deviation {short_number(r.max_rel_deviation or 0.0)}, within round-off): "
            f"{_why_bits(r)}"
            + ("; the fault survives ulp-level noise, so it is reproduced." if r.noise_check is not None else ".")
        )
    d = r.diverged_at
    if r.agreement == "diverged" and d is not None:
        return (
            f" Note: replay diverged from the record at step {d['step']}: {d['value']} {d['replayed']!r} vs recorded "
            f"{d['recorded']!r}, beyond round-off" + (f" ({_why_bits(r)})." if r.bits_differ else ".")
        )
    div = _divergence_step(r)
    return (
        f" Note: replay diverged from the record at step {div}."
        if div is not None
        else " Note: replay did not match the record bit for bit."
    )


def _why_bits(r: ReplayReport) -> str:
    """Why the bits differ, from agreement.py's `bits_differ`."""
    return "; ".join(r.bits_differ) if r.bits_differ else "the bits differ for a reason ckptlab cannot see"


def _only_through_noise(r: ReplayReport) -> str:
    n = r.noise_check
    assert n is not None
    o = r.origin
    shows = f" It shows as {o.op}{_at(o)} producing {_produced(o)}." if o.op else ""
    return (
        f"The fault of step {n.step} reappeared on replay only through round-off noise, so it is not reproduced: "
        f"the replay is not bit-exact ({_why_bits(r)}), and from the state step {n.step} started in it faults in "
        f"{n.faulted} of {n.replays} replays with every parameter moved by one unit of round-off "
        f"({', '.join(n.perturbations)}). The fault sits at an edge (a value at the edge of overflow): it exists "
        f"only through the last bits, which the record alone has.{shows}"
    )


def _lead(r: ReplayReport) -> str:
    """ "Step 12 on rank 1 (the symptom shows at step 14)": where every reproduced verdict begins."""
    root, o = _root(r), r.origin
    stage = f"pipeline stage {o.stage}" + (f", micro-batch {o.micro_batch}" if o.micro_batch is not None else "")
    return (
        f"Step {root}"
        + (f" on rank {r.rank}" if r.rank is not None and r.processes is None else "")
        + (f" on data-parallel rank {r.rank} (processes {', '.join(map(str, r.processes))})" if r.processes else "")
        + (f" ({stage})" if o.stage is not None else "")
        + (f" (the symptom shows at step {r.requested_step})" if root != r.requested_step else "")
    )


def _rows(r: ReplayReport) -> str:
    """The blamed rows, the first three by name: "row 5 (sample 17), row 9 (sample 3) and 2 more"."""
    who = ", ".join(f"{s.where()} (sample {s.sample_id})" for s in r.samples[:3])
    return who + (f" and {len(r.samples) - 3} more" if len(r.samples) > 3 else "")


def _cause(r: ReplayReport, lead: str, rows: str) -> str:
    o = r.origin
    if o.kind == "exception":
        return _crash(r, lead, rows)
    if o.kind == "data":
        return _data(r, lead, rows)
    if o.kind == "numeric" and o.op is not None:
        return _numeric_op(r, lead, rows)
    if o.kind == "precision" and o.op is not None:
        return _precision(r, lead, rows)
    if o.kind == "optimizer":
        return _optimizer(r, lead)
    if o.kind == "numeric":
        worst = f" (worst: `{o.parameter}`)" if o.parameter else ""
        return f"{lead}: gradients exploded{worst} with no single sample to blame."
    if o.op is not None:  # a kind this sentence does not know yet: say what the trace found
        return f"{lead}: {o.op}{_at(o)} produced {_produced(o)} ({o.kind} fault){_for(r, rows)}."
    suspected = f" ({rows} suspected)" if rows else ""
    return f"{lead}: the fault reproduced but no cause was found{suspected}."


def _crash(r: ReplayReport, lead: str, rows: str) -> str:
    o = r.origin
    error = f"{o.op}: {o.detail}" if o.detail else str(o.op)
    where = ""
    if o.module is not None:
        where += f" in `{o.module or '<root>'}`"
    if o.phase:
        where += f" ({o.phase})"
    if o.source:
        where += f" at {o.source}" + (f" in {o.call}" if o.call else "")
    again = (
        " on replay, as when recorded"
        if r.recorded_error == error
        else f" on replay (recorded: {r.recorded_error})"
        if r.recorded_error
        else " on replay"
    )
    s = f"{lead}: step_fn raised {error}{where}{again}."
    if r.samples:
        why = r.samples[0].reason.split("; ")[0]
        why = why.split(" ", 1)[-1] if why.startswith("batch") else why  # "batch['ids'] has ..." -> "has ..."
        s += f" {rows}: {why}."
        cf = next((c for c in r.counterfactuals if "still raise" in c.question), None)
        if cf is not None and cf.fault is False:
            s += " Without those rows the step runs: skip them and resume from a checkpoint before it."
    return s


def _data(r: ReplayReport, lead: str, rows: str) -> str:
    o = r.origin
    reason = r.samples[0].reason if r.samples else ""
    if not r.samples:
        detail = f" ({o.detail})" if o.detail else ""
        return f"{lead}: the batch is to blame{detail}, but no row was named."
    if o.module is None and o.op is None and "non-finite" in reason:
        return f"{lead}: the batch itself carries non-finite values: {rows}."
    if o.op is not None:
        return f"{lead}: {rows} carries absurd values that make {o.op}{_at(o)} overflow."
    if "alone through the step" in reason:
        return f"{lead}: {rows} alone makes the step non-finite ({reason.split('; ')[0]})."
    what = "carries an absurd value" if "typical" in reason else "dominates the update"
    first = reason.split(";")[0]
    return (
        f"{lead}: {rows} {what}"
        + (f" ({first})" if first.strip() else "")
        + ", so the gradients explode"
        + (f" (worst: `{o.parameter}`)" if o.parameter else "")
        + (
            f" and the weights go non-finite at step {r.requested_step}"
            if _root(r) != r.requested_step and not any(c.error for c in r.steps)
            else ""
        )
        + "."
    )


def _numeric_op(r: ReplayReport, lead: str, rows: str) -> str:
    o = r.origin
    inputs = "finite inputs" if o.inputs_finite else "NaN-free inputs"
    first_reason = r.samples[0].reason.split("; ")[0] if r.samples else ""
    if "is empty" in first_reason or "outside [" in first_reason:  # a fact about one row's data
        s0 = r.samples[0]
        s = (
            f"{lead}: {s0.where()} (sample {s0.sample_id}) {first_reason.split(' ', 1)[-1]}; "
            f"{o.op}{_at(o)} produced {_produced(o)} from {inputs} on it."
        )
    else:
        s = f"{lead}: {o.op}{_at(o)} produced {_produced(o)} from {inputs}{_for(r, rows)}."
    why = next(
        (part for part in (o.detail or "").split("; ") if o.parameter and part.startswith(f"`{o.parameter}` ")),
        None,
    )
    if o.phase == "forward" and why:  # the op's own weights are out of scale: a bad init or load
        s += f" Its weight {why} (a bad initialization or load?)."
    return s


def _precision(r: ReplayReport, lead: str, rows: str) -> str:
    o = r.origin
    remedy = (
        f": with `{o.float32_module}` in float32 the step stays finite, so keep it in float32."
        if o.float32_module
        else ": with the whole model in float32 the step stays finite."
        if o.float32_module == ""
        else " (keep that module in float32, or train in bfloat16)."
    )
    return (
        f"{lead}: {o.op}{_at(o)} overflowed {o.dtype or 'reduced precision'} ({_produced(o)} from finite inputs)"
        f"{_for(r, rows)}; in float32 the same op is finite, so the fault exists only in reduced precision{remedy}"
    )


def _optimizer(r: ReplayReport, lead: str) -> str:
    o = r.origin
    if not o.state:
        named = o.optimizer is not None and not (o.detail or "").startswith("the learning rate of optimizer")
        return (
            f"{lead}: {f'the update of {_whose(o)}' if named else 'the optimizer update'} blew the weights up"
            + (f" ({o.detail})" if o.detail else "")
            + (f", worst in `{o.parameter}`" if o.parameter else "")
            + "; no sample is to blame."
        )
    proven = any("second moment" in c.question and c.fault is False for c in r.counterfactuals)
    first = (o.detail or "").startswith(FIRST_UPDATE)
    owner = _whose(o) if o.optimizer is not None else "the optimizer"
    return (
        (f"{lead}: {owner}'s {o.detail}" if first else f"{lead}: {owner}'s own state blew the weights up")
        + ("" if first else f": {o.detail}" if o.detail else f" ({o.state} of `{o.parameter}`)")
        + "; no sample is to blame"
        + (", and with that second moment in tune with its gradient the fault vanishes" if proven else "")
        + (
            " (remedies: warm the learning rate up for what switches on late, clip updates, a larger eps)."
            if first
            else " (remedies: warm the learning rate up again, clip updates, a larger eps)."
        )
    )


def _whose(o: Origin) -> str:
    """One of several optimizers, as the verdict names it: "optimizer `g` (group 0)"."""
    group = f" (group {o.param_group})" if o.param_group is not None else ""
    return f"optimizer `{o.optimizer}`{group}"


def _searches(r: ReplayReport) -> str:
    """The deeper searches' sentences (search.py), empty when none ran."""
    out = _culprit(r)
    w = r.rewind
    if w is not None and w.detail:
        out += f" {'Doomed earlier' if w.step is not None else 'Searching back'}: {w.detail}."
    p = r.precursor
    if p and p.get("text") and (r.root_step is None or p["step"] < r.root_step):
        found = w is not None and w.step == p["step"]
        out += f" The record saw it coming: {p['text']}" + (" (the step found above)." if found else ".")
    if r.budget and r.budget.get("ran_out"):
        out += f" The {' and '.join(r.budget['ran_out'])} search ran out of its budget ({r.budget['used']} replays)."
    return out


def _culprit(r: ReplayReport) -> str:
    """The minimal culprit, unless it only repeats the blamed rows."""
    c = r.culprit
    if c is None or not c.rows:
        return ""
    same_rows = sorted(map(str, c.sample_ids)) == sorted(str(s.sample_id) for s in r.samples)
    if same_rows and not c.positions and c.cause is None and c.minimal:
        return ""
    mb = c.micro_batches if c.micro_batches and len(c.micro_batches) == len(c.rows) else None
    where = [f"micro-batch {m} row {x}" for m, x in zip(mb, c.rows)] if mb else [f"row {x}" for x in c.rows]
    who = ", ".join(f"{w} (sample {i})" for w, i in zip(where[:3], c.sample_ids[:3]))
    who += f" and {len(c.rows) - 3} more" if len(c.rows) > 3 else ""
    if c.positions:
        plural = "s" if len(c.positions) > 1 else ""
        who += f", position{plural} {ranges(c.positions)} of {', '.join(f'batch{f}' for f in c.fields[:3])}"
    cause = f"; {CAUSES[c.cause]}" if c.cause in CAUSES else ""
    return f" Minimal culprit: {who}{'' if c.minimal else ' (not minimal: out of budget)'}{cause}."


# --- small pieces of the sentences ----------------------------------------------------------------


def _root(r: ReplayReport) -> int:
    return r.root_step if r.root_step is not None else r.requested_step


def _at(o: Origin) -> str:
    """Where the origin op ran: " in `blocks.0.attn` (model.py:40)", or "" outside any module."""
    if o.module is None:
        return ""
    return f" in `{o.module or '<root>'}`" + (f" ({o.source})" if o.source else "")


def _produced(o: Origin) -> str:
    return o.produced or "a non-finite value"


def _for(r: ReplayReport, rows: str) -> str:
    return f" for {rows}" if r.samples else ""


def _divergence_step(r: ReplayReport) -> int | None:
    d = r.first_divergence
    step = d.get("step") if isinstance(d, dict) else None
    return step if isinstance(step, int) else None
