"""Independent NumPy reference of what a sparsified step must produce, for the tests.

Written from docs/algorithms.md directly (not from hvd_sparse's engine) so that a test compares two
implementations: the engine under test and this one.
"""

from __future__ import annotations

import numpy as np


def topk_indices(acc: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest |acc| (by a full sort; ties are not expected in float data)."""
    return np.sort(np.argsort(-np.abs(acc), kind="stable")[:k])


def expected_step(accs: list[np.ndarray], selections: list[np.ndarray], pattern: str
                  ) -> tuple[np.ndarray, list[np.ndarray], int]:
    """The averaged gradient, each rank's new residual and the aggregated index count.

    gather: rank r contributes acc_r at its own selection S_r; residual_r = acc_r off S_r.
    union:  every rank contributes acc_r on the union U of all selections; residual_r = acc_r off U.
    """
    n, size = accs[0].size, len(accs)
    total = np.zeros(n, dtype=np.float64)
    residuals = []
    union = np.unique(np.concatenate(selections))
    for acc, sel in zip(accs, selections, strict=True):
        sent_at = sel if pattern == "gather" else union
        np.add.at(total, sent_at, acc[sent_at].astype(np.float64))
        residual = acc.copy()
        residual[sent_at] = 0
        residuals.append(residual)
    return (total / size).astype(np.float32), residuals, union.size
