"""Record runs that a framework drives: PyTorch Lightning and the Hugging Face Trainer.

    from ckptlab.integrations.lightning import CkptlabCallback          # pip install -e ".[lightning]"
    from ckptlab.integrations.transformers import CkptlabCallback       # pip install -e ".[transformers]"

Each integration records from the framework's own hooks through `Recorder.begin_step` /
`end_step`, and ships a module-level `training_step(model, optimizer, batch)` that performs
the framework's training step, so `ckptlab replay` re-runs exactly what the framework did.
The recorded "batch" of a step is a dict of what the framework's training step was called
with (see docs/integrations.md). Neither module imports its framework until it is used.
"""
