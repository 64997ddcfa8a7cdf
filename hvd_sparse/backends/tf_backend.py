"""TensorFlow backend. The engine runs it eagerly (inside ``tf.py_function`` when the caller is a
graph), so these are plain eager TF ops on immutable tensors: every method returns a new tensor."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from .base import Backend
from .exact import (
    MAGNITUDE_KEYS,
    float32_norms,
    numpy_mean_std,
    sample_shape,
)


class TensorFlowBackend(Backend):
    """``Backend`` on TensorFlow tensors (immutable: every method returns a new tensor)."""

    name = "tensorflow"

    def zeros(self, n, dtype="float32", like=None):
        return tf.zeros([n], dtype=dtype)

    def from_numpy(self, array, like=None):
        return tf.convert_to_tensor(np.asarray(array))

    def to_numpy(self, x):
        return x.numpy()

    def copy(self, x):
        return tf.identity(x)

    def flat(self, x):
        return tf.reshape(x, [-1])

    def reshape(self, x, shape):
        return tf.reshape(x, shape)

    def concat(self, xs):
        return tf.concat(xs, axis=0) if len(xs) != 1 else xs[0]

    def slice(self, x, lo, hi):
        return x[lo:hi]

    def numel(self, x):
        return int(tf.size(x))

    def dtype_name(self, x):
        return x.dtype.name

    def cast(self, x, dtype):
        return tf.cast(x, dtype)

    def add(self, acc, x):
        return acc + tf.cast(x, acc.dtype)

    def scale(self, x, factor):
        return x * tf.constant(factor, dtype=x.dtype)

    def abs(self, x):
        return tf.abs(x)

    def sum_of_squares(self, x):
        x64 = tf.cast(x, tf.float64)
        return float(tf.reduce_sum(x64 * x64))

    def segment_norms(self, x, lengths):
        squares = tf.square(tf.cast(x, tf.float64))
        ragged = tf.RaggedTensor.from_row_lengths(squares, tf.constant(list(lengths), dtype=tf.int64))
        starts = np.cumsum([0, *lengths]).tolist()
        return float32_norms(tf.reduce_sum(ragged, axis=1).numpy().tolist(), list(lengths),
                             lambda i: x[starts[i]:starts[i + 1]].numpy())

    def all_finite(self, x):
        return bool(tf.reduce_all(tf.math.is_finite(x)))

    def mean_std(self, x):
        # in NumPy: TensorFlow flushes subnormal values to zero, which would change the sums
        return numpy_mean_std(tf.cast(x, tf.float64).numpy() if x.dtype == tf.bfloat16 else x.numpy())

    def tensors_finite(self, tensors):
        total = tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in tensors])
        if bool(tf.math.is_finite(total)):
            return True
        # an overflowing sum is not enough
        return all(bool(tf.reduce_all(tf.math.is_finite(t))) for t in tensors)

    def topk_abs_indices(self, x, k):
        x = tf.reshape(x, [-1])
        if k >= int(tf.size(x)):
            return tf.range(tf.size(x, out_type=tf.int64), dtype=tf.int64)
        if k <= 0:
            return tf.zeros([0], dtype=tf.int64)
        int_dtype, mask, nan_key = MAGNITUDE_KEYS[x.dtype.name]
        keys = tf.minimum(tf.bitwise.bitwise_and(tf.bitcast(x, int_dtype), tf.constant(mask, int_dtype)),
                          tf.constant(nan_key, int_dtype))
        if int_dtype == "int16":   # top_k has no int16 kernel; int32 keeps the order
            keys = tf.cast(keys, tf.int32)
        kth = tf.math.top_k(keys, k, sorted=True).values[k - 1]   # the k-th largest key
        candidates = tf.reshape(tf.where(keys >= kth), [-1])       # ascending
        chosen = tf.gather(keys, candidates)
        tied = chosen == kth
        need = k - int(tf.math.count_nonzero(chosen > kth))
        keep = tf.logical_or(~tied, tf.cumsum(tf.cast(tied, tf.int64)) <= need)   # ties: lowest indices
        return tf.boolean_mask(candidates, keep)

    def indices_where_at_least(self, x, threshold, offset=0):
        idx = tf.reshape(tf.where(x >= tf.constant(threshold, dtype=x.dtype)), [-1])
        return idx + offset if offset else idx

    def count_at_least(self, x, thresholds, every=1):
        n = int(tf.size(x))
        shape = sample_shape(n, every)
        sample = x if shape is None else tf.reshape(x[: shape[0] * shape[1]], shape)[::every]
        size = int(tf.size(sample))
        counts = [tf.math.count_nonzero(sample >= tf.constant(t, dtype=x.dtype)) for t in thresholds]
        return [float(c) * n / size for c in tf.stack(counts).numpy()]

    def count_in_ranges(self, idx, bounds):
        inner = tf.constant(np.asarray(bounds)[1:-1], dtype=tf.int64)
        which = tf.searchsorted(inner, tf.cast(idx, tf.int64), side="right")
        counts = tf.math.bincount(tf.cast(which, tf.int32), minlength=len(bounds) - 1, dtype=tf.int64)
        return counts.numpy().astype(np.int64)

    def take(self, x, idx):
        return tf.gather(x, idx)

    def zero_at(self, x, idx):
        return tf.tensor_scatter_nd_update(x, tf.reshape(tf.cast(idx, tf.int64), [-1, 1]),
                                           tf.zeros(tf.shape(idx), dtype=x.dtype))

    def put(self, x, idx, values):
        return tf.tensor_scatter_nd_update(x, tf.reshape(tf.cast(idx, tf.int64), [-1, 1]),
                                           tf.cast(values, x.dtype))

    def scatter(self, n, idx, values, like=None):
        return tf.scatter_nd(tf.reshape(tf.cast(idx, tf.int64), [-1, 1]), values,
                             tf.constant([n], dtype=tf.int64))

    def unique(self, idx):
        return tf.sort(tf.unique(idx).y)

    def arange(self, lo, hi, like=None):
        return tf.range(lo, hi, dtype=tf.int64)
