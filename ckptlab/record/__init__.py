"""Recorder: the sampler that drives one training step and records what replay needs.

    model, opt = build()
    rec = ckptlab.Recorder("runs/exp1", model, opt, step_fn=step, build_fn=build, ckpt_every=500)
    for ids, batch in loader:                    # loader over ckptlab.with_sample_ids(dataset)
        loss = rec.step(batch, sample_ids=ids)   # records, runs step(), returns the loss
        if rec.next_step % 1000 == 0:
            rec.log_validation(val_loss=evaluate(model))
    rec.close()                                  # or: with ckptlab.Recorder(...) as rec:

One `rec.step(batch)` for step n:
  1. at a checkpoint step (n % ckpt_every == 0, and the first step of every session): copy the
     training state off the device and commit it in the background (snapshots.py,
     run/checkpoint.py);
  2. append the batch, its sample ids and the RNG states the step starts in (only when they
     changed since the end of the previous step: batches.py) -- before running the step, so a
     step that crashes the process still has its batch;
  3. run `step_fn(model, optimizer, batch)` measured, then `scheduler.step()`: the same
     sequence replay runs (training/step.py);
  4. append the step's health (loss, grad norms, lr, update ratios, ...) and any anomaly
     (health.py);
  5. on a non-finite loss, raise NonFiniteLoss (after recording), unless on_nonfinite="record".

Where the health is read (`health_read`): "immediate" reads it as the step ends (a device
sync on a GPU); "deferred" reads step n's health when step n+1 ends, so nothing in a recorded
step waits for the GPU: the health of step n is appended (and NonFiniteLoss raised) at the end
of step n+1, before a checkpoint, at `log_validation`, `flush`, `close` and at interpreter
exit. "auto" (default) defers on a CUDA model and reads at once on the CPU (where reading a
tensor costs no sync). When `rec.step()` returns, the step's batch and (immediate) health, or
the previous step's health (deferred), are in the kernel's hands: a SIGKILL from then on
cannot lose them.

From its start until `close()` the Recorder holds the run's lock (RUN/.lock, run/lock.py; in a
distributed run, rank 0's Recorder): a second Recorder on the run, or a rollback, is refused
with RunLockedError naming this process (session.py).

The package's parts: config.py (RecordConfig), session.py (the run directory, its lock and
manifest, resuming), batches.py, health.py, snapshots.py, and recorder.py (the Recorder, which
says when each part acts within a step). Its messages go to the `ckptlab.record.*` loggers.
"""

from ckptlab.record.config import RecordConfig
from ckptlab.record.recorder import Recorder

__all__ = ["RecordConfig", "Recorder"]
