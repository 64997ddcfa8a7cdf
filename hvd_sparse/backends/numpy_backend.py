"""NumPy backend: the reference semantics, used by the unit tests and the N-rank simulator."""

from __future__ import annotations

import itertools
import math

import numpy as np

from .base import Backend
from .exact import (
    MAGNITUDE_KEYS,
    float32_norms,
    numpy_mean_std,
    sample_shape,
)


class NumpyBackend(Backend):
    """The reference semantics of every ``Backend`` method, in NumPy."""

    name = "numpy"

    def zeros(self, n, dtype="float32", like=None):
        return np.zeros(n, dtype=dtype)

    def from_numpy(self, array, like=None):
        return np.asarray(array)

    def to_numpy(self, x):
        return np.asarray(x)

    def copy(self, x):
        return np.array(x, copy=True)

    def flat(self, x):
        return np.asarray(x).reshape(-1)

    def reshape(self, x, shape):
        return x.reshape(shape)

    def concat(self, xs):
        return np.concatenate(xs) if len(xs) != 1 else xs[0]

    def slice(self, x, lo, hi, step=1):
        return x[lo:hi:step]

    def numel(self, x):
        return int(np.size(x))

    def dtype_name(self, x):
        return np.asarray(x).dtype.name

    def cast(self, x, dtype):
        return x if x.dtype == dtype else x.astype(dtype)

    def add(self, acc, x):
        np.add(acc, x, out=acc, casting="unsafe")
        return acc

    def scale(self, x, factor):
        x *= x.dtype.type(factor)
        return x

    def multiply(self, x, y):
        np.multiply(x, y, out=x, casting="unsafe")
        return x

    def clamp(self, x, bound):
        np.clip(x, x.dtype.type(-bound), x.dtype.type(bound), out=x)
        return x

    def precondition(self, u, v, first_scale, second_scale, eps):
        kind = u.dtype.type
        return (u * kind(first_scale)) / (np.sqrt(v * kind(second_scale)) + kind(eps))

    def abs(self, x):
        return np.abs(x)

    def sum_of_squares(self, x):
        x64 = x.astype(np.float64)
        return float(np.dot(x64, x64))

    def segment_norms(self, x, lengths):
        starts = np.cumsum([0, *lengths]).tolist()
        sums = []
        for lo, hi in itertools.pairwise(starts):
            segment = x[lo:hi].astype(np.float64)
            with np.errstate(over="ignore"):   # squares beyond float64: the norm is +Inf
                sums.append(float(np.dot(segment, segment)))
        return float32_norms(sums, list(lengths), lambda i: x[starts[i]:starts[i + 1]])

    def all_finite(self, x):
        return bool(np.isfinite(x).all())

    def mean_std(self, x):
        return numpy_mean_std(x)

    def tensors_finite(self, tensors):
        if math.isfinite(sum(float(np.sum(t, dtype=np.float64)) for t in tensors)):
            return True
        return all(bool(np.isfinite(t).all()) for t in tensors)   # an overflowing sum is not enough

    def topk_abs_indices(self, x, k):
        x = np.asarray(x).reshape(-1)
        if k >= x.size:
            return np.arange(x.size, dtype=np.int64)
        if k <= 0:
            return np.zeros(0, dtype=np.int64)
        keys = magnitude_keys(x)
        kth = np.partition(keys, x.size - k)[x.size - k]   # the k-th largest key
        above = np.flatnonzero(keys > kth)
        tied = np.flatnonzero(keys == kth)[: k - above.size]   # ties: the lowest indices
        return np.sort(np.concatenate([above, tied])).astype(np.int64)

    def indices_where_at_least(self, x, threshold, offset=0):
        idx = np.flatnonzero(x >= threshold)
        return idx + offset if offset else idx

    def count_at_least(self, x, thresholds, every=1):
        shape = sample_shape(x.size, every)
        if shape is None:
            return [float(np.count_nonzero(x >= t)) for t in thresholds]
        rows, length = shape
        sample = x[: rows * length].reshape(rows, length)[::every]
        return [float(np.count_nonzero(sample >= t)) * x.size / sample.size for t in thresholds]

    def count_in_ranges(self, idx, bounds):
        which = np.searchsorted(np.asarray(bounds)[1:-1], idx, side="right")
        return np.bincount(which, minlength=len(bounds) - 1).astype(np.int64)

    def take(self, x, idx):
        return x[idx]

    def zero_at(self, x, idx):
        x[idx] = 0
        return x

    def put(self, x, idx, values):
        x[idx] = values
        return x

    def scatter(self, n, idx, values, like=None):
        out = np.zeros(n, dtype=values.dtype)
        np.add.at(out, idx, values)
        return out

    def unique(self, idx):
        return np.unique(idx)

    def arange(self, lo, hi, like=None):
        return np.arange(lo, hi, dtype=np.int64)

    def accumulate(self, residual, tensors, clear_inputs=False, momentum=None):
        if momentum is not None:
            return super().accumulate(residual, tensors, clear_inputs, momentum)
        offset = 0
        for t in tensors:
            n = t.size
            residual[offset:offset + n] += t.reshape(-1)
            offset += n
        if clear_inputs:
            self.clear(tensors)
        return residual

    def clear(self, tensors):
        for t in tensors:
            t[...] = 0

    def scatter_into(self, tensors, idx, values, unique, zeroed=False):
        if not unique:
            idx, inverse = np.unique(idx, return_inverse=True)
            values = np.bincount(inverse, weights=values, minlength=idx.size).astype(values.dtype)
        order = np.argsort(idx, kind="stable")
        idx, values = idx[order], values[order]
        offsets = np.cumsum([0] + [t.size for t in tensors])
        cuts = np.searchsorted(idx, offsets)
        for t, lo, hi, offset in zip(tensors, cuts[:-1], cuts[1:], offsets, strict=False):
            flat = t.reshape(-1)
            if not zeroed:
                flat[:] = 0
            flat[idx[lo:hi] - offset] = values[lo:hi]
        return list(tensors)


def magnitude_keys(x: np.ndarray) -> np.ndarray:
    """Integer keys ordered as the magnitudes of x (see base.MAGNITUDE_KEYS)."""
    int_dtype, mask, nan_key = MAGNITUDE_KEYS[x.dtype.name]
    return np.minimum(x.view(int_dtype) & np.array(mask, dtype=int_dtype), np.array(nan_key, dtype=int_dtype))
