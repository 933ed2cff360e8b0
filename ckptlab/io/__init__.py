"""Read any checkpoint as a lazy name -> tensor mapping, safe by construction.

    from ckptlab.io import open_checkpoint
    sd = open_checkpoint("runs/exp1@5000")     # or a file, a sharded/DCP folder, a run dir
    sd.info("fc.weight").shape                 # look without reading
    w = sd["fc.weight"]                        # read one tensor (zero-copy from an mmap)

Formats (decided by content, not by name):
    .safetensors        header validated here; tensors are mmap views
    .pt .pth .bin       torch.load(weights_only=True, mmap=True) only
    sharded folder      model.safetensors.index.json / pytorch_model.bin.index.json
    DCP folder          torch.distributed.checkpoint, read without a process group
    RUN@STEP            a ckptlab run's checkpoint (sha256 verified); RUN@latest, RUN alone
Nested checkpoints ({"model": ..., "optimizer": ...}) yield the model's weights.

Safety: nothing is ever unpickled except by torch's weights_only loader (torch >= 2.10) or,
for DCP metadata, an allowlist unpickler; file names read from index/metadata files must stay
inside their folder; headers are validated before any tensor is read.
"""

from ckptlab.io.base import LazyStateDict, TensorRef, from_tensors
from ckptlab.io.open import open_checkpoint

__all__ = ["LazyStateDict", "TensorRef", "from_tensors", "open_checkpoint"]
