"""Independent NumPy reference of the hard threshold (docs/algorithms.md#threshold), for the tests.

Written from the specification with a boolean mask, not from hvd_sparse's backend operations, so
that a test compares two implementations.
"""

from __future__ import annotations

import numpy as np


def threshold_selection(acc: np.ndarray, lam: float, step: int) -> np.ndarray:
    """Hard threshold: |a| >= λ; the single index ``step mod n`` when nothing passes."""
    chosen = np.flatnonzero(np.abs(acc) >= np.float32(lam))
    return chosen if chosen.size else np.array([step % acc.size])
