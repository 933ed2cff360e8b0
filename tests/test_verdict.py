"""`verdict()` says one line for every report a replay can make, and never raises."""

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptlab.replayer.findings import (
    Counterfactual,
    Culprit,
    EarlierCause,
    NoiseCheck,
    Origin,
    ReplayReport,
    SampleBlame,
    StepCheck,
)
from ckptlab.replayer.verdict import verdict

maybe = st.none

# Reasons as blame.py writes them (the verdict looks for some of these words), and anything else.
REASONS = st.one_of(
    st.sampled_from(
        [
            "",
            "2 non-finite value(s) in batch['x']",
            "batch['ids'] is empty (all padding, id 0)",
            "batch['y'] is empty (every target is -100, the ignore_index); 1 non-finite value(s) first appear",
            "batch['ids'] has token ids outside [0, 64)",
            "batch['x'] reaches |x|=3e+38, 1e+38x the run's typical 3",
            "its gradient norm is infx the median row's",
            "alone through the step, its loss is nan and gradient norm 0 (the other rows' are finite)",
            "is empty",
            "outside [",
            ";",
            "; ;",
        ]
    ),
    st.text(max_size=40),
)
FLOATS = st.one_of(maybe(), st.floats(allow_nan=True, allow_infinity=True))
NAMES = st.one_of(
    maybe(), st.sampled_from(["", "blocks.0.attn", "fc1.weight", "aten._softmax.default"]), st.text(max_size=12)
)

origins = st.builds(
    Origin,
    kind=st.sampled_from(["none", "data", "numeric", "optimizer", "precision", "exception"]),
    phase=st.one_of(maybe(), st.sampled_from(["forward", "backward", "optimizer"])),
    module=NAMES,
    op=NAMES,
    parameter=NAMES,
    source=st.one_of(maybe(), st.just("model.py:40")),
    call=NAMES,
    produced=st.one_of(maybe(), st.sampled_from(["NaN", "Inf"])),
    inputs_finite=st.one_of(maybe(), st.booleans()),
    detail=st.one_of(maybe(), st.text(max_size=30)),
    dtype=st.one_of(maybe(), st.sampled_from(["float16", "bfloat16", "float32"])),
    state=st.one_of(maybe(), st.just("exp_avg_sq")),
)
samples = st.builds(
    SampleBlame,
    row=st.integers(0, 10_000),
    sample_id=st.one_of(maybe(), st.integers(), st.text(max_size=12)),
    reason=REASONS,
    loss=FLOATS,
    grad_norm=FLOATS,
)
counterfactuals = st.builds(
    Counterfactual, question=st.text(max_size=20), fault=st.one_of(maybe(), st.booleans()), detail=st.text(max_size=20)
)
checks = st.builds(
    StepCheck,
    step=st.integers(0, 10**6),
    loss=st.floats(allow_nan=True, allow_infinity=True),
    recorded_loss=FLOATS,
    grad_norm=st.floats(allow_nan=True, allow_infinity=True),
    recorded_grad_norm=FLOATS,
    match=st.booleans(),
    error=st.one_of(maybe(), st.just("IndexError: index out of range in self")),
)
divergences = st.one_of(
    maybe(),
    st.fixed_dictionaries(
        {"step": st.integers(0, 10**6)},
        optional={"loss": FLOATS, "recorded_loss": FLOATS, "abs_diff": FLOATS},
    ),
)
ROWS = st.lists(st.integers(0, 10_000), max_size=5)
culprits = st.builds(
    Culprit,
    rows=ROWS,
    sample_ids=st.lists(st.one_of(maybe(), st.integers(), st.text(max_size=8)), max_size=5),
    minimal=st.booleans(),
    fields=st.lists(st.sampled_from(["['ids']", "[0]", ".x", ""]), max_size=3),
    positions=st.one_of(maybe(), st.lists(st.integers(0, 4096), max_size=6, unique=True).map(sorted)),
    transplant_step=st.one_of(maybe(), st.integers(0, 10**6)),
    transplant_fault=st.one_of(maybe(), st.booleans()),
    cause=st.one_of(maybe(), st.sampled_from(["data alone", "data x model state", "data x batch", "other"])),
    detail=st.text(max_size=20),
)
rewinds = st.builds(
    EarlierCause,
    searched=st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)).map(list),
    step=st.one_of(maybe(), st.integers(0, 10**6)),
    rows=ROWS,
    sample_ids=st.lists(st.integers(), max_size=5),
    complete=st.booleans(),
    detail=st.text(max_size=30),
)
noise_checks = st.builds(
    NoiseCheck,
    step=st.integers(0, 10**6),
    replays=st.just(4),
    faulted=st.integers(0, 4),
    robust=st.booleans(),
    perturbations=st.lists(st.sampled_from(["as is: fault", "down: healthy"]), max_size=4),
)
beyond = st.fixed_dictionaries(
    {
        "step": st.integers(0, 10**6),
        "value": st.sampled_from(["loss", "grad_norm"]),
        "replayed": FLOATS,
        "recorded": FLOATS,
        "rel_deviation": FLOATS,
        "tolerance": FLOATS,
    }
)
budgets = st.one_of(
    maybe(),
    st.fixed_dictionaries(
        {
            "replays": st.integers(0, 100),
            "used": st.integers(0, 100),
            "ran_out": st.lists(st.sampled_from(["culprit", "transplant", "rewind"]), max_size=3, unique=True),
        }
    ),
)
reports = st.builds(
    ReplayReport,
    run=st.just("run"),
    requested_step=st.integers(0, 10**6),
    root_step=st.one_of(maybe(), st.integers(0, 10**6)),
    start_checkpoint=st.integers(0, 10**6),
    fault_recorded=st.booleans(),
    reproduced=st.booleans(),
    deterministic=st.booleans(),
    first_divergence=divergences,
    origin=origins,
    samples=st.lists(samples, max_size=5),
    parameters=st.just([]),
    chain=st.just([]),
    counterfactuals=st.lists(counterfactuals, max_size=3),
    steps=st.lists(checks, max_size=3),
    verdict=st.just(""),
    rank=st.one_of(maybe(), st.integers(0, 1024)),
    culprit=st.one_of(maybe(), culprits),
    rewind=st.one_of(maybe(), rewinds),
    budget=budgets,
    recorded_error=st.one_of(maybe(), st.sampled_from(["OSError: gone", "RuntimeError: expected 4 rows"])),
    agreement=st.one_of(maybe(), st.sampled_from(["bit-exact", "equivalent", "diverged"])),
    max_rel_deviation=st.one_of(maybe(), st.floats(0, 1)),
    diverged_at=st.one_of(maybe(), beyond),
    bits_differ=st.lists(
        st.sampled_from(["nondeterministic kernels: a\nb", "recorded in another environment"]), max_size=2
    ),
    noise_check=st.one_of(maybe(), noise_checks),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reports)
def test_verdict_is_one_nonempty_line_for_every_report(report):
    v = verdict(report)
    assert isinstance(v, str) and v.strip()
    assert len(v.splitlines()) == 1, v
    assert v.startswith(("Step ", "The fault did not reproduce", "The crash did not reproduce", "The fault of step")), v


def test_verdict_of_a_reproduced_fault_with_no_rows_and_no_op_says_so():
    nan = math.nan
    r = ReplayReport(
        "run", 5, 5, 0, True, True, True, None, Origin("data", None, None, None, None, None), [], [], [], [], [], ""
    )
    assert verdict(r).startswith("Step 5:")
    r.samples = [SampleBlame(1, 101, "", nan, nan)]
    assert "row 1 (sample 101)" in verdict(r)
