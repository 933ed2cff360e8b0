"""Regenerate the bundled sample run: sample_ckpts/tinylm-nan.

A tiny GPT-style LM (ckptlab/examples/tiny_lm.py) trains on a synthetic corpus of 100,000
documents; one document, scheduled into row 5 of the batch of step 5431, is empty (the data
pipeline's bug). Its attention rows are fully masked and the softmax returns NaN. The loss of
step 5431 stays finite (an empty row has no targets) but its gradients are NaN, the update
makes the weights NaN, and the loss goes NaN at step 5432: the Recorder records that step and
raises NonFiniteLoss.

Deterministic (fixed seeds, one thread); a few MB on disk; about a minute on a laptop CPU.
Recorded with `ckptlab.portable_cpu()` (ATen, MKL and oneDNN pinned to their AVX2 kernels), so
that it replays bit-exactly on any x86-64 CPU with AVX2; `--native` records with this CPU's own
kernels instead (what docs/performance.md compares).

    python scripts/make_sample_run.py [--out sample_ckpts/tinylm-nan] [--native]
    ckptlab replay --run sample_ckpts/tinylm-nan --step 5432
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import ckptlab  # torch-free: the kernels can still be pinned

if "--native" not in sys.argv:
    ckptlab.portable_cpu()  # before torch loads: it reads the kernel choice once

import torch  # noqa: E402

from ckptlab.examples import tiny_lm  # noqa: E402

CORPUS = 100_000
BATCH = 8
FAULT_STEP, FAULT_ROW = 5431, 5  # the loss goes NaN one step later


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "sample_ckpts" / "tinylm-nan"))
    ap.add_argument("--native", action="store_true", help="this CPU's own kernels, not the portable AVX2 ones")
    args = ap.parse_args()
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    torch.set_num_threads(1)

    order = torch.randperm(CORPUS, generator=torch.Generator().manual_seed(0))  # the sampler
    empty_doc = int(order[FAULT_STEP * BATCH + FAULT_ROW])

    def load(doc_id: int) -> torch.Tensor:
        if doc_id == empty_doc:
            return torch.full((tiny_lm.CTX + 1,), tiny_lm.PAD, dtype=torch.long)  # the dirty sample
        return tiny_lm.document(doc_id)

    model, optimizer, scheduler = tiny_lm.build()
    rec = ckptlab.Recorder(
        out,
        model,
        optimizer,
        scheduler=scheduler,
        step_fn=tiny_lm.step,
        build_fn=tiny_lm.build,
        ckpt_every=500,
        keep_last=2,
        health_every=25,
        data_info={"pad_id": tiny_lm.PAD, "vocab_size": tiny_lm.VOCAB},
    )
    val_ids = list(range(CORPUS, CORPUS + 64))
    with rec:
        for n in range(FAULT_STEP + 2):
            ids = order[n * BATCH : (n + 1) * BATCH].tolist()
            batch = {"ids": torch.stack([load(i) for i in ids])}
            try:
                rec.step(batch, sample_ids=ids)
            except ckptlab.NonFiniteLoss as e:
                print(f"{e}", file=sys.stderr)
                break
            if (n + 1) % 500 == 0:
                with torch.no_grad():
                    model.eval()
                    v = torch.stack([tiny_lm.document(i) for i in val_ids])
                    logits = model(v[:, :-1])
                    tgt = v[:, 1:].masked_fill(v[:, 1:] == tiny_lm.PAD, -100)
                    val = torch.nn.functional.cross_entropy(
                        logits.reshape(-1, tiny_lm.VOCAB), tgt.reshape(-1), ignore_index=-100
                    )
                    model.train()
                rec.log_validation(val_loss=float(val))
                print(f"step {n}: val_loss {float(val):.4f}", file=sys.stderr)
    print(f"wrote {out} (empty document {empty_doc} at step {FAULT_STEP}, row {FAULT_ROW})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
