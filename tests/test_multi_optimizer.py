"""Several optimizers (a GAN's D and G, given as a dict or a list), their schedulers, the
learning rate of every parameter group, and a scheduler the loop steps itself.

Models: tests/optimizer_models.py."""

import json
import math
import warnings

import numpy as np
import pytest
import torch

import ckptlab
from ckptlab.replayer.driver import Replayer
from ckptlab.run.records import NO_GRAD
from ckptlab.trackers.points import health_points
from ckptlab.training.step import StepRunner
from tests import optimizer_models as om

LR_NOTE = "replay follows the record"  # the note replay gives when a step's recorded lr is not the state's


def record(run_dir, build, step, steps, **kw):
    model, optimizers, *scheds = build()
    with ckptlab.Recorder(
        run_dir, model, optimizers, scheduler=scheds[0] if scheds else None, step_fn=step, build_fn=build, **kw
    ) as rec:
        for s in range(steps):
            rec.step(om.batch(s), sample_ids=om.ids(s))
    return run_dir


@pytest.fixture(scope="module")
def gan_run(tmp_path_factory):
    """The dict form, G's scheduler multiplying its learning rate by 1e4 at step FAULT."""
    return record(tmp_path_factory.mktemp("gan") / "run", om.build, om.step, om.STEPS, ckpt_every=8)


@pytest.fixture(scope="module")
def gan_list_run(tmp_path_factory):
    """The list form, a scheduler for each optimizer."""
    return record(tmp_path_factory.mktemp("gan-list") / "run", om.build_list, om.step_list, 20, ckpt_every=8)


def test_a_gan_replays_bit_exactly_and_names_g_its_group_and_a_parameter_of_g(gan_run, cli):
    """G's learning rate jumps 1e4-fold at step FAULT (its scheduler): replay names that step,
    the optimizer, optimizer `g`, group 0, a parameter of G, and proves it with G's recent
    learning rate; every replayed step before the fault matches the record bit for bit."""
    r = cli("replay", "--run", gan_run, "--step", om.STEPS - 1, "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["root_step"] == om.FAULT and doc["reproduced"] and doc["bit_exact"]
    assert all(c["match"] for c in doc["steps"])
    o = doc["origin"]
    assert (o["kind"], o["optimizer"], o["param_group"]) == ("optimizer", "g", 0)
    assert o["parameter"].startswith("G.")
    assert "the learning rate of optimizer `g`, group 0, 20, is 10000x its recent value" in doc["verdict"]
    proof = next(c for c in doc["counterfactuals"] if "learning rate" in c["question"])
    assert "(optimizer `g`, group 0)" in proof["question"] and proof["fault"] is False


def test_every_optimizer_is_named_in_the_manifest_and_checkpointed(gan_run):
    run = ckptlab.open_run(gan_run)
    assert run.manifest["optimizers"] == [
        {"key": "d", "class": "Adam", "groups": [0]},
        {"key": "g", "class": "Adam", "groups": [1]},
    ]
    assert {p["name"]: p["group"] for p in run.manifest["parameters"]} == {
        **{f"G.{i}.{w}": 1 for i in (0, 2) for w in ("weight", "bias")},
        **{f"D.{i}.{w}": 0 for i in (0, 2) for w in ("weight", "bias")},
    }
    state = run.checkpoint(16).load_state()
    assert sorted(state["optimizer"]) == ["d", "g"] and state["optimizer"]["g"]["state"][0]["step"] == 16
    assert list(state["scheduler"]) == ["g"] and state["scheduler"]["g"]["last_epoch"] == 16
    assert run.metrics().lr.shape[1] == 2  # every optimizer's groups, in order


def test_rollback_to_a_folder_exports_each_optimizers_state_under_its_key(gan_run, cli, tmp_path):
    r = cli("rollback", "--run", gan_run, "--to", tmp_path / "best", "--json")
    assert r.code == 0, r.err
    states = torch.load(tmp_path / "best" / "optimizer.pt", weights_only=True)
    model, opts, _ = om.build()
    for key, opt in opts.items():
        opt.load_state_dict(states[key])  # as export.json says to
    assert "opt.load_state_dict(states[key])" in json.loads((tmp_path / "best" / "export.json").read_text())["load"]


def test_the_list_form_restores_each_optimizer_and_scheduler_from_a_mid_run_checkpoint(gan_list_run):
    """From checkpoint 8: both Adam states and both schedulers come back (D's decays every
    step, so a scheduler left at its start would give another learning rate than the record:
    replay would have to say it follows the record), and the steps after match bit for bit."""
    report = ckptlab.replay(gan_list_run, 15, from_step=8, trace=False, counterfactuals=False)
    assert [c.step for c in report.steps] == list(range(8, 16))
    assert report.bit_exact and all(c.match for c in report.steps)
    assert not any(LR_NOTE in n for n in report.notes)
    replayer = Replayer(ckptlab.open_run(gan_list_run))
    t = replayer.build()
    replayer.load_checkpoint(t, 16)
    assert isinstance(t.step_optimizer, list) and [s.last_epoch for _, s in t.scheduler.entries] == [16, 16]
    assert [m.state[m.param_groups[0]["params"][0]]["step"].item() for m in t.optimizer.members] == [16, 16]
    recorded = ckptlab.open_run(gan_list_run).metrics()
    assert [g["lr"] for g in t.optimizer.param_groups] == recorded.lr[recorded.index(16)].tolist()
    t.close()


def test_each_optimizer_is_measured_at_its_own_step():
    """D's gradient norms are D's gradients as D stepped (G's backward adds to them after), its
    update ratio D's update; G's likewise; each group's learning rate its own."""
    model, opts, _ = om.build()
    ref_model, ref_opts, _ = om.build()
    seen = {}

    def before(name, opt):
        def hook(*_):
            params = [p for g in opt.param_groups for p in g["params"]]
            seen[name] = ([float(p.grad.norm()) for p in params], [p.detach().clone() for p in params])

        return hook

    for name in ("d", "g"):
        ref_opts[name].register_step_pre_hook(before(name, ref_opts[name]))
    runner = StepRunner(model, opts, update_ratio="exact")
    _, h = runner.run_step(om.step, om.batch(0), measure_update=True)
    om.step(ref_model, ref_opts, om.batch(0))
    names = runner.probe.names
    for name, prefix in (("d", "D."), ("g", "G.")):
        cols = [i for i, n in enumerate(names) if n.startswith(prefix)]
        norms, weights = seen[name]
        assert np.allclose(h.param_grad_norm[cols], norms, rtol=1e-5)
        after = [p for g in ref_opts[name].param_groups for p in g["params"]]
        ratios = [float((a.detach() - b).norm() / b.norm()) for a, b in zip(after, weights)]
        assert np.allclose(h.update_ratio[cols], ratios, rtol=1e-4)
    d_now = [float(p.grad.norm()) for p in model.D.parameters()]  # D's gradients after G's backward too
    assert not np.allclose(h.param_grad_norm[[i for i, n in enumerate(names) if n.startswith("D.")]], d_now)
    assert h.lr == [2e-3, 2e-3]
    runner.close()


class Critic(torch.nn.Module):
    """D with a head only its first pass uses, G, and a frozen embedding (no gradient ever)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.frozen = torch.nn.Linear(om.DIM, om.DIM).requires_grad_(False)
        self.D, self.head = torch.nn.Linear(om.DIM, 1), torch.nn.Linear(om.DIM, 1)
        self.G = torch.nn.Linear(om.LATENT, om.DIM)


def critic_step(model, opts, batch):
    """Two critic steps (the head in the first only), then G's, whose backward adds to D's."""
    for critic in range(2):
        opts["d"].zero_grad()
        x = model.frozen(batch["x"])
        (model.D(x).mean() + (model.head(x).mean() if critic == 0 else 0)).backward()
        opts["d"].step()
    opts["g"].zero_grad()
    loss = model.D(model.G(batch["z"])).square().mean()
    loss.backward()
    opts["g"].step()
    return loss


def test_a_frozen_parameter_and_a_critic_stepped_twice_keep_each_optimizers_own_norms():
    """Each parameter's norm is the gradient its optimizer's last step that had one stepped
    with: D's from the second critic step (not with G's loss added), the head's from the first
    (the second had no gradient for it), G's at its step; the frozen weights have none."""
    model = Critic()
    opts = {"d": torch.optim.SGD([*model.D.parameters(), *model.head.parameters()], lr=0.1)}
    opts["g"] = torch.optim.SGD(model.G.parameters(), lr=0.1)
    seen = {}

    def before(opt, *_):
        seen.update({id(p): float(p.grad.norm()) for g in opt.param_groups for p in g["params"] if p.grad is not None})

    hooks = [o.register_step_pre_hook(before) for o in opts.values()]
    runner = StepRunner(model, opts)
    for s in range(2):  # (the second step: the probe measures lazily, as it learned)
        seen.clear()
        batch = {"x": torch.randn(om.B, om.DIM), "z": torch.randn(om.B, om.LATENT)}
        _, h = runner.run_step(critic_step, batch, measure_update=False)
        expected = [seen.get(id(p), NO_GRAD) for p in runner.probe.params]
        assert np.allclose(h.param_grad_norm, expected, rtol=1e-6), s
    names = runner.probe.names
    assert [n for n, v in zip(names, h.param_grad_norm) if v == NO_GRAD] == ["frozen.weight", "frozen.bias"]
    d_now = float(model.D.weight.grad.norm())  # after G's backward added to it
    assert not np.isclose(h.param_grad_norm[names.index("D.weight")], d_now)
    for hook in hooks:
        hook.remove()
    runner.close()


def test_only_the_group_whose_learning_rate_jumped_is_named_and_its_recent_rate_removes_the_fault(tmp_path):
    """One optimizer, two groups: the head's learning rate jumps 1e4-fold at GROUP_FAULT, the
    body's does not. Replay names group 1 (read from group 0 alone, the jump was invisible)."""
    run_dir = record(tmp_path / "run", om.build_groups, om.step_groups, om.GROUP_FAULT + 3, ckpt_every=10)
    report = ckptlab.replay(run_dir, om.GROUP_FAULT + 2)
    o = report.origin
    assert report.root_step == om.GROUP_FAULT and (o.kind, o.optimizer, o.param_group) == ("optimizer", None, 1)
    assert o.parameter.startswith("head.") and o.detail.startswith("the learning rate of group 1, ")
    lr_check = next(c for c in report.counterfactuals if "learning rate" in c.question)
    assert "instead of 10 (group 1)" in lr_check.question and lr_check.fault is False


def test_an_optimizer_the_recorder_was_not_given_is_warned_of_once(run_dir, cli):
    """The Recorder gets D's optimizer only; the loop steps G's too: a warning once, an
    event that `info` lists as a warning, and the reason a replay that leaves the record gives."""
    model, opt_d = om.build_d_only()
    with pytest.warns(UserWarning, match="had a gradient and changed, though no optimizer given") as caught:
        with ckptlab.Recorder(
            run_dir, model, opt_d, step_fn=om.step_d_only, build_fn=om.build_d_only, ckpt_every=3
        ) as rec:
            for s in range(6):
                rec.step(om.batch(s), sample_ids=om.ids(s))
    assert len([w for w in caught if "no optimizer given" in str(w.message)]) == 1
    events = ckptlab.open_run(run_dir).events()
    assert [(e["step"], e["kind"], e["value"]) for e in events] == [(0, "outside_optimizer", 4)]
    assert "`G.0.weight`" in events[0]["detail"]
    info = cli("info", "--run", run_dir, "--json").json()
    assert info["anomalies"] == [] and [w["kind"] for w in info["warnings"]] == ["outside_optimizer"]
    doc = cli("replay", "--run", run_dir, "--step", 5, "--json").json()  # from checkpoint 3: G's Adam state is gone
    assert doc["start_checkpoint"] == 3 and not doc["deterministic"]
    assert "the Recorder warned at step 0: `G.0.weight`" in doc["verdict"]


def test_a_scheduler_the_loop_steps_once_an_epoch_is_caught_at_once(tmp_path):
    """The MNIST example: StepLR(step_size=1, gamma=0.7) given as scheduler= and stepped by the
    loop after each epoch. The Recorder steps it after every step too: stopped before the
    first step after the loop's step, saying what to change. With step_scheduler=False the
    loop's schedule is the one recorded, and replay follows it across the epochs, bit for bit."""

    def train(run_dir, **kw):
        model, opt, sched = om.build_epochs()
        with ckptlab.Recorder(
            run_dir, model, opt, scheduler=sched, step_fn=om.step_groups, build_fn=om.build_epochs, **kw
        ) as rec:
            for epoch in range(3):
                for s in range(epoch * om.EPOCH, (epoch + 1) * om.EPOCH):
                    rec.step(om.batch(s), sample_ids=om.ids(s))
                sched.step()

    with pytest.raises(ckptlab.RecordError, match=r"before step 4: the LR scheduler \(StepLR\) was stepped") as e:
        train(tmp_path / "caught")
    assert "step_scheduler=False" in str(e.value)
    assert ckptlab.open_run(tmp_path / "caught").steps == [0, 1, 2, 3]  # nothing of step 4
    train(tmp_path / "epochs", step_scheduler=False, ckpt_every=3)
    m = ckptlab.open_run(tmp_path / "epochs").metrics()
    intended = [om.BASE_LR * om.GAMMA ** (s // om.EPOCH) for s in range(3 * om.EPOCH)]
    assert all(math.isclose(a, b) for a, b in zip(m.lr[:, 0], intended))
    report = ckptlab.replay(tmp_path / "epochs", 10, from_step=3, trace=False, counterfactuals=False)
    assert [c.step for c in report.steps] == list(range(3, 11)) and all(c.match for c in report.steps)


@pytest.mark.parametrize(
    "scheduler, message",
    [
        ({"g": None}, r"scheduler= names \['g'\], the optimizers are \['d', 'g'\]"),
        ([None, None], "scheduler= is a list and optimizer= a dict"),
        ("one", "scheduler= is one str for 2 optimizers"),
    ],
)
def test_schedulers_in_another_shape_than_the_optimizers_are_refused(run_dir, scheduler, message):
    model, opts, _ = om.build()
    with pytest.raises(ckptlab.RecordError, match=message):
        ckptlab.Recorder(run_dir, model, opts, scheduler=scheduler, step_fn=om.step, build_fn=om.build)
    assert not run_dir.exists()


def test_a_build_fn_that_returns_one_optimizer_for_a_run_of_two_is_refused(gan_run):
    replayer = Replayer(ckptlab.open_run(gan_run))
    replayer.build_fn = om.build_d_only
    with warnings.catch_warnings(), pytest.raises(ckptlab.ReplayError, match=r"recorded with optimizers \['d', 'g'\]"):
        replayer.build()


def test_a_trackers_lr_curve_keeps_its_group_number_when_an_earlier_groups_rate_is_unknown():
    points = health_points({"loss": 1.0, "lr": [math.nan, 0.1]}, {}, [])
    assert {k: v for k, v in points.items() if k.startswith("train/lr")} == {"train/lr/group1": 0.1}
