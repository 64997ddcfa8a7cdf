"""Framework-free checks a multi-process worker runs after every step, on every rank.

The worker hands over, per bucket, every rank's accumulated vector (gradient + old residual,
allgathered by the worker itself), this rank's applied gradient and this rank's new residual;
the expected values come from tests/reference/engine.py, an implementation independent of the engine.
"""

from __future__ import annotations

import itertools
import re

import numpy as np

from tests.reference.engine import expected_step, topk_indices


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


def check_exclusive_step(rank: int, accs: np.ndarray, views: np.ndarray, applied: np.ndarray,
                         new_residual: np.ndarray, step: int, label: str) -> int:
    """MiCRO/ExDyna: ``views`` is (N, 3), every rank's [lo, hi, threshold] of the step. Re-derives
    every rank's selection (|acc| >= λ inside its own partition, else one rotating fallback),
    checks that the ranges tile the vector, the applied average on the union and exact error
    feedback. Returns the union size."""
    size, n = accs.shape
    ranges = sorted((int(lo), int(hi)) for lo, hi, _ in views)
    assert ranges[0][0] == 0 and ranges[-1][1] == n, f"{label}: ranges {ranges} do not cover [0, {n})"
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)), f"{label}: ranges {ranges} overlap"
    assert len({float(t) for t in views[:, 2]}) == 1, f"{label}: thresholds differ {views[:, 2]}"
    selections = []
    for r in range(size):
        lo, hi, threshold = int(views[r, 0]), int(views[r, 1]), float(views[r, 2])
        picked = lo + np.flatnonzero(np.abs(accs[r, lo:hi]) >= threshold)
        selections.append(picked if picked.size else np.array([lo + step % (hi - lo)]))
    union = np.concatenate(selections)
    assert np.unique(union).size == union.size, f"{label}: selections overlap"
    expected = np.zeros(n, dtype=np.float64)
    expected[union] = accs[:, union].astype(np.float64).sum(axis=0) / size
    scale = float(np.abs(accs).max()) + 1e-30
    np.testing.assert_allclose(applied, expected, rtol=1e-5, atol=2e-6 * scale,
                               err_msg=f"{label}: applied gradient differs from the reference")
    residual = accs[rank].copy()
    residual[union] = 0
    np.testing.assert_array_equal(new_residual, residual, err_msg=f"{label}: residual differs")
    return union.size


def check_op_refused(label: str, action, op_name: str, rank: int) -> None:
    """``action`` must raise ConfigurationError naming ``op=hvd.<op_name>`` -- directly, or as the
    error AutoGraph re-raises (a StagingError) while tracing a tf.function. Prints CHECKED."""
    from hvd_sparse import ConfigurationError

    try:
        action()
    except Exception as raised:  # the chain is searched below
        chain = [raised]
        while chain[-1].__cause__ or chain[-1].__context__:
            chain.append(chain[-1].__cause__ or chain[-1].__context__)
        assert any(isinstance(e, ConfigurationError) for e in chain), f"{label}: {chain}"
        assert f"op=hvd.{op_name} cannot be combined" in str(raised), str(raised)
        print(f"CHECKED {label} rank={rank}", flush=True)
        return
    raise AssertionError(f"{label}: op=hvd.{op_name} was not refused")


def outcome(hvd, label: str, body) -> list:
    """Every rank's outcome of ``body()``: ("ok", value) or (error type, message), by rank
    (``hvd``: horovod.torch or horovod.tensorflow)."""
    try:
        mine = ("ok", body())
    except Exception as error:
        mine = (type(error).__name__, re.sub(r"seen on rank \d+", "seen on rank R", str(error)))
    return hvd.allgather_object(mine, name=f"outcome.{label}")


def by_tensor(buckets: dict) -> dict:
    """A compressor's ``state_dict()["buckets"]`` with every bucket that packs per-tensor steps
    (``members``) cut into its tensors' own entries (residual and velocity), keyed as a bucket
    per tensor would be: what the per-tensor checks read."""
    out = {}
    for key, saved in buckets.items():
        members = saved.get("members") or ()
        if not members:
            out[key] = saved
            continue
        sizes = [int(np.prod(shape, dtype=np.int64)) for shape in saved["shapes"]]
        offsets = np.cumsum([0, *sizes])
        for member, shape, lo, hi in zip(members, saved["shapes"], offsets[:-1], offsets[1:], strict=True):
            out[member] = {"shapes": [shape], "step": saved["step"], "control": None,   # the bucket's
                           "residual": saved["residual"][lo:hi],
                           "momentum": None if saved["momentum"] is None else saved["momentum"][lo:hi]}
    return out
