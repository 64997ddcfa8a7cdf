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
