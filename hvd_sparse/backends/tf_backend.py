"""TensorFlow backend. The engine runs it eagerly (inside ``tf.py_function`` when the caller is a
graph), so these are plain eager TF ops on immutable tensors: every method returns a new tensor.

An eager op costs tens of microseconds whatever its size, so a bucket of many tensors is not
walked tensor by tensor here: the TensorFlow face flattens and concatenates a bucket's gradients
in its graph (``pack``), hands the engine a ``Packed`` bucket -- the tensors' specs, with that
vector -- and cuts the average back into tensors in the graph (``unpack``). The ops that take a
bucket's tensors (``accumulate``, ``tensors_finite``, ``split_like``) then work on the one vector:
the same TF ops on the same values, so the same bits (docs/architecture.md#tensorflow-face).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from .. import kernels
from .base import Backend
from .exact import (
    MAGNITUDE_KEYS,
    float32_norms,
    numpy_mean_std,
    sample_shape,
)

_FEW_SEGMENTS = 8   # segment_norms: up to this many segments, one reduction each


class Packed(list):
    """A bucket's tensors as the engine sees them from the TensorFlow face: a list of their
    ``tf.TensorSpec`` (shapes and dtypes: what the engine reads of each tensor) with ``flat``, the
    values of all of them flattened and concatenated in one vector of ``packed_dtype``. The
    backend's bucket ops read ``flat``; ``split_like`` returns a ``Packed`` whose ``flat`` is the
    average, which the face cuts into the tensors (``unpack``)."""

    def __init__(self, specs: Sequence[tf.TensorSpec], flat: tf.Tensor):
        super().__init__(specs)
        self.flat = flat


def packed_dtype(dtypes: Sequence[str]) -> str:
    """The dtype a bucket travels in, packed: the gradients' own when they share one, else the
    residual's (float64 if any is, else float32); every conversion into it is exact."""
    if len(set(dtypes)) == 1:
        return dtypes[0]
    return "float64" if "float64" in dtypes else "float32"


def pack(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """Graph ops: the tensors flattened and concatenated, in ``packed_dtype``."""
    dtype = packed_dtype([t.dtype.name for t in tensors])
    flats = [tf.cast(tf.reshape(t, [-1]), dtype) for t in tensors]
    return tf.concat(flats, axis=0) if len(flats) > 1 else flats[0]


def unpack(flat: tf.Tensor, specs: Sequence[tf.TensorSpec]) -> list[tf.Tensor]:
    """Graph ops: ``flat`` cut into tensors shaped as ``specs``, each cast to its spec's dtype
    (what ``Backend.split_like`` computes)."""
    sizes = [spec.shape.num_elements() for spec in specs]
    pieces = tf.split(flat, sizes) if len(sizes) > 1 else [flat]
    return [tf.cast(tf.reshape(piece, spec.shape), spec.dtype)
            for piece, spec in zip(pieces, specs, strict=True)]


def _column(idx) -> tf.Tensor:
    """Indices as the [k, 1] column the scatter ops take, in int32 or int64 as they come (both
    index the same entries; a conversion would be one more eager op per call, and a bucket step
    makes several such calls)."""
    idx = tf.convert_to_tensor(idx)
    if idx.dtype not in (tf.int32, tf.int64):
        idx = tf.cast(idx, tf.int64)
    return tf.reshape(idx, [-1, 1])


class TensorFlowBackend(Backend):
    """``Backend`` on TensorFlow tensors (immutable: every method returns a new tensor)."""

    name = "tensorflow"

    def accumulate(self, residual, tensors, clear_inputs=False, momentum=None):
        if not isinstance(tensors, Packed):
            return super().accumulate(residual, tensors, clear_inputs, momentum)
        if momentum is not None:
            out, momentum.buffer = self.momentum_accumulate(residual, momentum.buffer, tensors,
                                                            momentum.factor, momentum.nesterov)
        else:
            out = self.add(residual, tensors.flat)
        if clear_inputs:
            self.clear(tensors)
        return out

    def split_like(self, flat, tensors):
        if isinstance(tensors, Packed):
            return Packed(tensors, flat)
        return super().split_like(flat, tensors)

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

    def slice(self, x, lo, hi, step=1):
        return x[lo:hi:step]

    def numel(self, x):
        n = x.shape.num_elements()   # static: no op (a TensorSpec's too)
        return int(tf.size(x)) if n is None else n

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
        ops = kernels.tensorflow_ops()   # one read of x, sums of known depth (norms.cpp)
        done = None if ops is None else ops.segment_sums(x, list(lengths))
        starts = np.cumsum([0, *lengths]).tolist()
        if done is not None:
            return float32_norms(done[0], done[1], lambda i: x[starts[i]:starts[i + 1]].numpy())
        # Each segment's float64 sum of squares in one op; any summation order keeps a term
        # within the segment's length of roundings, the depth float32_norms is told.
        squares = tf.square(tf.cast(x, tf.float64))
        if len(lengths) <= _FEW_SEGMENTS:   # an op per segment, no segment ids
            sums = tf.stack([tf.reduce_sum(piece) for piece in tf.split(squares, list(lengths))])
        else:
            sums = tf.math.unsorted_segment_sum(squares, self._segment_ids(tuple(lengths)), len(lengths))
        return float32_norms(sums.numpy().tolist(), list(lengths),
                             lambda i: x[starts[i]:starts[i + 1]].numpy())

    def _segment_ids(self, lengths: tuple) -> tf.Tensor:
        """The segment of every entry (int32), built once per layout (the last few are kept)."""
        cache = self.__dict__.setdefault("_ids", {})
        if lengths not in cache:
            if len(cache) >= 4:
                cache.pop(next(iter(cache)))
            cache[lengths] = tf.constant(np.repeat(np.arange(len(lengths), dtype=np.int32), lengths))
        return cache[lengths]

    def all_finite(self, x):
        return bool(tf.reduce_all(tf.math.is_finite(x)))

    def mean_std(self, x):
        # in NumPy: TensorFlow flushes subnormal values to zero, which would change the sums
        return numpy_mean_std(tf.cast(x, tf.float64).numpy() if x.dtype == tf.bfloat16 else x.numpy())

    def tensors_finite(self, tensors):
        if isinstance(tensors, Packed):   # one vector: the same verdict (a sum is finite iff...)
            tensors = [tensors.flat]
        total = tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in tensors])
        if bool(tf.math.is_finite(total)):
            return True
        # an overflowing sum is not enough
        return all(bool(tf.reduce_all(tf.math.is_finite(t))) for t in tensors)

    def topk_abs_indices(self, x, k):
        x = tf.reshape(x, [-1])
        ops = kernels.tensorflow_ops()   # the CPU kernel as a TensorFlow op (kernels/tf_ops.py)
        selected = ops.topk_abs(x, k) if ops is not None else None
        if selected is not None:
            return selected
        if k >= self.numel(x):
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
        if candidates.shape[0] == k:   # no tie is cut: the usual case
            return candidates
        above = tf.reshape(tf.where(keys > kth), [-1])
        tied = tf.reshape(tf.where(keys == kth), [-1])[: k - above.shape[0]]   # ties: lowest indices
        merged = tf.concat([above, tied], axis=0)
        return -tf.math.top_k(-merged, k, sorted=True).values   # ascending

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
        column = _column(idx)
        count = [column.shape[0]] if column.shape[0] is not None else tf.shape(column)[:1]
        return tf.tensor_scatter_nd_update(x, column, tf.zeros(count, dtype=x.dtype))

    def put(self, x, idx, values):
        return tf.tensor_scatter_nd_update(x, _column(idx), tf.cast(values, x.dtype))

    def scatter(self, n, idx, values, like=None):
        return tf.scatter_nd(_column(idx), values, [n])

    def unique(self, idx):
        return tf.sort(tf.unique(idx).y)

    def arange(self, lo, hi, like=None):
        return tf.range(lo, hi, dtype=tf.int64)
