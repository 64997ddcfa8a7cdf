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

m lives where the momentum correction keeps its velocity (``Bucket.momentum``), v in
``Bucket.second_moment``; checkpoints carry both.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from ..algorithms.corrections import AdamPath
from ..backends import Backend, Momentum
from ..backends.base import SecondMoment
from . import patterns


def updates_before(step: int) -> int:
    """Adam updates made once the bucket's step ``step`` (0-based) is done: step + 1."""
    return step + 1


def sparse_momentum(backend: Backend, bucket: Any, path: AdamPath) -> Momentum:
    """The sparse phase's accumulation for ``bucket`` at its step ``bucket.step``: m and v carried
    on from the rank's own gradient, their bias corrections those of update ``bucket.step + 1``."""
    _ensure_moments(backend, bucket)
    updates = updates_before(bucket.step)
    second = SecondMoment(bucket.second_moment, path.beta2, path.first_scale(updates),
                          path.second_scale(updates), path.eps, path.update_bound)
    return Momentum(bucket.momentum, path.beta1, second=second)


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
