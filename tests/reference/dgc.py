"""Independent NumPy reference of DGC (docs/algorithms.md#dgc), for the tests.

Written from the specification with plain NumPy rather than the engine's backend operations, so
that a test compares two implementations.
"""

from __future__ import annotations

import math

import numpy as np


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


def dgc_sampled_selection(v: np.ndarray, k: int, start: int, stride: int, top: int, upper: float,
                          lower: float, iterations: int, resample: bool) -> tuple[np.ndarray, float]:
    """DGC's selection from the specification: λ = the ``top``-th largest |v[start::stride]| (NaN
    when the sample holds one), |v| >= λ (λ rounded to v's dtype), adapted at most ``iterations``
    times, the first k kept. (indices, final λ)."""
    magnitudes = np.abs(v)

    def chosen(lam: float) -> np.ndarray:
        with np.errstate(over="ignore"):
            return np.flatnonzero(magnitudes >= v.dtype.type(lam))

    sample = magnitudes[start::stride]
    lam = math.nan if np.isnan(sample).any() else float(np.sort(sample)[::-1][top - 1])
    idx = chosen(lam)
    for _ in range(iterations):
        if len(idx) > k:
            if len(idx) <= upper * k:
                break
            if resample:   # the k largest of the chosen, ties at the lowest positions
                order = np.argsort(-magnitudes[idx], kind="stable")[:k]
                idx = idx[np.sort(order)]
                break
            lam *= upper
        elif len(idx) < lower * k:
            lam *= lower
        else:
            break
        idx = chosen(lam)
    return idx[:k], lam
