"""Record runs that a framework drives: PyTorch Lightning and the Hugging Face Trainer; loops
written with accelerate or Lightning Fabric; trainers that own their loop.

    from ckptlab.integrations.lightning import CkptlabCallback          # pip install -e ".[lightning]"
    from ckptlab.integrations.transformers import CkptlabCallback       # pip install -e ".[transformers]"
    from ckptlab.integrations import accelerate                          # accelerate.record(...)
    from ckptlab.integrations import fabric                              # fabric.record(...)
    from ckptlab.integrations import owned_loop                          # owned_loop.record(...)

Each integration records from the framework's own hooks through `Recorder.begin_step` /
`end_step`. The framework ones (and the accelerate and Fabric loops') ship a module-level
`training_step(model, optimizer, batch)` that performs the framework's training step (the
accelerate and Fabric ones: the loop's own body, on each micro-batch), so `ckptlab replay`
re-runs exactly what the framework did; the recorded "batch" of a step is a dict of what that
step was called with (see docs/integrations.md). A trainer that owns its loop is replayed with the user's `step_fn`. No
module imports its framework until it is used.
"""
