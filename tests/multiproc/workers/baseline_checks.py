"""Framework-free checks for the baseline workers (torch_baselines.py, tf_baselines.py).

Every rank hands over, per bucket and step, every rank's accumulated vector (what the method
sparsified: gradient + residual, or DGC's velocity) and every rank's new residual, allgathered by
the worker itself, plus its own applied gradient. What each rank sent is either re-derived
independently (hard threshold: |a| >= λ; top-k) or, where the selection is random or iterative
(random-k, Gaussian-k, DGC), read off the rank's new residual -- the entries it cleared -- and
the aggregate is then checked against every rank's sent values.
"""

from __future__ import annotations

import numpy as np

from tests.reference.engine import expected_step, topk_indices
from tests.reference.threshold import threshold_selection

__all__ = ["check_step", "cleared", "threshold_selection", "topk_indices"]


def cleared(accs: np.ndarray, residuals: np.ndarray) -> list[np.ndarray]:
    """Each rank's sent entries, read off its new residual (fp32 transport: cleared to zero)."""
    return [np.flatnonzero((res == 0) & (acc != 0)) for acc, res in zip(accs, residuals, strict=True)]


def check_step(rank: int, accs: np.ndarray, residuals: np.ndarray, applied: np.ndarray,
               selections: list[np.ndarray], pattern: str, label: str, rtol: float = 1e-5,
               exact: bool = True) -> int:
    """The applied gradient is the average of what the selections say was sent, and this rank's
    new residual is its accumulated vector with the sent entries cleared; returns the size of
    the aggregated index set. ``exact=False`` where the worker can only recompute the vector the
    framework sparsified to within rounding (Keras's own gradients, DGC's clipping factor)."""
    average, expected_residuals, union = expected_step(list(accs), selections, pattern)
    scale = float(np.abs(accs).max()) + 1e-30
    np.testing.assert_allclose(applied, average, rtol=rtol, atol=2e-6 * scale,
                               err_msg=f"{label}: applied gradient differs from the reference")
    if exact:
        np.testing.assert_array_equal(residuals[rank], expected_residuals[rank],
                                      err_msg=f"{label}: residual is not exactly what was not sent")
    else:
        np.testing.assert_allclose(residuals[rank], expected_residuals[rank], rtol=1e-4,
                                   atol=1e-6 * scale, err_msg=f"{label}: residual differs")
    return union
