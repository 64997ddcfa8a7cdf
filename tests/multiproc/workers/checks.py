"""Framework-free checks a multi-process worker runs after every step, on every rank.

The worker hands over, per bucket, every rank's accumulated vector (gradient + old residual,
allgathered by the worker itself), this rank's applied gradient and this rank's new residual;
the expected values come from tests/reference.py, an implementation independent of the engine.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from reference import expected_step, topk_indices


def check_topk_step(rank: int, accs: np.ndarray, applied: np.ndarray, new_residual: np.ndarray,
                    density: float, pattern: str, label: str, exact: bool = True) -> None:
    """accs: (N, n) every rank's accumulated vector; applied, new_residual: this rank's (n,).

    ``exact=False`` when the worker could only recompute the gradient the framework used (Keras
    computes it inside ``train_on_batch``; an outside tape differs in the last bits): residuals
    are then compared to within float32 rounding."""
    n = accs.shape[1]
    k = max(1, min(n, int(density * n)))
    selections = [topk_indices(acc, k) for acc in accs]
    average, residuals, _ = expected_step(list(accs), selections, pattern)
    scale = float(np.abs(accs).max()) + 1e-30
    np.testing.assert_allclose(applied, average, rtol=1e-5, atol=2e-6 * scale,
                               err_msg=f"{label}: applied gradient differs from the reference")
    if not exact:
        np.testing.assert_allclose(new_residual, residuals[rank], rtol=1e-4, atol=1e-6 * scale,
                                   err_msg=f"{label}: residual differs from the reference")
        return
    np.testing.assert_array_equal(new_residual, residuals[rank],
                                  err_msg=f"{label}: residual differs from the reference")
    sent = np.where(new_residual == 0, accs[rank], 0)
    np.testing.assert_array_equal(sent + new_residual, accs[rank],
                                  err_msg=f"{label}: error feedback lost gradient mass")


def check_identical(rows: np.ndarray, label: str) -> None:
    """rows: (N, ...) one row per rank; every rank must hold bit-identical values."""
    for r in range(1, rows.shape[0]):
        np.testing.assert_array_equal(rows[r], rows[0], err_msg=f"{label}: rank {r} differs from rank 0")
