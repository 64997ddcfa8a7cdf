"""Eager TensorFlow helpers shared by the TensorFlow backend and the op wrappers
(hvd_sparse/kernels/tf_ops.py).

A per-tensor step makes a few eager calls per gradient on tens of small tensors, where
TensorFlow's Python dispatch costs more than the kernels: a ``tf.constant`` vector about 10 us,
``tf.gather`` 32 us against 10 us for the same ``GatherV2`` through ``tf.raw_ops``. Constants are
therefore made once per value; the hot ops go through ``tf.raw_ops``, the same kernels.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

_CONSTANTS: dict = {}
_KEPT = 512   # constants kept at most (the oldest go first)


def constant(value, dtype: tf.DType) -> tf.Tensor:
    """``tf.constant(value, dtype)`` (a scalar or a vector), made once per value when eager: the
    key is the value's bytes in ``dtype``, so -0.0 and 0.0 or 1 and 1.0 of another dtype never
    share a tensor."""
    array = np.asarray(value, dtype=dtype.as_numpy_dtype)
    if not tf.executing_eagerly():
        return tf.constant(array, dtype)
    key = (dtype, array.shape, array.tobytes())
    found = _CONSTANTS.get(key)
    if found is None:
        if len(_CONSTANTS) >= _KEPT:
            _CONSTANTS.pop(next(iter(_CONSTANTS)))
        found = _CONSTANTS[key] = tf.constant(array, dtype)
    return found
