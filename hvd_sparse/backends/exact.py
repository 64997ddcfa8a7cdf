"""The bit-exact numerics every backend and kernel shares, so that they agree bit for bit.

Every path (the NumPy, PyTorch and TensorFlow backends, the CPU and Triton kernels) computes the
same results: ``segment_norms`` and ``mean_std`` are float32 roundings of exact sums, decided by
a fast float64 sum where its error bound cannot change the result and by an exact sum elsewhere;
magnitudes order by integer keys (``MAGNITUDE_KEYS``); a sampled count reads the same runs
(``sample_shape``). The backends (backends/base.py and its implementations) and the kernels
(hvd_sparse/kernels/) both import this module; it imports neither, only NumPy and the standard library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

SAMPLE_RUNS = 64


def sample_shape(length: int, every: int) -> tuple[int, int] | None:
    """(rows, row length) of a view whose every ``every``-th row is sampled, or None when x is too
    short to sample (then it is counted whole)."""
    rows = SAMPLE_RUNS * every
    if every <= 1 or length < rows * 16:
        return None
    return rows, length // rows


@dataclass(frozen=True)
class KernelSelection:
    """The arguments a CPU kernel takes for a selection in [lo, hi) with probe counts (accumulate.cpp),
    shared by the torch and TensorFlow wrappers: the threshold and probes rounded to the vector's
    dtype (as NumPy and torch round a Python float they compare an array with; beyond the dtype's
    range to Inf), and the sampled rows' geometry, with which ``scale`` turns the kernel's raw
    counts into ``count_at_least``'s estimates."""

    threshold: float
    probes: tuple[float, ...]
    length: int
    row_len: int
    sample_end: int
    sampled: int

    @classmethod
    def of(cls, kind: type, lo: int, hi: int, threshold: float, probes: list[float],
           every: int) -> KernelSelection:
        """The selection's arguments for a vector of NumPy type ``kind``."""
        with np.errstate(over="ignore"):
            rounded = float(kind(threshold)), tuple(float(kind(p)) for p in probes)
        length = hi - lo
        shape = sample_shape(length, every)
        row_len, sample_end = (0, 0) if shape is None else (shape[1], shape[0] * shape[1])
        sampled = length if shape is None else len(range(0, shape[0], every)) * shape[1]
        return cls(*rounded, length, row_len, sample_end, sampled)

    def scale(self, counts: list[int]) -> list[float]:
        """The kernel's counts over the sampled rows, scaled to the whole range."""
        return [float(c) * self.length / self.sampled if self.sampled else 0.0 for c in counts]


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
    decided = float_mean_std(n, shift, t1, t2, e1, e2)
    if decided is not None:
        return decided
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


def float32_if_one(low: float, high: float) -> float | None:
    """The float32 both ends of [low, high] round to (so does everything between), else None."""
    with np.errstate(over="ignore"):
        a, b = np.float32(low), np.float32(high)
    return float(a) + 0.0 if a == b and np.isfinite(a) else None   # + 0.0: no -0.0


def float_mean_std(n: int, shift: float, t1: float, t2: float, e1: float, e2: float
                   ) -> tuple[float, float] | None:
    """``certain_mean_std``'s decision in float64 arithmetic, which decides all but the rare sums
    whose interval a float32 rounding boundary crosses (then None, and Fractions decide). Each
    interval is widened by a bound on the float64 rounding of its own computation (a few units in
    the last place of the terms involved; ×8 to spare), so it still holds the exact one."""
    slack = 8.0 * UNIT_ROUNDOFF
    mean = shift + t1 / n
    mean_error = e1 / n + slack * (abs(shift) + abs(t1 / n) + abs(mean) + e1 / n) + SMALLEST_SUBNORMAL
    decided_mean = float32_if_one(mean - mean_error, mean + mean_error)
    if decided_mean is None:
        return None
    low1, high1 = t1 - e1, t1 + e1
    square_hi = max(low1 * low1, high1 * high1) / n
    square_lo = 0.0 if low1 <= 0.0 <= high1 else min(low1 * low1, high1 * high1) / n
    var_error = slack * (t2 + e2 + square_hi) + SMALLEST_SUBNORMAL
    var_lo = max(t2 - e2 - square_hi - var_error, 0.0) / (n - 1)
    var_hi = (max(t2 + e2 - square_lo, 0.0) + var_error) / (n - 1)
    if not math.isfinite(var_hi):
        return None
    std = float32_if_one(math.sqrt(var_lo) * (1.0 - slack), math.sqrt(var_hi) * (1.0 + slack))
    return None if std is None else (decided_mean, std)


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
