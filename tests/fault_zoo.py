"""The fault zoo: every planted-fault scenario (tests/fault_models.py, tests/zoo_models.py,
tests/first_update_models.py, tests/optimizer_models.py and tests/seams_models.py) with its
ground truth, for tests/test_fault_zoo.py and
scripts/bench_accuracy.py.

Ground truth per scenario: the root step (the first step that went wrong; for a transient, the
first step that ran with the corrupted state), the kind (docs/replay.md's origin.kind), the
module (origin.module: the innermost module whose forward produced the first non-finite value;
None when the bad value arrived in the batch, nothing went non-finite, or the op ran outside
any module; "" for the root module), the parameter at fault (None where no single parameter is
the cause), the sample ids to blame ([] where none), and whether the fault reproduces on
replay; and the symptom step, the step a user asks about (the first non-finite loss at or
after the root, or the root itself for a finite spike), which the record function also
reports, as some are found while recording.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tests import fault_models as fm
from tests import first_update_models as fu
from tests import optimizer_models as om
from tests import seams_models as sm
from tests import zoo_models as zm


@dataclass(frozen=True)
class Scenario:
    name: str
    record: Callable  # record(run_dir) -> Expected, whose .symptom is `symptom`
    symptom: int  # the step a user asks about: the first non-finite loss, or a spike's step
    root: int
    kind: str
    module: str | None
    parameter: str | None
    samples: list = field(default_factory=list)
    reproduces: bool = True
    new: bool = False  # added with the zoo (tests/zoo_models.py); the others are asserted elsewhere


def _s(name, module, symptom, root, kind, where, parameter=None, samples=(), reproduces=True, new=False):
    record = getattr(module, f"record_{name}")
    return Scenario(name, record, symptom, root, kind, where, parameter, list(samples), reproduces, new)


SCENARIOS: list[Scenario] = [
    # tests/fault_models.py
    _s("input_nan", fm, 27, 27, "data", None, samples=[2704]),
    _s("input_overflow", fm, 23, 23, "data", "fc1", samples=[2301]),
    _s("empty_bag", fm, 16, 16, "numeric", "pool", samples=[1603]),
    _s("log_negative", fm, 14, 14, "numeric", "logfeat", samples=[1402]),
    # a float16 matmul overflows on a large (not absurd) row: an op made Inf from finite inputs
    _s("fp16_overflow", fm, 21, 21, "precision", "half_block.proj", samples=[2105]),
    _s("masked_attention", fm, 12, 12, "numeric", "blocks.0.attn", samples=[1205]),
    _s("huge_target", fm, 26, 25, "data", None, samples=[2503]),
    _s("micro_batch_ignored_targets", fm, 17, 17, "numeric", "", samples=[1702]),
    _s("micro_batch_copied", fm, 17, 17, "numeric", "", samples=[1704]),
    _s("micro_batch_pairs", fm, 17, 17, "numeric", "", samples=[1702, 1703]),
    _s("lr_spike", fm, 19, 18, "optimizer", None),
    # a NaN written into fc1.weight between steps 23 and 24, outside step_fn: a transient
    _s("corrupted_weight", fm, 24, 24, "none", None, parameter="fc1.weight", reproduces=False),
    # step 22's float16 cast in the root model's forward overflows because step 21's blank batch
    # set the input scale: the rows to blame are step 21's (step 22's batch is harmless from any
    # other state). Expected.module in fault_models.py ("mlp.fc1", unasserted) is where the Inf
    # first meets a weight, not where it is made.
    _s("delayed_scale", fm, 22, 22, "precision", "", samples=[2100 + r for r in range(6)]),
    _s("late_feature", fm, 26, 25, "optimizer", None, parameter="late"),
    # noise from an unseeded numpy Generator (no replay matches the record) and a NaN scale the
    # script sets on the module class before step 15, outside step_fn: a transient made in `jitter`
    _s("unrecorded_noise", fm, 15, 15, "none", "jitter", reproduces=False),
    # tests/zoo_models.py (each section there explains its ground truth)
    # float16 overflows: in float32 (replay's counterfactual) the step stays finite
    _s("attention_logit_growth", zm, 19, 19, "precision", "attn", samples=[1902], new=True),
    _s("label_out_of_range", zm, 22, 22, "data", None, samples=[2202], new=True),
    _s("dead_relu", zm, 24, 24, "data", None, samples=[2403], new=True),
    _s("exploding_residual", zm, 26, 26, "precision", "blocks.6", samples=[2601], new=True),
    _s("bad_lr_warmup", zm, 21, 20, "optimizer", None, new=True),
    _s("bad_weight_init", zm, 24, 24, "numeric", "heads.2", parameter="heads.2.fc.weight", samples=[2402], new=True),
    _s("padding_mask_bug", zm, 15, 15, "numeric", "blocks.0.attn", samples=[1500], new=True),
    _s("zero_length_division", zm, 18, 18, "numeric", None, samples=[1805], new=True),
    _s("corrupted_embedding_row", zm, 16, 13, "none", None, parameter="wte.weight", reproduces=False, new=True),
    _s("duplicated_sample", zm, 22, 22, "data", None, samples=[zm.HAMMER], new=True),
    # tests/first_update_models.py: the root step's update exploded, the record measured no update
    # there (health_every 10), and the loss explodes a step or three later
    _s("adam_first_update", fu, 38, 37, "optimizer", None, parameter="block.out.weight", new=True),
    _s("hidden_update_explosion", fu, 38, 35, "optimizer", None, new=True),
    # tests/optimizer_models.py: a GAN (D and G, an Adam each, given as a dict); G's scheduler
    # multiplies its learning rate by 1e4 at step 21 (replay names optimizer `g`, group 0:
    # asserted by test_multi_optimizer.py)
    _s("gan_lr_jump", om, 22, 21, "optimizer", None),
    # tests/seams_models.py, the shapes at the seams with the user's code (asserted by
    # test_seams.py): a word-level LSTM LM whose targets are the (bptt, B) chunk flattened, a
    # NaN in one column of the hidden state carried in the batch (a data fault: no module);
    _s("word_lm", sm, 23, 23, "data", None, samples=["chunk23/col2"]),
    # a VAE whose corrupt condition feature makes exp(0.5 * logvar) overflow in reparameterize
    # (a method of the root model: module ""), and binary cross-entropy then raises on the NaN;
    _s("vae_overflow", sm, 17, 17, "data", "", samples=["img17-4"]),
    # Adam's learning rate x1e13 at step 14 (set by the loop); step 15 raises on its Inf loss;
    _s("vae_lr_explosion", sm, 15, 14, "optimizer", None),
    # a NaN sample through BatchNorm (its running statistics go NaN: lasting damage);
    _s("batchnorm_nan", sm, 12, 12, "data", None, samples=[12001]),
    # clip_grad_norm_(..., error_if_nonfinite=True) raises on an Inf feature's gradients.
    _s("clip_error_if_nonfinite", sm, 9, 9, "data", None, samples=[902]),
]

BY_NAME = {s.name: s for s in SCENARIOS}
