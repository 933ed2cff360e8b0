"""FSDP2 as the HF Trainer and accelerate make it (forced on the CPU: tests/hf_fsdp_models.py,
tests/accelerate_fsdp_models.py), 2 processes, gloo: every rank records its shards and
micro-batches as under plain FSDP2; `ckptlab replay --world-size 1` folds both ranks' turns
into one process bit for bit and names rank 1, the micro-batch, the row and the planted
sample. (A replay on the recorded 2 processes runs the same FSDP2 steps in two processes:
tests/test_distributed.py replays plain FSDP2 so, tests/integrations/test_lightning_model_parallel.py
Lightning's.)"""

from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import ckptlab  # noqa: E402
from ckptlab.integrations import transformers as ckt  # noqa: E402
from tests import accelerate_fsdp_models, hf_fsdp_models  # noqa: E402
from tests.integrations.ddp_launch import assert_replays_and_names_the_sample, record_to_the_fault, replay_json  # noqa: E402

FIXTURES = {"transformers": hf_fsdp_models, "accelerate": accelerate_fsdp_models}


@pytest.fixture(scope="module", params=list(FIXTURES))
def fsdp_run(request, tmp_path_factory):
    """(the fixture module, its run): the HF Trainer's, then accelerate's."""
    fm = FIXTURES[request.param]
    script = f"{fm.__name__.split('.')[-1]}.py"
    return fm, record_to_the_fault(script, tmp_path_factory.mktemp(f"fsdp-{request.param}") / "run", fm)


def test_every_rank_records_its_shards(fsdp_run):
    fm, run_dir = fsdp_run
    run = ckptlab.open_run(run_dir)
    assert (run.world_size, run.ranks, run.manifest["layout"]) == (fm.WORLD, [0, 1], "sharded")
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(run.checkpoint(2).commit["files"])
    names = {p["name"] for p in run.manifest["parameters"]}
    assert "transformer.wte.weight" in names and not any("_fsdp" in n or n.startswith("module.") for n in names)


def test_one_process_replays_both_ranks_bit_exactly(fsdp_run):
    """`--world-size 1`: the DCP checkpoint loaded whole into FSDP2 over one process, each
    rank's turn reduced, their sum the mean of two (the same bits in either order), each rank's
    gradient norm measured on its recorded shard."""
    fm, run_dir = fsdp_run
    doc = replay_json(run_dir, fm.FAULT_STEP, "--from-step", "0", "--world-size", "1", "--budget", "0")
    assert doc["world_size"] == 1
    assert_replays_and_names_the_sample(doc, fm)


def _trainer(fsdp_version: int | None):
    """What the callback reads of a Trainer: whether its accelerator prepares FSDP, which."""
    if fsdp_version is None:
        return SimpleNamespace(is_fsdp_enabled=False)
    plugin = SimpleNamespace(fsdp_version=fsdp_version)
    return SimpleNamespace(is_fsdp_enabled=True, accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)))


def test_a_multi_process_trainer_run_under_fsdp1_records_nothing_and_says_so(tmp_path):
    """FSDP1's flat shards would be recorded in part, and its steps are not replayed."""
    cb = ckt.CkptlabCallback(tmp_path / "run", build_fn=hf_fsdp_models.build)
    cb.trainer = _trainer(1)  # attached (on_train_begin runs on a Trainer's rank)
    args = SimpleNamespace(world_size=2, max_steps=10, fsdp="full_shard", deepspeed=None)
    with pytest.warns(UserWarning, match=r"under FSDP1 is not supported \(FSDP2 is: transformers 5's default.*nothing"):
        cb.on_train_begin(args, None, None)
    assert cb.rec is None and not (tmp_path / "run").exists()
    assert ckt._fsdp_run(_trainer(2)) == "FSDP2" and ckt._fsdp_run(_trainer(None)) is None
    assert ckt._fsdp_run(SimpleNamespace(is_fsdp_xla_enabled=True)) == "XLA FSDP"
