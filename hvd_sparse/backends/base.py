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
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

Array = Any  # a framework tensor: numpy.ndarray, torch.Tensor or tf.Tensor


@dataclass
class Momentum:
    """One bucket's momentum correction, handed to the ops that accumulate: the velocity ``u``
    (the residual's dtype and length; updated in place, or replaced by backends whose arrays are
    immutable), its factor and form. With it, what is accumulated into the residual is
    ``u <- factor*u + g`` (Nesterov: ``u <- factor*(u + g)``, then ``(e + u) + g``) instead of g."""

    buffer: Array
    factor: float
    nesterov: bool = False


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
        """Host floats (synchronizes): the mean of x and its sample standard deviation (n - 1 in
        the denominator, as ``torch.std``; 0.0 for a single element), each exactly rounded to
        float32 from the exact sums Σx and Σx², so identical on every backend and kernel (see
        ``certain_mean_std``)."""
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
    def accumulate(self, residual: Array, tensors: list[Array], clear_inputs: bool = False,
                   momentum: Momentum | None = None) -> Array:
        """residual + concat(flattened tensors), in the residual's dtype; may write into residual
        (backends with mutable arrays add slice by slice, without a concatenated copy). With
        ``clear_inputs`` every input is also set to zero (mutable backends; the engine writes the
        average into the inputs later, so a kernel can clear them in the same pass). With
        ``momentum`` the gradient enters through the velocity (``Momentum``), which is updated."""
        if momentum is not None:
            out, momentum.buffer = self.momentum_accumulate(residual, momentum.buffer, tensors,
                                                            momentum.factor, momentum.nesterov)
        else:
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
                          clear_inputs: bool = False, check_finite: bool = False,
                          momentum: Momentum | None = None
                          ) -> tuple[Array, Array | None, list[float], bool]:
        """``accumulate`` then ``select_at_least`` on the result: (accumulated vector, indices,
        probe counts, True). A kernel does both in one pass and returns the indices as
        ``index_dtype`` (the reference returns int64; the engine casts either to the bucket's index
        dtype). With ``check_finite`` the inputs are first checked (``tensors_finite``; on a GPU in
        the same host synchronization as the count): when one holds NaN/Inf nothing is written (the
        momentum buffer neither) and (residual, None, [], False) comes back."""
        if check_finite and not self.tensors_finite(tensors):
            return residual, None, [], False
        acc = self.accumulate(residual, tensors, clear_inputs, momentum)
        return (acc, *self.select_at_least(acc, lo, hi, threshold, probes, every), True)

    def accumulate_moments(self, residual: Array, tensors: list[Array], clear_inputs: bool = False,
                           check_finite: bool = False, momentum: Momentum | None = None
                           ) -> tuple[Array, tuple[float, float] | None, bool]:
        """``accumulate`` then ``mean_std`` of the result: (accumulated vector, (mean, std), True);
        a kernel takes the moments in the accumulating pass (Gaussian-k). With ``check_finite``
        the inputs are first checked: when one holds NaN/Inf nothing is written and
        (residual, None, False) comes back."""
        if check_finite and not self.tensors_finite(tensors):
            return residual, None, False
        acc = self.accumulate(residual, tensors, clear_inputs, momentum)
        return acc, self.mean_std(acc), True

    def accumulate_norms(self, residual: Array, tensors: list[Array], lengths: list[int],
                         momentum: Momentum | None = None) -> tuple[Array, np.ndarray]:
        """``accumulate`` then ``segment_norms`` of the result: (accumulated vector, norms); a
        kernel takes the sums of squares in the accumulating pass (DEFT)."""
        acc = self.accumulate(residual, tensors, momentum=momentum)
        return acc, self.segment_norms(acc, lengths)

    def momentum_accumulate(self, residual: Array, momentum: Array, tensors: list[Array], factor: float,
                            nesterov: bool) -> tuple[Array, Array]:
        """The momentum correction of the gradient g = concat(tensors): (velocity, momentum) with
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


def sum_error_bound(total: float, depth: int) -> float:
    """A bound on |total - S| for S the exact sum of non-negative terms (squares) and ``total`` a
    float64 sum of them in which no term went through more than ``depth`` roundings; generous by
    a factor 2, so that the float64 arithmetic computing the bound itself cannot undercut it."""
    return 2.0 * (depth + 2) * UNIT_ROUNDOFF * total + depth * SMALLEST_SUBNORMAL


def certain_float32_norm(total: float, depth: int) -> float | None:
    """float32(sqrt(S)) for the exact sum of squares S, from a float64 sum ``total`` in which no
    term went through more than ``depth`` roundings (additions, plus one where a square itself was
    rounded), or None when that error could change the float32 result. Any summation order of m
    terms has depth <= m, so every backend can bound its own sum; the float32 result is then the
    same wherever it is certain, and an exact sum decides the rare rest."""
    if not math.isfinite(total):   # NaN (a NaN entry) or +Inf (an Inf entry, or squares beyond
        return total               # float64: their float32 norm is +Inf all the same)
    error = sum_error_bound(total, depth)
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


# --- mean and standard deviation (Gaussian-k) ---------------------------------------------------
# ``mean_std`` is float32(S1 / n) and float32(sqrt((S2 - S1²/n) / (n - 1))) for the exact sums
# S1 = Σx and S2 = Σx². Each path sums the shifted values d = x - c (c = x[0], which keeps the
# variance free of cancellation when the mean is far from 0) in float64, in a fixed blocked order
# whose rounding depth it knows; where the error bound cannot move either float32 result, those
# sums decide, elsewhere an exact integer sum does (``exact_mean_std``).
BLOCK = 256


def blocked_depth(n: int) -> int:
    """Rounding depth of a term in ``blocked_sum``'s order (shift and square included)."""
    return 3 * BLOCK + n // (BLOCK * BLOCK) + 8


def blocked_sum(v: Any, xp_sum: Any, reshape: Any) -> Any:
    """Σv (a float64 vector) in blocks of BLOCK, blocks of BLOCK blocks, then in order: any
    summation order of ``xp_sum`` within a block keeps every term within ``blocked_depth``.
    ``xp_sum(v, axis)`` and ``reshape(v, shape)`` are the framework's ops."""
    n, big = len(v), BLOCK * BLOCK
    q = n // big
    head = xp_sum(xp_sum(xp_sum(reshape(v[: q * big], (q, BLOCK, BLOCK)), 2), 1), 0)
    rest = v[q * big:]
    r = len(rest) // BLOCK
    middle = xp_sum(xp_sum(reshape(rest[: r * BLOCK], (r, BLOCK)), 1), 0)
    return head + middle + xp_sum(rest[r * BLOCK:], 0)


def _round_float32(q: Fraction, square: bool = False) -> float:
    """The float32 nearest to q (to sqrt(q) with ``square``), ties to even, as a float."""
    def key(m: Fraction) -> Fraction:
        return m * m if square else m
    try:
        approx = math.sqrt(q) if square else float(q)
    except OverflowError:
        approx = math.inf
    with np.errstate(over="ignore"):
        c = np.float32(approx)
    inf, top = np.float32(np.inf), np.finfo(np.float32).max
    if np.isinf(c):
        c = top
    while True:
        with np.errstate(over="ignore"):
            up = np.nextafter(c, inf)
        mid = (Fraction(float(c)) + (Fraction(float(up)) if np.isfinite(up) else Fraction(2) ** 128)) / 2
        if q > key(mid) or (q == key(mid) and int(c.view(np.int32)) & 1):
            if not np.isfinite(up):
                return math.inf
            c = up
            continue
        down = np.nextafter(c, -inf)
        if c > 0:
            mid = (Fraction(float(c)) + Fraction(float(down))) / 2
            if q < key(mid) or (q == key(mid) and int(c.view(np.int32)) & 1):
                c = down
                continue
        return float(c)


def _round_signed_float32(q: Fraction) -> float:
    return (-_round_float32(-q) or 0.0) if q < 0 else _round_float32(q)   # no -0.0


def certain_mean_std(n: int, shift: float, t1: float, t2: float, depth: int) -> tuple[float, float] | None:
    """``mean_std`` from the float64 sums t1 = Σd and t2 = Σd² of d = x - shift (no term through
    more than ``depth`` roundings), or None when their error could change a float32 result."""
    if n < 2 or not (math.isfinite(t1) and math.isfinite(t2)):
        return None
    e2 = sum_error_bound(t2, depth)
    # Σ|d| <= sqrt(n Σd²) (Cauchy-Schwarz) bounds the error of the signed sum
    e1 = 2.0 * (depth + 2) * UNIT_ROUNDOFF * math.sqrt(n * (t2 + e2)) + depth * SMALLEST_SUBNORMAL
    c, f1, f2, r1, r2 = (Fraction(v) for v in (shift, t1, t2, e1, e2))
    mean_lo, mean_hi = (_round_signed_float32(c + (f1 + s * r1) / n) for s in (-1, 1))
    if mean_lo != mean_hi:
        return None
    d1_lo, d1_hi = f1 - r1, f1 + r1
    square_hi = max(d1_lo * d1_lo, d1_hi * d1_hi)
    square_lo = Fraction(0) if d1_lo <= 0 <= d1_hi else min(d1_lo * d1_lo, d1_hi * d1_hi)
    var_lo = max(f2 - r2 - square_hi / n, Fraction(0)) / (n - 1)
    var_hi = max(f2 + r2 - square_lo / n, Fraction(0)) / (n - 1)
    std_lo, std_hi = _round_float32(var_lo, square=True), _round_float32(var_hi, square=True)
    return (mean_lo, std_lo) if std_lo == std_hi else None


def exact_mean_std(x: np.ndarray) -> tuple[float, float]:
    """``mean_std`` from the exact sums, by integer arithmetic: x = M·2^e with integer M, the
    terms grouped by exponent and summed in int64 pieces that cannot overflow. Slow; the paths
    call it only where their float64 sums cannot decide."""
    x64 = np.asarray(x, dtype=np.float64).reshape(-1)
    n = x64.size
    if n == 0:
        return math.nan, 0.0
    if not np.isfinite(x64).all():
        if np.isnan(x64).any() or (np.isposinf(x64).any() and np.isneginf(x64).any()):
            return math.nan, (0.0 if n == 1 else math.nan)
        return (math.inf if np.isposinf(x64).any() else -math.inf), (0.0 if n == 1 else math.nan)
    mantissa, exponent = np.frexp(x64)
    m = (mantissa * 2.0 ** 53).astype(np.int64)
    exponent = exponent.astype(np.int64) - 53
    keep = m != 0
    m, exponent = m[keep], exponent[keep]
    if m.size == 0:
        return 0.0, 0.0
    keys, group = np.unique(exponent, return_inverse=True)
    low_mask = (1 << 26) - 1
    high, low = m >> 26, m & low_mask   # m = high·2^26 + low, |high| < 2^27, 0 <= low < 2^26

    def sums(values: np.ndarray) -> list[int]:
        out = np.zeros(keys.size, dtype=np.int64)
        np.add.at(out, group, values)
        return [int(v) for v in out]

    def split_sums(product: np.ndarray) -> list[int]:   # products < 2^54: sum in two halves
        return [(h << 26) + lo for h, lo in zip(sums(product >> 26), sums(product & low_mask), strict=True)]

    base = int(keys[0])
    s1 = sum(((h << 26) + lo) << (int(e) - base)
             for h, lo, e in zip(sums(high), sums(low), keys, strict=True))
    hh, hl, ll = split_sums(high * high), split_sums(high * low), split_sums(low * low)
    s2 = sum(((a << 52) + (b << 27) + c) << (2 * (int(e) - base))
             for a, b, c, e in zip(hh, hl, ll, keys, strict=True))
    return mean_std_from_integers(n, s1, s2, base)


def mean_std_from_integers(n: int, s1: int, s2: int, base: int) -> tuple[float, float]:
    """``mean_std`` of n >= 1 finite entries from their exact sums Σx = s1·2^base and
    Σx² = s2·2^(2·base)."""
    scale = Fraction(2) ** base
    mean = _round_signed_float32(Fraction(s1, n) * scale)
    if n == 1:
        return mean, 0.0
    variance = Fraction(s2 * n - s1 * s1, n * (n - 1)) * scale * scale
    return mean, _round_float32(variance, square=True)


def numpy_mean_std(x: np.ndarray) -> tuple[float, float]:
    """``mean_std`` of a NumPy array (the NumPy backend's, and TensorFlow's, whose float64 cast
    would flush subnormal float32 values to zero)."""
    x64 = np.asarray(x, dtype=np.float64).reshape(-1)
    if x64.size < 2:
        return exact_mean_std(x64)
    with np.errstate(over="ignore", invalid="ignore"):   # beyond float64 or Inf: decided exactly
        shifted = x64 - x64[0]
        t1, t2 = (float(blocked_sum(v, np.sum, np.reshape)) for v in (shifted, shifted * shifted))
    return mean_std_from_sums(x64.size, float(x64[0]), t1, t2, blocked_depth(x64.size), lambda: x64)


def mean_std_from_sums(n: int, shift: float, t1: float, t2: float, depth: int, values: Any,
                       exact: Any = exact_mean_std) -> tuple[float, float]:
    """``mean_std`` from a path's shifted float64 sums; where they cannot decide (or for fewer
    than two entries), ``exact(values())`` does (by default: ``values()`` gives x as NumPy)."""
    certain = certain_mean_std(n, shift, t1, t2, depth)
    return exact(values()) if certain is None else certain


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
