"""NumPy backend: the reference semantics, used by the unit tests and the N-rank simulator."""

from __future__ import annotations

import math

import numpy as np

from .base import Backend


class NumpyBackend(Backend):
    name = "numpy"

    def zeros(self, n, dtype="float32", like=None):
        return np.zeros(n, dtype=dtype)

    def from_numpy(self, array, like=None):
        return np.asarray(array)

    def to_numpy(self, x):
        return np.asarray(x)

    def flat(self, x):
        return np.asarray(x).reshape(-1)

    def reshape(self, x, shape):
        return x.reshape(shape)

    def concat(self, xs):
        return np.concatenate(xs) if len(xs) != 1 else xs[0]

    def slice(self, x, lo, hi):
        return x[lo:hi]

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

    def abs(self, x):
        return np.abs(x)

    def sum_of_squares(self, x):
        x64 = x.astype(np.float64)
        return float(np.dot(x64, x64))

    def all_finite(self, x):
        return bool(np.isfinite(x).all())

    def mean_std(self, x):
        if x.size < 2:
            return float(np.mean(x)), 0.0
        return float(np.mean(x)), float(np.std(x, ddof=1))

    def tensors_finite(self, tensors):
        return math.isfinite(sum(float(np.sum(t, dtype=np.float64)) for t in tensors))

    def topk_indices(self, x, k):
        if k >= x.size:
            return np.arange(x.size, dtype=np.int64)
        return np.argpartition(x, x.size - k)[x.size - k:].astype(np.int64)

    def indices_where_at_least(self, x, threshold, offset=0):
        idx = np.flatnonzero(x >= threshold)
        return idx + offset if offset else idx

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

    def accumulate(self, residual, tensors):
        offset = 0
        for t in tensors:
            n = t.size
            residual[offset:offset + n] += t.reshape(-1)
            offset += n
        return residual
