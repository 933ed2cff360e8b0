"""A Lightning Fabric loop in the shape of litgpt's pretrain script (tests/fabric_models.py:
`fabric.setup`, micro-batches under `fabric.no_backward_sync`, `fabric.backward`,
`fabric.clip_gradients`, the learning rate set by hand every iteration) is recorded one optimizer
step a step with ckptlab.integrations.fabric, and `ckptlab replay` re-runs it bit for bit. Every
name it gives a parameter or module is the model's own (`transformer.h.0.attn.qkv.weight`),
never Fabric's `_forward_module.`: in the record, the replay's blame and `ckptlab diff RUN@S`."""

import pytest

pytest.importorskip("lightning.fabric")

import torch  # noqa: E402

import ckptlab  # noqa: E402
from ckptlab.errors import RecordError, ReplayError  # noqa: E402
from ckptlab.integrations import fabric as ckf  # noqa: E402
from tests import fabric_models as fm  # noqa: E402

OWN_NAMES = [n for n, _ in fm.GPT().named_parameters()]  # the model's own, unwrapped
OWN_MODULES = {n for n, _ in fm.GPT().named_modules()}


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fabric-nan") / "run"
    with pytest.raises(ckptlab.NonFiniteLoss) as e:
        fm.main(run_dir, nan=True, ckpt_every=3)
    assert e.value.step == fm.FAULT_STEP
    return run_dir


@pytest.fixture(scope="module")
def lr_run(tmp_path_factory):
    """Steps 0..20, step LR_FAULT_STEP's hand-set learning rate x1e4; checkpoints 0, 10, 20."""
    run_dir = tmp_path_factory.mktemp("fabric-lr") / "run"
    fm.main(run_dir, lr_fault=True, max_steps=fm.LR_FAULT_STEP + 3, ckpt_every=10)
    return run_dir


def test_records_one_step_per_optimizer_step_under_the_models_own_names(nan_run):
    run = ckptlab.open_run(nan_run)
    assert run.steps == list(range(fm.FAULT_STEP + 1)) and run.checkpoints == [0, 3]
    batch, ids = run.batch(fm.FAULT_STEP)
    assert set(batch) == {"micro_batches", "micro_rows", "fabric"} and batch["micro_rows"] == [fm.BATCH] * fm.ACCUM
    assert ids[fm.FAULT_MICRO * fm.BATCH + fm.FAULT_ROW] == fm.FAULT_SAMPLE
    # The manifest's parameter list names the health's per-parameter columns; the checkpoints
    # hold the same names.
    assert run.param_names == OWN_NAMES and run.metrics().param_names == OWN_NAMES
    assert sorted(run.checkpoint(3).load_model(verify=False)[0]) == sorted(fm.GPT().state_dict())
    lr = run.metrics().lr[:, 0]  # set by hand before each micro-batch: the last one's is the step's
    assert lr[0] == fm.get_lr(fm.LR, 1, fm.WARMUP_ITERS, 16, fm.MIN_LR) and lr[1] > lr[0]


def test_replay_from_the_cli_is_bit_exact_and_names_the_step_the_sample_and_the_models_own_parameters(nan_run, cli):
    done = cli("replay", "--run", nan_run, "--step", fm.FAULT_STEP, "--from-step", 0, "--json")
    assert done.code == 0, done.err
    assert "_forward_module" not in done.out
    doc = done.json()
    assert doc["root_step"] == fm.FAULT_STEP and doc["reproduced"] and doc["deterministic"] and doc["bit_exact"]
    steps = doc["steps"]
    assert [(s["step"], s["match"]) for s in steps] == [(s, True) for s in range(fm.FAULT_STEP + 1)]
    for s in steps[:-1]:  # the learning rate the loop set, followed: every healthy step to the bit
        assert (s["loss"], s["grad_norm"]) == (s["recorded_loss"], s["recorded_grad_norm"])
    assert doc["origin"]["kind"] == "data" and "enters the model at `transformer.wte`" in doc["origin"]["detail"]
    assert [(s["micro_batch"], s["row"], s["sample_id"]) for s in doc["samples"]] == [
        (fm.FAULT_MICRO, fm.FAULT_ROW, fm.FAULT_SAMPLE)
    ]
    blamed = [p["name"] for p in doc["parameters"]]
    assert blamed and set(blamed) <= set(OWN_NAMES) and "transformer.h.0.attn.qkv.weight" in blamed
    assert doc["counterfactuals"][0]["fault"] is False  # without that row, the step is healthy


def test_a_hand_set_learning_rate_fault_is_named_at_its_step_as_diff_names_the_weights(lr_run, cli):
    """The loop multiplies one step's learning rate (set by hand, outside the body): replay
    gives every step its recorded rate, names that step, the optimizer and a parameter by its
    own name, no sample; `ckptlab diff RUN@10 RUN@20` names the weights alike."""
    done = cli("replay", "--run", lr_run, "--step", fm.LR_FAULT_STEP + 1, "--json")
    assert done.code == 0, done.err
    doc = done.json()
    assert doc["root_step"] == fm.LR_FAULT_STEP and doc["reproduced"] and doc["bit_exact"]
    assert all(s["match"] for s in doc["steps"]) and doc["steps"][0]["step"] == 10
    assert doc["origin"]["kind"] == "optimizer" and doc["samples"] == []
    assert doc["origin"]["parameter"] in OWN_NAMES
    lr_check = doc["counterfactuals"][0]
    assert "learning rate" in lr_check["question"] and lr_check["fault"] is False

    diff = cli("diff", f"{lr_run}@10", f"{lr_run}@20", "--json")
    assert diff.code == 0, diff.err
    ranked = diff.json()["ranked"]
    assert sorted(r["name"] for r in ranked) == sorted(fm.GPT().state_dict())
    exploded = {r["name"] for r in ranked if "exploded" in r["flags"]}
    assert exploded & {p["name"] for p in doc["parameters"]}  # the weights replay blames, by the same names


def test_a_body_that_returns_no_loss_and_a_build_fn_that_misuses_build_are_named(tmp_path):
    fabric = fm.fabric_for()
    model, optimizer = fabric.setup(*fm.made())
    rec = ckf.record(tmp_path / "run", fabric, model, optimizer, body=_no_loss, build_fn=fm.build)
    with rec, pytest.raises(RecordError, match="returned NoneType, not the loss"):
        rec.micro_batch((torch.randn(2, fm.SEQ, fm.FEATURES), torch.zeros(2, fm.SEQ, dtype=torch.long)))
    batch = {"batch": None, "fabric": {}}
    with pytest.raises(ReplayError, match="needs the fabric that build") as e:
        ckf.training_step(model, optimizer, batch)  # build_fn made its objects without ckf.build
    assert "ckptlab.integrations.fabric.build" in e.value.hint
    with pytest.raises(ReplayError, match="already set up") as e:
        ckf.build(fm.fabric_for(), fm.train_step, model, optimizer)  # what fabric.setup returned
    assert "pass them as made" in e.value.hint


def _no_loss(fabric, model, optimizer, batch, is_accumulating):
    fm.train_step(fabric, model, optimizer, batch, is_accumulating)


def test_fabrics_default_clipping_raising_on_the_nan_is_the_steps_exception_traced_to_the_sample(tmp_path, cli):
    """`fabric.clip_gradients` raises on a non-finite norm by default (torch's RuntimeError, through
    ckptlab's clipping wrapper): recorded as the step's exception, and replayed to the sample."""
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="non-finite"):
        fm.main(run_dir, nan=True, ckpt_every=3, default_clip=True)
    (event,) = ckptlab.open_run(run_dir).events()
    assert event["step"] == fm.FAULT_STEP and event["kind"] == "exception"
    done = cli("replay", "--run", run_dir, "--step", fm.FAULT_STEP, "--json")
    assert done.code == 0, done.err
    doc = done.json()
    assert doc["root_step"] == fm.FAULT_STEP and doc["origin"]["kind"] == "data"
    assert doc["origin"]["raised"]["error"].startswith("RuntimeError: The total norm of order 2.0")
    assert [(s["micro_batch"], s["row"], s["sample_id"]) for s in doc["samples"]] == [
        (fm.FAULT_MICRO, fm.FAULT_ROW, fm.FAULT_SAMPLE)
    ]
