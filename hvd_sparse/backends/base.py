"""The few bulk array operations the engine needs, one implementation per framework.

Bulk data (gradients, residuals, selected values and indices) never leaves the framework: the
engine and the algorithms touch it only through these methods, so one algorithm module serves
NumPy, PyTorch and TensorFlow alike. Every method returns its result; a backend whose arrays are
mutable may update its first argument in place and return it (the engine always uses the return
value), so the TensorFlow backend, whose tensors are immutable, fits the same code.

Control decisions (thresholds, counts, partitions) are not made here: they are small NumPy
computations that read host scalars (``to_numpy``, ``item``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

Array = Any  # a framework tensor: numpy.ndarray, torch.Tensor or tf.Tensor


class Backend:
    """Interface; see numpy_backend.py for the reference semantics of each method."""

    name = "abstract"

    # --- creation and layout -------------------------------------------------------------------
    def zeros(self, n: int, dtype: str = "float32", like: Array | None = None) -> Array:
        """1-D zeros of length n on the device of ``like``; dtype a NumPy dtype name."""
        raise NotImplementedError

    def from_numpy(self, array: np.ndarray, like: Array | None = None) -> Array:
        raise NotImplementedError

    def to_numpy(self, x: Array) -> np.ndarray:
        raise NotImplementedError

    def copy(self, x: Array) -> Array:
        """A new array with x's contents (on x's device)."""
        raise NotImplementedError

    def flat(self, x: Array) -> Array:
        """1-D view (or reshape) of x."""
        raise NotImplementedError

    def reshape(self, x: Array, shape: tuple[int, ...]) -> Array:
        raise NotImplementedError

    def concat(self, xs: list[Array]) -> Array:
        raise NotImplementedError

    def slice(self, x: Array, lo: int, hi: int) -> Array:
        raise NotImplementedError

    def numel(self, x: Array) -> int:
        raise NotImplementedError

    def dtype_name(self, x: Array) -> str:
        """NumPy-style name of x's dtype ('float32', 'float16', 'bfloat16', 'int64', ...)."""
        raise NotImplementedError

    def cast(self, x: Array, dtype: str) -> Array:
        raise NotImplementedError

    # --- arithmetic ------------------------------------------------------------------------------
    def add(self, acc: Array, x: Array) -> Array:
        """acc + x (float32 acc; x may be lower precision); may write into acc."""
        raise NotImplementedError

    def scale(self, x: Array, factor: float) -> Array:
        """x * factor; may write into x."""
        raise NotImplementedError

    def abs(self, x: Array) -> Array:
        raise NotImplementedError

    def sum_of_squares(self, x: Array) -> float:
        """Host float (synchronizes)."""
        raise NotImplementedError

    def segment_norms(self, x: Array, lengths: list[int]) -> np.ndarray:
        """L2 norm of each consecutive segment of x (segment i has ``lengths[i]`` entries, which
        sum to numel(x)) rounded to float32, as a host float64 array (one synchronization). The
        same on every backend and kernel, bit for bit: float32(sqrt(S)) for S the exact sum of
        squares rounded to float64 (see ``float32_norms``)."""
        raise NotImplementedError

    def all_finite(self, x: Array) -> bool:
        """Host bool (synchronizes)."""
        raise NotImplementedError

    def mean_std(self, x: Array) -> tuple[float, float]:
        """Host floats (synchronizes): the mean of x and its sample standard deviation
        (n - 1 in the denominator, as ``torch.std``; 0.0 for a single element)."""
        raise NotImplementedError

    def tensors_finite(self, tensors: list[Array]) -> bool:
        """Whether no tensor holds NaN or Inf: one sum per tensor and a single host
        synchronization (a sum is finite when its terms are, short of overflow; a sum that is
        not is confirmed element by element, so an overflowing sum of finite terms is finite)."""
        raise NotImplementedError

    # --- selection and scatter -------------------------------------------------------------------
    def topk_abs_indices(self, x: Array, k: int) -> Array:
        """The k entries of x of largest magnitude, as ascending int64 indices; 0 <= k <= numel(x).

        One rule on every backend and kernel, so every rank and framework selects the same set:
        magnitudes are ordered as |x| with -0 == +0 and every NaN equal to every other NaN and
        above +Inf (``magnitude_keys``); of the entries tied at the k-th largest magnitude, those
        of the lowest indices are taken."""
        raise NotImplementedError

    def indices_where_at_least(self, x: Array, threshold: float, offset: int = 0) -> Array:
        """int64 indices i (plus offset) with x[i] >= threshold, ascending."""
        raise NotImplementedError

    def count_at_least(self, x: Array, thresholds: list[float], every: int = 1) -> list[float]:
        """How many entries of x are >= each threshold (one host synchronization). With
        ``every`` > 1, an estimate from 1/every of x read as 64 evenly spaced contiguous runs (so
        only that share of memory is touched), scaled back to the whole."""
        raise NotImplementedError

    def count_in_ranges(self, idx: Array, bounds: np.ndarray) -> np.ndarray:
        """How many indices fall in each range [bounds[i], bounds[i+1]) (ascending bounds; every
        index inside [bounds[0], bounds[-1])), as NumPy int64."""
        raise NotImplementedError

    def take(self, x: Array, idx: Array) -> Array:
        raise NotImplementedError

    def zero_at(self, x: Array, idx: Array) -> Array:
        """x with x[idx] = 0; may write into x."""
        raise NotImplementedError

    def put(self, x: Array, idx: Array, values: Array) -> Array:
        """x with x[idx] = values; may write into x."""
        raise NotImplementedError

    def scatter(self, n: int, idx: Array, values: Array, like: Array | None = None) -> Array:
        """Dense length-n vector holding values at idx; duplicate indices are summed."""
        raise NotImplementedError

    def unique(self, idx: Array) -> Array:
        """Sorted distinct indices."""
        raise NotImplementedError

    def arange(self, lo: int, hi: int, like: Array | None = None) -> Array:
        """int64 [lo, hi)."""
        raise NotImplementedError

    # --- buckets: many tensors <-> one flat vector ---------------------------------------------------
    def accumulate(self, residual: Array, tensors: list[Array], clear_inputs: bool = False) -> Array:
        """residual + concat(flattened tensors), in the residual's dtype; may write into residual
        (backends with mutable arrays add slice by slice, without a concatenated copy). With
        ``clear_inputs`` every input is also set to zero (mutable backends; the engine writes the
        average into the inputs later, so a kernel can clear them in the same pass)."""
        flat = self.concat([self.cast(self.flat(t), self.dtype_name(residual)) for t in tensors])
        out = self.add(residual, flat)
        if clear_inputs:
            self.clear(tensors)
        return out

    def clear(self, tensors: list[Array]) -> None:
        """Set every tensor to zero in place (backends with mutable arrays only)."""
        raise NotImplementedError(f"the {self.name} backend's tensors are immutable")

    def select_at_least(self, x: Array, lo: int, hi: int, threshold: float, probes: list[float] = (),
                        every: int = 1) -> tuple[Array, list[float]]:
        """What a threshold method reads off its accumulated vector x in [lo, hi): the ascending
        indices i (absolute) with |x_i| >= threshold, and ``count_at_least`` of |x[lo:hi]| at each
        probe (none without probes)."""
        magnitude = self.abs(self.slice(x, lo, hi))
        counts = self.count_at_least(magnitude, list(probes), every) if len(probes) else []
        return self.indices_where_at_least(magnitude, threshold, offset=lo), counts

    def accumulate_select(self, residual: Array, tensors: list[Array], lo: int, hi: int, threshold: float,
                          probes: list[float] = (), every: int = 1, index_dtype: str = "int64",
                          clear_inputs: bool = False, check_finite: bool = False
                          ) -> tuple[Array, Array | None, list[float], bool]:
        """``accumulate`` then ``select_at_least`` on the result: (accumulated vector, indices,
        probe counts, True). A kernel does both in one pass and returns the indices as
        ``index_dtype`` (the reference returns int64; the engine casts either to the bucket's index
        dtype). With ``check_finite`` the inputs are first checked (``tensors_finite``; on a GPU in
        the same host synchronization as the count): when one holds NaN/Inf nothing is written and
        (residual, None, [], False) comes back."""
        if check_finite and not self.tensors_finite(tensors):
            return residual, None, [], False
        acc = self.accumulate(residual, tensors, clear_inputs)
        return (acc, *self.select_at_least(acc, lo, hi, threshold, probes, every), True)

    def momentum_accumulate(self, residual: Array, momentum: Array, tensors: list[Array], factor: float,
                            nesterov: bool) -> tuple[Array, Array]:
        """DGC's momentum correction of the gradient g = concat(tensors): (velocity, momentum) with
        u = u·m + g and velocity = residual + u, or with ``nesterov`` u = (u + g)·m and
        velocity = residual + u + g; may write into residual and momentum."""
        grad = self.accumulate(self.zeros(self.numel(residual), self.dtype_name(residual), like=residual),
                               tensors)
        return self.momentum_step(residual, momentum, grad, factor, nesterov)

    def momentum_step(self, residual: Array, momentum: Array, grad: Array, factor: float,
                      nesterov: bool) -> tuple[Array, Array]:
        """``momentum_accumulate`` from the gradient as one vector (e.g. after clipping)."""
        if nesterov:
            momentum = self.scale(self.add(momentum, grad), factor)
            return self.add(self.add(residual, momentum), grad), momentum
        momentum = self.add(self.scale(momentum, factor), grad)
        return self.add(residual, momentum), momentum

    def scatter_into(self, tensors: list[Array], idx: Array, values: Array, unique: bool,
                     zeroed: bool = False) -> list[Array]:
        """The dense vector holding ``values`` at flat ``idx`` (summed where ``unique`` is False),
        cut into tensors shaped like ``tensors``; backends with mutable arrays write it into
        ``tensors`` themselves (zeroing them first, unless ``zeroed`` says they already are)
        instead of allocating a dense vector."""
        n = sum(self.numel(t) for t in tensors)
        return self.split_like(self.scatter(n, idx, values), tensors)

    def split_like(self, flat: Array, tensors: list[Array]) -> list[Array]:
        """Cut a flat vector back into tensors with the shapes and dtypes of ``tensors``."""
        out, offset = [], 0
        for t in tensors:
            n = self.numel(t)
            piece = self.reshape(self.slice(flat, offset, offset + n), tuple(t.shape))
            out.append(self.cast(piece, self.dtype_name(t)))
            offset += n
        return out


SAMPLE_RUNS = 64


def sample_shape(length: int, every: int) -> tuple[int, int] | None:
    """(rows, row length) of a view whose every ``every``-th row is sampled, or None when x is too
    short to sample (then it is counted whole)."""
    rows = SAMPLE_RUNS * every
    if every <= 1 or length < rows * 16:
        return None
    return rows, length // rows


UNIT_ROUNDOFF = 2.0 ** -53
SMALLEST_SUBNORMAL = 2.0 ** -1074


def certain_float32_norm(total: float, depth: int) -> float | None:
    """float32(sqrt(S)) for the exact sum of squares S, from a float64 sum ``total`` in which no
    term went through more than ``depth`` roundings (additions, plus one where a square itself was
    rounded), or None when that error could change the float32 result. Any summation order of m
    terms has depth <= m, so every backend can bound its own sum; the float32 result is then the
    same wherever it is certain, and an exact sum decides the rare rest."""
    if not math.isfinite(total):   # NaN (a NaN entry) or +Inf (an Inf entry, or squares beyond
        return total               # float64: their float32 norm is +Inf all the same)
    error = 2.0 * (depth + 2) * UNIT_ROUNDOFF * total + depth * SMALLEST_SUBNORMAL
    low = np.float32(math.sqrt(max(total - error, 0.0)))
    return float(low) if low == np.float32(math.sqrt(total + error)) else None


def exact_float32_norm(x: np.ndarray) -> float:
    """float32(sqrt(S)) for S the exact sum of squares of x rounded to float64 (math.fsum of exact
    terms: squares of float32 values are exact in float64, float64 values are split in halves
    whose products are). Slow; ``float32_norms`` calls it only where a fast sum cannot decide."""
    x64 = np.asarray(x, dtype=np.float64).reshape(-1)
    if not np.isfinite(x64).all():
        return math.nan if np.isnan(x64).any() else math.inf
    if x64.size and np.abs(x64).max() >= 2.0 ** 512:   # a square alone is beyond float64
        return math.inf
    if np.asarray(x).dtype.itemsize <= 4:
        terms = [x64 * x64]
    else:
        scaled = x64 * 134217729.0            # Veltkamp: x = high + low, 26 bits each
        high = scaled - (scaled - x64)
        low = x64 - high
        terms = [high * high, 2.0 * high * low, low * low]
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            total = math.fsum(np.concatenate(terms).tolist())
    except (OverflowError, ValueError):   # squares beyond float64 (a half square overflowed)
        total = math.inf
    return float(np.float32(math.sqrt(total))) if total == total else total


def float32_norms(sums: list[float], depths: list[int], segment: Any) -> np.ndarray:
    """The norms of ``segment_norms`` from each segment's float64 sum of squares and its rounding
    depth; ``segment(i)`` gives segment i as NumPy, read only where the sum cannot decide."""
    out = [certain_float32_norm(float(total), depth) for total, depth in zip(sums, depths, strict=True)]
    return np.array([exact_float32_norm(segment(i)) if norm is None else norm
                     for i, norm in enumerate(out)], dtype=np.float64)


# Integer keys ordered as the magnitudes of a float dtype: its bits read as a signed integer of
# the same width with the sign bit cleared (so -0 == +0 and non-negative keys compare like |x|),
# capped at the key just above +Inf so that every NaN has that one key. Name: (integer dtype,
# mask, NaN key).
MAGNITUDE_KEYS = {
    "float16": ("int16", 0x7FFF, 0x7C01),
    "bfloat16": ("int16", 0x7FFF, 0x7F81),
    "float32": ("int32", 0x7FFF_FFFF, 0x7F80_0001),
    "float64": ("int64", 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0001),
}


def index_dtype_for(n: int) -> str:
    """int32 indices while they fit (half the bytes on the wire), int64 beyond 2**31."""
    return "int32" if n < 2**31 else "int64"
