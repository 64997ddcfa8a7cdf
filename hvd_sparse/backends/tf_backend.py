"""TensorFlow backend. The engine runs it eagerly (inside ``tf.py_function`` when the caller is a
graph), so these are plain eager TF ops on immutable tensors: every method returns a new tensor.

An eager op costs tens of microseconds whatever its size, so a bucket of many tensors is not
walked tensor by tensor here: the TensorFlow face hands the engine a ``Packed`` bucket -- the
tensors' specs, with the tensors themselves flattened (``parts``) -- and gets back a ``Packed``
average whose parts it shapes into the tensors (``unpack``). The op library's kernels read and
write the parts directly; the reference ops work on their concatenation (``Packed.flat``, made
on first use): the same TF ops on the same values, so the same bits
(docs/architecture.md#tensorflow-face).

With the op library (hvd_sparse/kernels/tf_ops.py), the ops that take the residual or the velocity first
(``accumulate``, ``accumulate_select``, ``zero_at``, ``put``) write it in place, as the torch
backend does: a new tensor the size of the model every step would cost its page faults, which
on a virtual machine took longer than the arithmetic. Only a tensor this backend owns is written
so (``_own``: one it made with ``zeros`` or ``copy``, or one of those ops returned); any other
first argument is copied first, so a caller's tensor is never changed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from .. import kernels
from .base import Backend
from .contract import Selected
from .exact import (
    MAGNITUDE_KEYS,
    float32_norms,
    numpy_mean_std,
    sample_shape,
)
from .tf_eager import constant

_FEW_SEGMENTS = 8   # segment_norms: up to this many segments, one reduction each
_OWNED = "_hvd_sparse_owned"


def _own(x: tf.Tensor) -> tf.Tensor:
    """x, marked as a tensor only this backend holds, which its in-place ops may write."""
    setattr(x, _OWNED, True)
    return x


def _owned(x) -> bool:
    return getattr(x, _OWNED, False) and tf.executing_eagerly()


def _inputs(tensors) -> list:
    return tensors.parts if isinstance(tensors, Packed) else list(tensors)


class Packed(list):
    """A bucket's tensors as the engine sees them from the TensorFlow face: a list of their
    ``tf.TensorSpec`` (shapes and dtypes: what the engine reads of each tensor) with ``parts``,
    the tensors' values in their own shapes and dtypes (the kernels read them flat; no eager
    reshape per tensor). ``flat`` is their concatenation in ``packed_dtype``, made when a
    reference op first needs it."""

    def __init__(self, specs: Sequence[tf.TensorSpec], parts: Sequence[tf.Tensor]):
        super().__init__(specs)
        self.parts = list(parts)
        self._flat: tf.Tensor | None = None

    @property
    def flat(self) -> tf.Tensor:
        if self._flat is None:
            self._flat = pack(self.parts)
        return self._flat


def packed_dtype(dtypes: Sequence[str]) -> str:
    """The dtype a bucket's ``flat`` is in: the gradients' own when they share one, else the
    residual's (float64 if any is, else float32); every conversion into it is exact."""
    if len(set(dtypes)) == 1:
        return dtypes[0]
    return "float64" if "float64" in dtypes else "float32"


def pack(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """The tensors flattened and concatenated, in ``packed_dtype``."""
    dtype = packed_dtype([t.dtype.name for t in tensors])
    flats = [tf.cast(tf.reshape(t, [-1]), dtype) for t in tensors]
    return tf.concat(flats, axis=0) if len(flats) > 1 else flats[0]


def unpack(parts: Sequence[tf.Tensor], specs: Sequence[tf.TensorSpec]) -> list[tf.Tensor]:
    """Graph ops: ``parts`` shaped as ``specs``, each cast to its spec's dtype (what
    ``Backend.split_like`` computes)."""
    return [tf.cast(tf.reshape(piece, spec.shape), spec.dtype)
            for piece, spec in zip(parts, specs, strict=True)]


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
        done = self._fused(residual, tensors, 0, 0, 0.0, (), 1, "int64", False, momentum)
        if done is not None:
            return done.acc
        if not isinstance(tensors, Packed):
            return super().accumulate(residual, tensors, clear_inputs, momentum)
        if momentum is not None and momentum.second is not None:
            out, momentum.buffer = self.adam_accumulate(residual, momentum, tensors)
        elif momentum is not None:
            out, momentum.buffer = self.momentum_accumulate(residual, momentum.buffer, tensors,
                                                            momentum.factor, momentum.nesterov)
        else:
            out = self.add(residual, tensors.flat)
        if clear_inputs:
            self.clear(tensors)
        return out

    def accumulate_select(self, residual, tensors, lo, hi, threshold, probes=(), every=1,
                          index_dtype="int64", clear_inputs=False, check_finite=False, momentum=None):
        done = self._fused(residual, tensors, lo, hi, threshold, probes, every, index_dtype,
                           check_finite, momentum)
        if done is not None:
            return done
        return super().accumulate_select(residual, tensors, lo, hi, threshold, probes, every,
                                         index_dtype, clear_inputs, check_finite, momentum)

    def _fused(self, residual, tensors, lo, hi, threshold, probes, every, index_dtype, check_finite,
               momentum) -> Selected | None:
        """The op library's one-pass accumulate-and-select, writing the residual and the velocity
        in place when this backend owns them; None without a kernel. (``clear_inputs`` is moot:
        TensorFlow's inputs are never written.)"""
        ops = kernels.tensorflow_ops()
        if ops is None or (momentum is not None and momentum.second is not None):
            return None
        velocity = None if momentum is None else momentum.buffer
        in_place = _owned(residual) and (velocity is None or _owned(velocity))
        done = ops.accumulate_select(residual, _inputs(tensors), lo, hi, threshold, list(probes), every,
                                     index_dtype, check_finite, velocity,
                                     0.0 if momentum is None else momentum.factor,
                                     momentum is not None and momentum.nesterov, in_place)
        if done is None:
            return None
        acc, velocity, idx, counts, finite = done
        if not finite:   # nothing written: the inputs themselves came back
            return Selected(residual, None, [], False)
        if momentum is not None:
            momentum.buffer = _own(velocity)
        return Selected(_own(acc), idx, counts, True)

    def select_at_least(self, x, lo, hi, threshold, probes=(), every=1):
        ops = kernels.tensorflow_ops()   # one read, no |x| of x's size (hvd_sparse/kernels/tf_ops.py)
        done = None if ops is None else ops.select_at_least(x, lo, hi, threshold, list(probes), every)
        if done is not None:
            return done
        return super().select_at_least(x, lo, hi, threshold, probes, every)

    def sampled_threshold_select(self, x, segments, band):
        ops = kernels.tensorflow_ops()   # one op call, where each step was an eager op
        done = None if ops is None else ops.sampled_threshold_select(x, list(segments), band)
        return super().sampled_threshold_select(x, segments, band) if done is None else done

    def split_like(self, flat, tensors):
        if isinstance(tensors, Packed):
            return Packed(tensors, tf.split(flat, [spec.shape.num_elements() for spec in tensors]))
        return super().split_like(flat, tensors)

    def scatter_split(self, n, idx, values, tensors, like=None):
        ops = kernels.tensorflow_ops()   # each tensor's piece written once, no dense vector
        parts = None if ops is None or not isinstance(tensors, Packed) else ops.scatter_split(
            idx, values, [spec.shape.num_elements() for spec in tensors])
        if parts is None:
            return super().scatter_split(n, idx, values, tensors, like)
        return Packed(tensors, parts)

    def zeros(self, n, dtype="float32", like=None):
        return _own(tf.fill([n], tf.constant(0, dtype=dtype)))   # Fill: a buffer of its own

    def from_numpy(self, array, like=None):
        return tf.convert_to_tensor(np.asarray(array))

    def to_numpy(self, x):
        return x.numpy()

    def copy(self, x):
        return _own(tf.raw_ops.DeepCopy(x=x))   # not tf.identity, which shares x's buffer

    def flat(self, x):
        return x if x.shape.rank == 1 else tf.reshape(x, [-1])   # an eager reshape costs ~55 us

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
        dtype = tf.as_dtype(dtype)
        return x if x.dtype == dtype else tf.raw_ops.Cast(x=x, DstT=dtype)   # tf.cast's kernel, 2x faster

    def add(self, acc, x):
        return acc + tf.cast(x, acc.dtype)

    def scale(self, x, factor):
        return tf.raw_ops.Mul(x=x, y=constant(factor, x.dtype))

    def multiply(self, x, y):
        return tf.raw_ops.Mul(x=x, y=tf.cast(y, x.dtype))

    def clamp(self, x, bound):
        limit = constant(bound, x.dtype)
        clipped = tf.minimum(tf.maximum(x, -limit), limit)
        return tf.where(tf.math.is_nan(x), x, clipped)

    def precondition(self, u, v, first_scale, second_scale, eps):
        scaled = self.scale(v, second_scale)
        # Correctly rounded: Eigen's fp32 square root is an approximation; the fp64 one is exact,
        # and rounding an exact fp64 root to fp32 rounds it correctly (53 >= 2 * 24 + 2 bits).
        root = tf.cast(tf.raw_ops.Sqrt(x=tf.cast(scaled, tf.float64)), v.dtype)
        denominator = tf.raw_ops.AddV2(x=root, y=constant(eps, v.dtype))
        return tf.raw_ops.RealDiv(x=self.scale(u, first_scale), y=denominator)

    def abs(self, x):
        return tf.raw_ops.Abs(x=x)

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
        if isinstance(tensors, Packed):
            tensors = tensors.parts
        total = tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in tensors])
        if bool(tf.math.is_finite(total)):
            return True
        # an overflowing sum is not enough
        return all(bool(tf.reduce_all(tf.math.is_finite(t))) for t in tensors)

    def topk_abs_indices(self, x, k):
        x = self.flat(x)
        ops = kernels.tensorflow_ops()   # the CPU kernel as a TensorFlow op (hvd_sparse/kernels/tf_ops.py)
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

    def topk_abs_segments(self, x, segments):
        ops = kernels.tensorflow_ops()   # one op for every segment, x read flat (kernels/tf_ops.py)
        selected = None if ops is None else ops.topk_abs_segments(x, list(segments))
        return super().topk_abs_segments(x, segments) if selected is None else selected

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
        return tf.raw_ops.GatherV2(params=x, indices=idx, axis=constant(0, tf.int32))   # tf.gather's kernel

    def zero_at(self, x, idx):
        done = self._set_at(x, idx, None)
        if done is not None:
            return done
        column = _column(idx)
        count = [column.shape[0]] if column.shape[0] is not None else tf.shape(column)[:1]
        return tf.tensor_scatter_nd_update(x, column, tf.zeros(count, dtype=x.dtype))

    def put(self, x, idx, values):
        done = self._set_at(x, idx, values)
        if done is not None:
            return done
        return tf.tensor_scatter_nd_update(x, _column(idx), tf.cast(values, x.dtype))

    def _set_at(self, x, idx, values):
        """x[idx] = values (zeros without) by the op library, in place when this backend owns x."""
        ops = kernels.tensorflow_ops()
        done = None if ops is None else ops.set_at(x, tf.convert_to_tensor(idx), values, _owned(x))
        return None if done is None else _own(done)

    def scatter(self, n, idx, values, like=None):
        return tf.scatter_nd(_column(idx), values, [n])

    def unique(self, idx):
        return tf.sort(tf.unique(idx).y)

    def arange(self, lo, hi, like=None):
        return tf.range(lo, hi, dtype=tf.int64)
