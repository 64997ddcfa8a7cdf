"""The Adam path in the engine (algorithms/corrections.py ``AdamPath``; docs/methods.md#adam-and-adamw).

Two phases per bucket, decided by its step counter, which every rank counts alike:

* **dense** (the dense steps, and always for a bucket of ``dense_below`` tensors): the bucket is
  averaged densely; then every rank takes Adam's moments of the average (the same on every rank,
  so they stay identical) and the bucket's result is Adam's update m_hat / (sqrt(v_hat) + eps)
  (``dense_update``);
* **sparse** (afterwards): each rank carries both moments on from its own gradient and
  accumulates its own clamped update into its residual (``sparse_momentum``: a ``Momentum`` with
  a ``SecondMoment``, which the accumulating backend ops and kernels take). The method selects
  from that as from any accumulated vector; the average of what is sent is the update.

With ``second_moment_refresh`` = K the sparse phase's v is shared: on its first step and every K-th
after, the raw gradient is also allreduced (``refresh_second_moment``) and every rank refreshes v
from that average alike; in between v is only read (``SecondMoment.frozen``).

m lives where the momentum correction keeps its velocity (``Bucket.momentum``), v in
``Bucket.second_moment``; checkpoints carry both.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from ..algorithms.base import StepContext
from ..algorithms.corrections import AdamPath, Corrections
from ..backends import Backend, Momentum
from ..backends.base import SecondMoment
from ..comm import ALLREDUCE, Collective, Protocol
from . import patterns


def updates_before(step: int) -> int:
    """Adam updates made once the bucket's step ``step`` (0-based) is done: step + 1."""
    return step + 1


def sparse_momentum(backend: Backend, bucket: Any, corrections: Corrections) -> Momentum:
    """The sparse phase's accumulation for ``bucket`` at its step ``bucket.step``: m (and, unless
    shared, v) carried on from the rank's own gradient, m's bias correction that of update
    ``bucket.step + 1``, v's that of the steps it stands for."""
    path = corrections.adam
    _ensure_moments(backend, bucket)
    updates = updates_before(bucket.step)
    shared = bool(corrections.second_moment_refresh)
    counted = corrections.second_moment_updates(bucket.step) if shared else updates
    second = SecondMoment(bucket.second_moment, path.beta2, path.first_scale(updates),
                          path.second_scale(counted), path.eps, path.update_bound, frozen=shared)
    return Momentum(bucket.momentum, path.beta1, second=second)


def refresh_second_moment(backend: Backend, bucket: Any, tensors: list[Any], ctx: StepContext,
                          corrections: Corrections, nonfinite: str) -> Protocol:
    """Protocol: the shared v refreshed from the dense average a of this step's raw gradient, on
    every rank alike: v <- b2^K·v + (1 - b2^K)·a², one sample standing for the K steps until
    the next (``second_moment_refresh`` = K). A sum that is not finite, the same on every rank,
    leaves v as it was: a rank's NaN/Inf reaches it as it is, except under ``nonfinite="skip"``,
    where that rank sends zeros (the only policy that needs a look at the gradient here). The
    step's context (``sparse_momentum``) already holds both moments. Returns the bytes the
    allreduce put in (and took out)."""
    b, dtype = backend, backend.dtype_name(bucket.residual)
    grad = b.accumulate(b.zeros(bucket.numel, dtype, like=bucket.residual), tensors)
    if nonfinite == "skip" and not b.all_finite(grad):
        grad = b.zeros(bucket.numel, dtype, like=bucket.residual)
    (total,) = yield [Collective(ALLREDUCE, f"{ctx.name}.v", grad)]
    if b.all_finite(total):
        if nonfinite == "raise":   # what take_back restores, should another bucket abort the step
            bucket.adam_before = (None, b.copy(bucket.second_moment))
        keep = corrections.adam.beta2 ** corrections.second_moment_refresh
        average = b.scale(total, 1.0 / ctx.size)
        square = b.multiply(average, average)   # in place where the backend can: a is not read again
        bucket.second_moment = b.add(b.scale(bucket.second_moment, keep), b.scale(square, 1.0 - keep))
        ctx.momentum.second.buffer = bucket.second_moment   # what this step's accumulation reads
    return bucket.numel * patterns.ITEMSIZE[dtype]


def dense_update(backend: Backend, bucket: Any, out: patterns.Exchanged, path: AdamPath,
                 keep_for_take_back: bool) -> patterns.Exchanged:
    """``out`` of a dense step with its average replaced by Adam's update of it; m and v updated
    (their old values kept in ``bucket.adam_before`` when the step may be taken back)."""
    _ensure_moments(backend, bucket)
    if keep_for_take_back:
        bucket.adam_before = (backend.copy(bucket.momentum), backend.copy(bucket.second_moment))
    t = updates_before(bucket.step - 1)   # _observe has counted this step already
    dtype = backend.dtype_name(bucket.residual)
    average = backend.cast(out.average, dtype)
    update, bucket.momentum, bucket.second_moment = backend.adam_update(
        average, bucket.momentum, bucket.second_moment, path.beta1, path.beta2, path.first_scale(t),
        path.second_scale(t), path.eps)
    return replace(out, average=backend.cast(update, "float32"))


def take_back(bucket: Any) -> None:
    """Undo a dense step's moments (``dense_update`` with ``keep_for_take_back``), or a refresh's
    v (``refresh_second_moment``, which keeps no m: the sparse step's m stays with its residual)."""
    if bucket.adam_before is not None:
        momentum, bucket.second_moment = bucket.adam_before
        if momentum is not None:
            bucket.momentum = momentum
        bucket.adam_before = None


def saved_second_moment(saved: dict, path: AdamPath | None, dense_steps: int) -> np.ndarray | None:
    """v of a saved bucket: its ``second_moment``, or, in a file of the frozen second moment this
    path had before, v recovered from the preconditioner p = 1 / (sqrt(v * c2) + eps) that the
    ``dense_steps`` left: v = (1/p - eps)^2 / c2."""
    if saved.get("second_moment") is not None or saved.get("preconditioner") is None or path is None:
        return saved.get("second_moment")
    inverse = np.asarray(saved["preconditioner"], dtype=np.float64)
    root = np.maximum(1.0 / inverse - path.eps, 0.0)
    return root * root / path.second_scale(max(dense_steps, 1))


def _ensure_moments(backend: Backend, bucket: Any) -> None:
    for field in ("momentum", "second_moment"):
        if getattr(bucket, field) is None:
            setattr(bucket, field, backend.zeros(bucket.numel, backend.dtype_name(bucket.residual),
                                                 like=bucket.residual))
