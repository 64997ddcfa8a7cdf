"""Framework-free checks of one DEFT step that a multi-process worker runs on every rank.

``check_deft_step`` re-derives the whole step (unit table, every rank's k split, the master's
packing, the assignment, the selections, the union) from every rank's accumulated vector with
tests/reference/deft.py, independent of the engine, and compares the applied gradient, this rank's
new residual and the statistics. Where the worker cannot know the exact accumulated vectors
(Keras computes its gradient inside ``train_on_batch``), ``check_deft_step_from_residuals``
derives what was aggregated from the ranks' residuals instead and checks the aggregate.
"""

from __future__ import annotations

import numpy as np

from tests.reference.deft import deft_step


def check_deft_step(rank: int, accs: np.ndarray, applied: np.ndarray, new_residual: np.ndarray,
                    sizes: list[int], density: float, step: int, agreed_k: bool, stats: dict,
                    label: str) -> int:
    """accs: (N, n) every rank's accumulated vector. Returns how many ranks had an empty bin."""
    ref = deft_step(list(accs), sizes, density, step, agreed_k)
    scale = float(np.abs(accs).max()) + 1e-30
    np.testing.assert_allclose(applied, ref.average, rtol=1e-5, atol=2e-6 * scale,
                               err_msg=f"{label}: applied gradient differs from the reference")
    np.testing.assert_array_equal(new_residual, ref.residuals[rank],
                                  err_msg=f"{label}: residual differs from the reference")
    sent = np.where(new_residual == 0, accs[rank], 0)
    np.testing.assert_array_equal(sent + new_residual, accs[rank],
                                  err_msg=f"{label}: error feedback lost gradient mass")
    assert stats["counts"] == ref.counts, (label, stats["counts"], ref.counts)
    assert stats["union"] == ref.union == sum(stats["counts"]) + stats["common"], (label, stats)
    assert stats["master"] == step % accs.shape[0], (label, stats)
    return ref.fallback


def check_deft_step_from_residuals(rank: int, accs: np.ndarray, applied: np.ndarray,
                                   residuals: np.ndarray, stats: dict, label: str) -> None:
    """accs: (N, n) the accumulated vectors as recomputed outside the framework (equal to within
    float32 rounding); residuals: (N, n) every rank's new residual. Every rank must have cleared
    the same set U (the union), of the size the statistics report; the applied gradient is the
    mean of the accumulated vectors on U and zero elsewhere; off U the residual is what was
    accumulated."""
    union = residuals[rank] == 0
    for r in range(residuals.shape[0]):
        np.testing.assert_array_equal(residuals[r] == 0, union,
                                      err_msg=f"{label}: rank {r} cleared another index set")
    assert int(union.sum()) == stats["union"] == sum(stats["counts"]) + stats["common"], (label, stats)
    scale = float(np.abs(accs).max()) + 1e-30
    expected = np.where(union, accs.astype(np.float64).mean(axis=0), 0)
    np.testing.assert_allclose(applied, expected, rtol=1e-4, atol=1e-6 * scale,
                               err_msg=f"{label}: applied gradient is not the mean on the union")
    np.testing.assert_allclose(residuals[rank], np.where(union, 0, accs[rank]), rtol=1e-4,
                               atol=1e-6 * scale, err_msg=f"{label}: residual is not acc off the union")
