"""Why a recorded fault did not reproduce: replay the first step that left the record twice,
hashing every op's output, and compare the two replays op for op.

    check = check_divergence(inv, start, step)     # step: the first replayed step off the record
    check.replays_agree, check.first_nondeterministic_op

- The two replays differ: the first op whose output differs (same state, same batch, same
  RNG states in) is nondeterministic -- a kernel that is (atomics, a non-deterministic
  algorithm), or one that reads something the recording does not hold (an unseeded
  generator, the clock): replays, and the record, cannot be expected to match.
- They agree with each other, op for op and bit for bit, but not with the record: replay is
  deterministic, so what was recorded came from another state or another computation -- the
  state changed outside the recorded computation (a hardware or memory error, or code
  outside `step_fn` that changed the model, the optimizer or the data).

Each replay is traced (trace.py) with a watcher that hashes each op's outputs (blake2b of
their bytes, dtype and shape) without being traced itself, so op N of one replay is op N of
the other.
"""

from __future__ import annotations

import hashlib

import torch
from torch.utils._pytree import tree_flatten

from ckptlab.numbers import LOSS_NOT_KNOWN, precise, same, same_loss
from ckptlab.replayer.findings import DivergenceCheck
from ckptlab.replayer.rootstep import RootStep
from ckptlab.replayer.trace import OpEvent, Tracer
from ckptlab.training.world import local


class OpHasher:
    """A Tracer's watcher: one digest per traced op, of all its tensor outputs."""

    def __init__(self) -> None:
        self.tracer: Tracer | None = None  # set once the Tracer watching with this hasher is built
        self.digests: list[bytes] = []

    def before_op(self, index: int, name: str, flat_in: list) -> None:
        pass

    def after_op(self, ev: OpEvent, flat_in: list, out) -> None:
        assert self.tracer is not None  # only a running Tracer calls this
        with self.tracer.pause(), torch.no_grad():
            self.digests.append(digest(out))


def digest(out) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for t in tree_flatten(out)[0]:
        if not isinstance(t, torch.Tensor):
            continue
        t = local(t)
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        if t.layout == torch.strided and t.device.type != "meta" and t.numel():
            # Bytes, not values: -0.0 vs 0.0 and NaN payloads count, as they do for "bit for bit".
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.digest()


def check_divergence(inv, step: int) -> DivergenceCheck:
    """Replay `step` twice from the state it started in (investigation.py's `root_at`) and
    compare the replays with each other, op by op, and with the record."""
    inv.log(f"replaying step {step} twice, hashing every op, to see why it left the record")
    blame = RootStep(inv, inv.root_at(step))
    runs = []
    try:
        for _ in range(2):
            hasher = OpHasher()
            model, optimizer = blame.runner.model, blame.runner.optimizer
            hasher.tracer = tracer = Tracer(model, optimizer, rows=blame.rows, batch=blame.rec.batch, watch=hasher)
            health = blame.step(tracer=tracer)
            runs.append((tracer, hasher.digests, health))
    finally:
        blame.close()
    (t1, d1, h1), (t2, d2, h2) = runs
    i = first_difference(t1.events, d1, t2.events, d2)
    m = inv.metrics
    k = m.index(step)
    recorded = m.loss_at(k)
    check = DivergenceCheck(
        step=step,
        replays_agree=i is None and same_loss(h1.loss, h2.loss) and same(h1.grad_norm, h2.grad_norm),
        ops_compared=min(len(d1), len(d2)),
        losses=[h1.loss, h2.loss],
        recorded_loss=recorded,
    )
    if i is not None:
        a = t1.events[i] if i < len(t1.events) else None
        b = t2.events[i] if i < len(t2.events) else None
        ev = a or b
        assert ev is not None  # i is within the longer replay's ops
        check.first_nondeterministic_op = {
            "index": i,
            "op": ev.op,
            "phase": ev.phase,
            "module": ev.module,
            "call": ev.call,
            "source": ev.source,
        }
        if a is None or b is None or a.op != b.op:
            check.detail = (
                f"the two replays ran different ops from op {i} ({a.op if a else 'none'} vs {b.op if b else 'none'}): "
                "the step's control flow depends on something the recording does not hold"
            )
        else:
            check.detail = f"op {i} ({ev.where()}) gave different outputs from the same state and inputs"
    elif not check.replays_agree:
        check.detail = "every op agreed, but the step's loss or gradient norm did not (outside the traced ops)"
    else:
        check.detail = (
            f"both replays agree op for op ({check.ops_compared} ops, bit for bit) but not with the record "
            f"(loss {precise(h1.loss, LOSS_NOT_KNOWN)}, recorded "
            f"{'n/a' if k is None else LOSS_NOT_KNOWN if recorded is None else recorded})"
        )
    if t1.truncated:
        check.detail += f"; only the first {t1.max_events} ops were compared"
    return check


def first_difference(e1: list[OpEvent], d1: list[bytes], e2: list[OpEvent], d2: list[bytes]) -> int | None:
    """The index of the first op that differs in name or output between two traced replays
    (one running out of ops counts), or None."""
    for i, (a, b, x, y) in enumerate(zip(e1, e2, d1, d2)):
        if a.op != b.op or x != y:
            return i
    return None if len(d1) == len(d2) else min(len(d1), len(d2))
