"""The Adam path in the engine (algorithms/corrections.py ``AdamPath``; docs/methods.md#adam-and-adamw).

Two phases per bucket, decided by its step counter, which every rank counts alike:

* **dense** (the dense steps, and always for a bucket of ``dense_below`` tensors): the bucket is
  averaged densely; then every rank takes Adam's moments of the average (the same on every rank,
  so they stay identical) and the bucket's result is Adam's update m_hat / (sqrt(v_hat) + eps)
  (``dense_update``);
* **sparse** (afterwards): v stays as the dense steps left it, kept as its preconditioner
  1 / (sqrt(v_hat) + eps) (``Bucket.preconditioner``, taken once at the first sparse step, v then
  dropped: no square root or division per step); the rank's own m is updated from its own
  gradient and the preconditioned update is what the bucket accumulates into its residual
  (``sparse_momentum``, a ``Momentum`` with a ``Preconditioner`` that the accumulating backend ops
  and kernels take). The method selects from that as from any accumulated vector; the average of
  what is sent is the update.

m lives where the momentum correction keeps its velocity (``Bucket.momentum``), v in
``Bucket.second_moment``; checkpoints carry m and v or the preconditioner.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from ..algorithms.corrections import AdamPath
from ..backends import Backend, Momentum
from ..backends.base import Preconditioner
from . import patterns


def updates_before(step: int) -> int:
    """Adam updates made once the bucket's step ``step`` (0-based) is done: step + 1."""
    return step + 1


def sparse_momentum(backend: Backend, bucket: Any, path: AdamPath, dense_steps: int) -> Momentum:
    """The sparse phase's accumulation for ``bucket`` at its step ``bucket.step``: m from the rank's
    own gradient, the preconditioner of v as the ``dense_steps`` left it (taken now if not yet)."""
    if bucket.preconditioner is None:
        _ensure_moments(backend, bucket)
        dtype = backend.dtype_name(bucket.residual)
        ones = backend.from_numpy(np.ones(bucket.numel, dtype=dtype), like=bucket.residual)
        bucket.preconditioner = backend.precondition(ones, bucket.second_moment, 1.0,
                                                     path.second_scale(max(dense_steps, 1)), path.eps)
        bucket.second_moment = None   # what the sparse steps need of it is the preconditioner
    preconditioner = Preconditioner(bucket.preconditioner, path.first_scale(updates_before(bucket.step)),
                                    path.update_bound)
    return Momentum(bucket.momentum, path.beta1, preconditioner=preconditioner)


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
    """Undo a dense step's moments (``dense_update`` with ``keep_for_take_back``)."""
    if bucket.adam_before is not None:
        bucket.momentum, bucket.second_moment = bucket.adam_before
        bucket.adam_before = None


def _ensure_moments(backend: Backend, bucket: Any) -> None:
    for field in ("momentum", "second_moment"):
        if getattr(bucket, field) is None:
            setattr(bucket, field, backend.zeros(bucket.numel, backend.dtype_name(bucket.residual),
                                                 like=bucket.residual))
