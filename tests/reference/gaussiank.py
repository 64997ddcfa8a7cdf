"""Independent NumPy reference of Gaussian-k (docs/algorithms.md#gaussiank), for the tests.

Written from the specification with boolean masks and plain loops rather than the engine's
backend operations, so that a test compares two implementations.
"""

from __future__ import annotations

import statistics

import numpy as np


def gaussian_tail(acc: np.ndarray, density: float) -> float:
    """μ + σ·Φ⁻¹(1 − ρ/2) of the signed entries (σ with n − 1), μ and σ rounded to float32 from
    exact sums (``statistics`` sums exactly; the float64 result is rounded once more, which
    differs from one rounding only on an exact float32 midpoint)."""
    values = acc.astype(np.float64).tolist()
    mean = float(np.float32(statistics.mean(values)))
    std = float(np.float32(statistics.stdev(values))) if acc.size > 1 else 0.0
    return mean + std * statistics.NormalDist().inv_cdf(1 - density / 2)


def gaussiank_original(acc: np.ndarray, density: float, loops: int = 100) -> np.ndarray:
    """The authors' GaussianCompressor refinement over a shrinking candidate set (mask form)."""
    n = acc.size
    k = max(1, int(density * n))
    lam = gaussian_tail(acc, density)
    magnitude = np.abs(acc)
    candidate = np.ones(n, dtype=bool)
    kept = np.zeros(n, dtype=bool)
    too_many_last = False
    for _ in range(loops):
        above = candidate & (magnitude > np.float32(lam))
        total = kept.sum() + above.sum()
        too_many_last = False
        if total < 2 * k / 3:
            kept |= above
            candidate &= ~above
            lam *= 0.1
        elif total > 4 * k / 3:
            too_many_last = True
            candidate = above
            lam *= 2
        else:
            kept |= above
            break
    if too_many_last and kept.sum() < 2 * k / 3:
        kept |= candidate
    return np.flatnonzero(kept)


def gaussiank_rescale(acc: np.ndarray, density: float, loops: int = 3) -> np.ndarray:
    n = acc.size
    k = max(1, int(density * n))
    lam = gaussian_tail(acc, density)
    magnitude = np.abs(acc)
    for _ in range(loops):
        count = int((magnitude > np.float32(lam)).sum())
        if count < 2 * k / 3:
            lam *= 0.5
        elif count > 4 * k / 3:
            lam *= 1.5
        else:
            break
    return np.flatnonzero(magnitude > np.float32(lam))
