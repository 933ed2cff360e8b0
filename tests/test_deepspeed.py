"""DeepSpeed's engine with ZeRO stages 1, 2 and 3, 2 processes, gloo on the CPU
(tests/deepspeed_models.py), one recording a stage: ZeRO-1 and ZeRO-3 (with a frozen parameter
and a buffer) train with a torch AdamW and replay bit for bit; ZeRO-2 trains with DeepSpeed's
own C++ Adam and replays `equivalent`, saying why. Both planted faults are named (the NaN sample
on rank 1, the loop's learning-rate bug). ZeRO-2 with a torch AdamW, bit for bit, is the HF
Trainer's run (tests/integrations/test_transformers_deepspeed.py)."""

import math

import pytest
import torch

pytest.importorskip("deepspeed")

import ckptlab  # noqa: E402
from tests import deepspeed_models as dm  # noqa: E402
from tests.integrations.ddp_launch import torchrun  # noqa: E402


def _record(tmp_path_factory, build: str, timeout: float = 300):
    """(run dir, DeepSpeed's own global gradient norm of each step) of tests/deepspeed_models.py BUILD."""
    run_dir = tmp_path_factory.mktemp(f"zero{build}") / "run"
    lines = torchrun("deepspeed_models.py", run_dir, 2, build, timeout=timeout)
    assert [line for line in lines if line.startswith("rank")] == [
        f"rank {r} recorded {dm.STEPS} steps" for r in (0, 1)
    ]
    return run_dir, {int(w[1]): float(w[4]) for w in (line.split() for line in lines if line.startswith("step"))}


BUILDS = ["1", "2-adam", "3-frozen"]  # (tests/deepspeed_models.py's BUILDS)
IDS = ["zero1", "zero2-adam", "zero3-frozen"]
# The recordings trained with a torch AdamW, which replay bit for bit.
TORCH_ADAMW = pytest.mark.parametrize("zero_run", ["1", "3-frozen"], ids=["zero1", "zero3-frozen"], indirect=True)


@pytest.fixture(scope="module", params=BUILDS, ids=IDS)
def zero_run(request, tmp_path_factory):
    """(build, run dir, DeepSpeed's own global gradient norm of each step). "2-adam": DeepSpeed's
    own Adam, its C++ op built on first use (TORCH_EXTENSIONS_DIR; .ci/run starts building it
    before the tests): 85-160 s of gcc on an idle 2-core machine, longer on a loaded one."""
    build = request.param
    return build, *_record(tmp_path_factory, build, timeout=900 if build == "2-adam" else 300)


def _trained(build: str) -> list[str]:
    """The parameters the build's optimizer trains (fc1.bias is frozen in "3-frozen")."""
    return ["fc1.weight", *(["fc1.bias"] if build != "3-frozen" else []), "fc2.weight", "fc2.bias"]


def test_records_the_model_s_own_names_and_deepspeed_s_gradient_norms(zero_run):
    build, run_dir, norms = zero_run
    run = ckptlab.open_run(run_dir)
    assert (run.manifest["layout"], run.world_size) == ("zero", 2)
    # the user's names and whole shapes (ZeRO-3's parameters are empty stubs between steps)
    assert [(p["name"], p["shape"]) for p in run.manifest["parameters"]] == [
        ("fc1.weight", [16, 8]),
        ("fc1.bias", [16]),
        ("fc2.weight", [1, 16]),
        ("fc2.bias", [1]),
    ]
    assert [p["name"] for p in run.manifest["parameters"] if p["group"] == 0] == _trained(build)
    m = run.metrics()
    for s in range(dm.STEPS):  # each rank's parts of the averaged gradient, before DeepSpeed clips it
        if s != dm.NAN_STEP:
            assert m.grad_norm[m.index(s)] == pytest.approx(norms[s], rel=1e-6), s
    at_nan = m.scalars[m.index(dm.NAN_STEP)]["rank_loss"]
    assert math.isfinite(at_nan[0]) and math.isnan(at_nan[1])
    assert m.lr[m.index(dm.LR_STEP)][0] == dm.LR_FAULT
    assert {5, 10} <= set(run.checkpoints)
    # each rank wrote its own partitions (DCP), nothing was gathered to rank 0
    commit = run.checkpoint(10).commit
    assert commit["layout"] == "sharded" and "model.safetensors" not in commit["files"]
    assert {f for f in commit["files"] if f.startswith("dcp/__")} == {"dcp/__0_0.distcp", "dcp/__1_0.distcp"}


@TORCH_ADAMW
def test_replay_is_bit_exact_and_names_rank_1_s_sample(zero_run):
    build, run_dir, _ = zero_run
    linear = torch.nn.functional.linear
    report = ckptlab.replay(run_dir, dm.NAN_STEP)
    assert torch.nn.functional.linear is linear  # (ZeRO-3 replaces it for the whole process: given back)
    assert report.deterministic and [c.match for c in report.steps] == [True] * 3, report.verdict
    for c in report.steps:
        assert c.rank_loss == c.recorded_rank_loss or math.isnan(c.rank_loss[1])
        assert c.grad_norm == c.recorded_grad_norm or math.isnan(c.grad_norm)
    assert (report.root_step, report.rank, report.origin.kind) == (dm.NAN_STEP, dm.NAN_RANK, "data")
    nan_id = dm.sample_ids(dm.NAN_STEP, dm.NAN_RANK)[dm.NAN_ROW]
    assert [(s.row, s.sample_id) for s in report.samples] == [(dm.NAN_ROW, nan_id)]
    assert report.counterfactuals[0].fault is False  # without that row the step is healthy


def test_the_trace_names_the_user_s_line_under_deepspeed_s_linear(tmp_path, monkeypatch):
    """ZeRO-3 puts DeepSpeed's `zero3_linear_wrap` in torch.nn.functional.linear: a traced op
    under it is placed on the user's line that called it, not in DeepSpeed's linear.py."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    from ckptlab.replayer.driver import Replayer
    from ckptlab.replayer.trace import Tracer
    from tests import models

    models.record_run(tmp_path / "run", models.build_mlp, models.step_mlp, models.mlp_batches(2))
    monkeypatch.setattr(torch.nn.functional, "linear", zero3_linear_wrap)
    replayer = Replayer(ckptlab.open_run(tmp_path / "run"))
    runner = replayer.build()
    replayer.load_checkpoint(runner, 0)
    tracer = Tracer(runner.model, runner.optimizer, rows=4)
    replayer.run_step(runner, replayer.batch(0), tracer=tracer)
    replayer.close(runner)
    assert "aten.mm.default" in {e.op for e in tracer.events}  # (DeepSpeed's linear ran: no addmm)
    assert {e.source.split(":")[0] for e in tracer.events if e.source} == {"models.py"}


def test_one_process_replays_a_rank_from_the_ranks_partitions(zero_run):
    """`--rank 1`: the checkpoint's partitions, written by two ranks, load whole into an engine
    of one process: its first step's loss is rank 1's recorded one, bit for bit (it needs no
    other rank's gradients; DeepSpeed's Adam too, as its first step is the record's); the NaN
    row is named."""
    build, run_dir, _ = zero_run
    report = ckptlab.replay(run_dir, dm.NAN_STEP, rank=dm.NAN_RANK)
    first, m = report.steps[0], ckptlab.open_run(run_dir).metrics()
    assert first.step == 5 and first.loss == m.scalars[m.index(5)]["rank_loss"][dm.NAN_RANK], report.verdict
    assert (report.root_step, report.origin.kind) == (dm.NAN_STEP, "data")
    nan_id = dm.sample_ids(dm.NAN_STEP, dm.NAN_RANK)[dm.NAN_ROW]
    assert [(s.row, s.sample_id) for s in report.samples] == [(dm.NAN_ROW, nan_id)]


@pytest.mark.parametrize("zero_run", ["3-frozen"], ids=["zero3-frozen"], indirect=True)
def test_zero3_s_frozen_parameters_and_buffers_are_checkpointed_whole(zero_run):
    """ZeRO-3 partitions a frozen parameter too (no fp32 master, no optimizer state): the
    checkpoint holds it whole, as it was built, beside the buffer (and the replay above is bit
    for bit). This run writes its checkpoints on the training thread (`async_sharded=False`:
    the live partitions, no copy)."""
    run = ckptlab.open_run(zero_run[1])
    first, tenth = run.checkpoint(0).load_model()[0], run.checkpoint(10).load_model()[0]
    assert set(tenth) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "scale"}
    assert torch.equal(tenth["fc1.bias"], first["fc1.bias"]) and not torch.equal(tenth["fc2.bias"], first["fc2.bias"])
    assert tenth["scale"].tolist() == [1.5, 2.5]
    assert [g["params"] for g in run.checkpoint(10).load_state()["param_groups"]] == [
        ["fc1.weight", "fc2.weight", "fc2.bias"]
    ]


def _assert_names_the_learning_rate_step(report) -> None:
    assert (report.root_step, report.origin.kind, report.samples) == (dm.LR_STEP, "optimizer", [])
    assert "learning rate 1e+04" in report.verdict
    assert report.rank in (0, 1) and not any("traced step's loss differs" in n for n in report.notes)


@pytest.mark.parametrize("zero_run", ["3-frozen"], ids=["zero3-frozen"], indirect=True)
def test_replay_names_the_learning_rate_step(zero_run):
    build, run_dir, _ = zero_run
    report = ckptlab.replay(run_dir, dm.LR_STEP + 1)
    assert report.deterministic and all(c.match for c in report.steps), report.verdict
    _assert_names_the_learning_rate_step(report)


@pytest.mark.parametrize("zero_run", ["2-adam"], ids=["zero2-adam"], indirect=True)
def test_deepspeed_s_adam_replays_equivalent_and_says_why(zero_run):
    """DeepSpeed's C++ Adam keeps beta^t as a running product, and a replay resumed at a
    checkpoint recomputes it with pow: the replay's first step is the record's bit for bit, the
    next ones within round-off; replay says `equivalent` and why, and still names the fault (the
    learning-rate step is named on ZeRO-3's run, above)."""
    adam_run = zero_run[1]
    report = ckptlab.replay(adam_run, dm.NAN_STEP)
    assert report.agreement == "equivalent" and [c.match for c in report.steps][:2] == [True, False]
    assert 0 < report.max_rel_deviation < 1e-5
    assert any("FusedAdam's CPU build) keeps beta^t as a running product" in r for r in report.bits_differ)
    assert "keeps beta^t as a running product" in report.verdict and "diverged" not in report.verdict
    assert (report.root_step, report.rank, report.origin.kind) == (dm.NAN_STEP, dm.NAN_RANK, "data")
    nan_id = dm.sample_ids(dm.NAN_STEP, dm.NAN_RANK)[dm.NAN_ROW]
    assert [(s.row, s.sample_id) for s in report.samples] == [(dm.NAN_ROW, nan_id)]


@TORCH_ADAMW
def test_checkpoints_diff_and_export_as_any_run_s(zero_run, tmp_path):
    """A checkpoint holds the whole state (the fp32 masters, the optimizer state of the model's
    own parameters): `diff` reads it, and rollback's export loads into a plain torch model and
    AdamW, without DeepSpeed."""
    import safetensors.torch
    import torch

    from ckptlab.run.portable import export_checkpoint

    build, run_dir, _ = zero_run
    report = ckptlab.diff(f"{run_dir}@5", f"{run_dir}@10")
    buffers = {"scale"} if build == "3-frozen" else set()
    assert {t.name for t in report.ranked} == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", *buffers}
    assert not report.missing
    if build == "3-frozen":  # healthy steps between them; the frozen parameter did not move
        assert (report.verdict.parameter, report.verdict.reason[:10]) == ("fc1.bias", "unchanged:")
    else:
        assert report.verdict is None
    run = ckptlab.open_run(run_dir)
    export_checkpoint(run.checkpoint(10), tmp_path / "out")
    model = dm.mlp(frozen=build == "3-frozen")
    model.load_state_dict(safetensors.torch.load_file(tmp_path / "out" / "model.safetensors"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=dm.LR)
    opt.load_state_dict(torch.load(tmp_path / "out" / "optimizer.pt", weights_only=True))
    state = opt.state_dict()["state"]
    assert len(state) == len(_trained(build)) and state[0]["exp_avg"].shape == (16, 8)
    assert float(state[len(state) - 1]["step"]) == 9  # (step 7 was skipped)
    assert torch.equal(model.fc2.bias, run.checkpoint(10).load_model()[0]["fc2.bias"])


def test_what_is_not_recorded_of_deepspeed_is_refused_in_one_line(tmp_path):
    """Real engines, in a process group of one: set up as ckptlab does not record them (no ZeRO,
    bf16), or given with another optimizer than theirs. Refused at once, nothing written."""
    import deepspeed
    import torch

    from ckptlab.errors import RecordError
    from ckptlab.training.world import solo_world
    from tests.models import MLP

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # (tests/deepspeed_models.py says why)
    cases = [
        (
            {"zero_optimization": {"stage": 0}},
            None,
            r"cannot record a DeepSpeed engine without ZeRO \(zero_optimization",
        ),
        ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}, None, "DeepSpeed engine in fp16 or bf16"),
        ({"zero_optimization": {"stage": 2}}, "torch", r"the optimizer given \(AdamW\) is not the DeepSpeed engine's"),
    ]
    with solo_world(True):
        for config, give, match in cases:
            model = MLP()
            torch_opt = torch.optim.AdamW(model.parameters(), lr=dm.LR)
            engine, opt, _, _ = deepspeed.initialize(
                model=model, optimizer=torch_opt, config={"train_micro_batch_size_per_gpu": dm.ROWS, **config}
            )
            with pytest.raises(RecordError, match=match) as e:
                given = torch_opt if give == "torch" else opt
                ckptlab.Recorder(tmp_path / "r", engine, given, step_fn=dm.step_engine, build_fn=dm.build_zero2)
            assert "\n" not in str(e.value) and "docs/distributed.md" in str(e.value)
            assert not (tmp_path / "r").exists()


def test_diff_reads_deepspeed_s_own_checkpoint_folder(zero_run, cli):
    """A folder engine.save_checkpoint wrote (rank 0's module file, every rank's partitions,
    `latest`), read with weights_only: its fp32 masters gathered from the partitions are the
    run's checkpoint of the same step, bit for bit, and what DeepSpeed's zero_to_fp32 gathers."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from ckptlab.io.open import open_checkpoint

    build, run_dir, _ = zero_run
    folder = run_dir.parent / "deepspeed"
    done = cli("diff", f"{run_dir}@{dm.DS_CHECKPOINT}", folder, "--json")
    assert done.code == 0, done.err
    doc = done.json()
    # (ZeRO-3's frozen fc1.bias: gathered from the ranks' model files, and the buffer)
    assert doc["missing"] == doc["unexpected"] == [] and len(doc["ranked"]) == (5 if build == "3-frozen" else 4)
    assert all(t["delta"]["l2"] == 0 and t["delta"]["unchanged"] == 1 for t in doc["ranked"]), doc["ranked"]
    ours = open_checkpoint(folder)
    assert any(f"ZeRO-{build[0]} checkpoint" in n for n in ours.notes)
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(folder))  # (DeepSpeed's reader unpickles: our own file)
    assert set(theirs) == set(ours) and all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_deepspeed_folder_asking_for_other_objects_is_refused(tmp_path, cli):
    """An optimizer file that asks for anything but DeepSpeed's three known objects is refused
    in one line, before anything of it runs."""
    import fractions

    import torch

    folder = tmp_path / "global_step1"
    folder.mkdir()
    torch.save({"module": {}, "param_shapes": [{"w": torch.Size([2])}]}, folder / "mp_rank_00_model_states.pt")
    crafted = {"optimizer_state_dict": {"zero_stage": 2, "x": fractions.Fraction(1, 3)}}
    torch.save(crafted, folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    done = cli("diff", folder, folder)
    assert done.code != 0 and "refused: it holds Python objects" in done.err and "fractions.Fraction" in done.err
    assert "Traceback" not in done.err and len(done.err.strip().splitlines()) <= 2, done.err


def _zero3_folder(folder, fragments: list[dict], shapes: dict | None = None):
    """A crafted ZeRO-3 folder of 2 ranks: trainable w (3 elements, 2 a rank, the last padded)
    and frozen f (5 elements, 3 a rank), as engine.save_checkpoint lays them out."""
    import torch

    folder.mkdir()
    shapes = {"f": torch.Size([5])} if shapes is None else shapes
    for r in (0, 1):
        model = {"module": {"w": torch.empty(0), "f": torch.empty(0)}, "param_shapes": [{"w": torch.Size([3])}]}
        model |= {"frozen_param_shapes": shapes, "frozen_param_fragments": fragments[r]}
        torch.save(model, folder / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        flat = torch.tensor([[1.0, 2.0], [3.0, 0.0]][r])
        optim = {"optimizer_state_dict": {"zero_stage": 3, "fp32_flat_groups": [flat]}}
        torch.save(optim, folder / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    return folder


def test_a_zero3_folder_s_frozen_parameters_are_gathered_from_every_rank_s_part(tmp_path, cli):
    """Each rank's model file holds its part of a frozen parameter (the last padded): read
    whole, beside the trainable ones; parts that do not make the shape are refused in one line."""
    import torch

    from ckptlab.io.open import open_checkpoint

    parts = [{"f": torch.tensor([10.0, 11.0, 12.0])}, {"f": torch.tensor([13.0, 14.0, 0.0])}]
    sd = open_checkpoint(_zero3_folder(tmp_path / "ok", parts))
    assert sd["f"].tolist() == [10.0, 11.0, 12.0, 13.0, 14.0] and sd["w"].tolist() == [1.0, 2.0, 3.0]
    short = [parts[0], {"f": torch.tensor([13.0, 14.0])}]
    missing = [parts[0], {}]
    for name, bad, says in [
        ("short", short, "the ranks' parts of the frozen 'f' do not make its shape [5]"),
        ("missing", missing, "rank 1's part of the frozen 'f' is not a flat floating tensor"),
    ]:
        done = cli("diff", _zero3_folder(tmp_path / name, bad), tmp_path / "ok")
        assert done.code != 0 and says in done.err and "Traceback" not in done.err, done.err
        assert len(done.err.strip().splitlines()) <= 2, done.err
    trained = _zero3_folder(tmp_path / "named-twice", parts, {"w": torch.Size([3])})
    done = cli("diff", trained, tmp_path / "ok")
    assert done.code != 0 and "frozen_param_shapes holds a malformed entry for 'w'" in done.err, done.err
