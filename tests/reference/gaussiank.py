"""Independent NumPy references for the baseline sparsifiers, for the tests.

Written from docs/algorithms.md (DGC, GaussianK, Threshold) directly, with boolean masks and plain loops
rather than the engine's backend operations, so that a test compares two implementations.
"""

from __future__ import annotations

import math
import statistics

import numpy as np


def threshold_selection(acc: np.ndarray, lam: float, step: int) -> np.ndarray:
    """Hard threshold: |a| >= λ; the single index ``step mod n`` when nothing passes."""
    chosen = np.flatnonzero(np.abs(acc) >= np.float32(lam))
    return chosen if chosen.size else np.array([step % acc.size])


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


def dgc_density(density: float, warmup_epochs: int, epoch: int) -> float:
    if epoch >= warmup_epochs:
        return density
    return max(density ** ((epoch + 1) / (warmup_epochs + 1)), density)


def dgc_unsampled_selection(velocity: np.ndarray, density: float) -> np.ndarray:
    """DGC on a tensor too small to sample: λ = the k-th largest |v|, then the first k indices
    (in index order) with |v| >= λ, k = ceil(ρ n)."""
    k = min(velocity.size, math.ceil(velocity.size * density))
    lam = np.sort(np.abs(velocity))[::-1][k - 1]
    return np.flatnonzero(np.abs(velocity) >= lam)[:k]


def dgc_momentum_step(u: np.ndarray, v: np.ndarray, grad: np.ndarray, momentum: float,
                      nesterov: bool) -> tuple[np.ndarray, np.ndarray]:
    """One momentum correction: the new (u, v) before anything is sent (float32 arithmetic)."""
    mu = np.float32(momentum)
    if nesterov:
        u = (u + grad) * mu
        return u, v + u + grad
    u = u * mu + grad
    return u, v + u
