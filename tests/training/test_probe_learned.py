"""What the recording's probe learned of the loop goes with each checkpoint, and a replay from
it takes it up: a step that changes its gradients after its backward (a hand clip on one step)
is measured as the recording measured it, bit for bit, even when the replay starts there."""

from __future__ import annotations

import json

import ckptlab
from ckptlab.training.probe import StepProbe, learned, resume_learned
from tests import fault_models as fm
from tests import hand_clip_models as hc


def test_a_replay_from_a_checkpoint_measures_a_hand_clip_on_its_first_step_as_the_recording_did(tmp_path):
    run_dir = tmp_path / "run"
    model, opt = hc.build()
    with ckptlab.Recorder(run_dir, model, opt, step_fn=hc.step, build_fn=hc.build, ckpt_every=10) as rec:
        for s in range(14):
            rec.step(hc.batch(s), sample_ids=fm.ids(s))
    commit = json.loads((run_dir / "checkpoints" / f"step-{hc.CLIP_AT:09d}" / "COMMIT.json").read_text())
    assert commit["probe"] == {"grad_mode": "lazy", "reuse": True}  # (it measured step 10 after the clip)
    report = ckptlab.replay(run_dir, hc.CLIP_AT + 2, trace=False, counterfactuals=False)
    assert report.bit_exact and report.agreement == "bit-exact", (report.agreement, report.diverged_at)


def test_resume_learned_takes_up_only_what_learned_saves():
    model, opt = fm.build_sgd_mlp()
    probe = StepProbe(model, opt)
    for bad in (None, {}, {"grad_mode": "sideways", "reuse": True}, {"grad_mode": "lazy", "reuse": 1}):
        resume_learned(probe, bad)
        assert learned(probe) == {"grad_mode": "learn", "reuse": True}
    resume_learned(probe, {"grad_mode": "eager", "reuse": False})
    assert learned(probe) == {"grad_mode": "eager", "reuse": False}
    probe.close()
