"""Framework-free checks for the workers that train on the Adam path (hvd_sparse/engine/adam.py):
torch_adam.py, tf_adam.py and ddp_adam.py.

Per bucket and step, from this rank's raw gradient g and the bucket's ``state_dict`` entry before
the step:

* a dense step (the dense steps, or a bucket of ``dense_below`` tensors): the applied result is
  Adam's update of the average of every rank's gradient, m_hat / (sqrt(v_hat) + eps), from the
  moments m and v of the state before, which must come out updated (``check_dense``);
* a sparse step: ``accumulated`` computes what the engine must have sparsified -- u' = b1*u +
  (1-b1)*g, v' = b2*v + (1-b2)*g^2 from this rank's own g, then e + clamp((u'*c1) / (sqrt(v'*c2) +
  eps), bound) -- in the same float32 operations; correction_checks.check_bucket checks the
  applied average, the selection where it can be re-derived and exact error feedback, and u' and
  v' are the new moments, never masked (``check_adam_bucket``);
* with ``second_moment_refresh`` (a v shared by the ranks), v' is the refresh of v from the
  average of every rank's raw gradient on a refresh step and v itself between refreshes
  (``shared_second_moment``), the same on every rank.
"""

from __future__ import annotations

import numpy as np
from correction_checks import check_bucket, check_skipped, selection_for, target_density

F = np.float32


def accumulated(raw: np.ndarray, old: dict, path, step: int, shared_v: np.ndarray | None = None,
                v_updates: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(accumulated vector, new first moment, new second moment) of a sparse step; with
    ``shared_v`` that v, standing for ``v_updates`` steps, read and not updated."""
    update, u, v = moments_update(raw.astype(F), old, path, step, shared_v, v_updates)
    bound = F(path.update_bound)
    return old["residual"] + np.clip(update, -bound, bound), u, v


def moments_update(g: np.ndarray, old: dict | None, path, step: int, shared_v: np.ndarray | None = None,
                   v_updates: int = 0) -> tuple[np.ndarray, ...]:
    """(update, m', v') of Adam's moments after ``g`` (the average on a dense step, the rank's own
    gradient on a sparse one) from the moments before it (``shared_v``: ``accumulated``'s)."""
    m = np.zeros_like(g) if old is None or old.get("momentum") is None else old["momentum"]
    v = np.zeros_like(g) if old is None or old.get("second_moment") is None else old["second_moment"]
    m = m * F(path.beta1) + g * F(1 - path.beta1)
    if shared_v is None:
        v, v_updates = v * F(path.beta2) + (g * g) * F(1 - path.beta2), step + 1
    else:
        v = shared_v
    denominator = np.sqrt(v * F(path.second_scale(v_updates))) + F(path.eps)
    update = (m * F(path.first_scale(step + 1))) / denominator
    return update, m, v


def shared_second_moment(corrections, step: int, g: np.ndarray, old: dict, allgather,
                         where: str) -> np.ndarray:
    """The shared v expected after a sparse step: refreshed from the average of every rank's raw
    gradient (zeros from a rank whose gradient is not finite) on a refresh step, else as before."""
    if not corrections.refreshes_at(step):
        return old["second_moment"]
    sent = g.astype(F) if np.isfinite(g).all() else np.zeros_like(g, dtype=F)
    rows = allgather(sent, f"test.{where}.refresh")
    average = rows.sum(axis=0) * F(1.0 / rows.shape[0])
    keep = corrections.adam.beta2 ** corrections.second_moment_refresh
    return old["second_moment"] * F(keep) + (average * average) * F(1.0 - keep)


def check_dense(rank: int, step: int, path, g: np.ndarray, applied: np.ndarray, old: dict | None, new: dict,
                allgather, where: str) -> None:
    """A dense step: Adam of the average, m and v updated alike on every rank."""
    rows = allgather(g.astype(F), f"test.{where}.g")
    average = rows.sum(axis=0) / F(rows.shape[0])
    update, m, v = moments_update(average, old, path, step)
    np.testing.assert_allclose(applied, update, rtol=2e-4, atol=1e-6, err_msg=f"{where}: dense update")
    np.testing.assert_allclose(new["momentum"], m, rtol=1e-5, atol=1e-9, err_msg=f"{where}: m")
    np.testing.assert_allclose(new["second_moment"], v, rtol=1e-5, atol=1e-12, err_msg=f"{where}: v")
    assert not np.any(new["residual"]), f"{where}: a dense step kept a residual"
    del rank


def check_adam_bucket(rank: int, step: int, algorithm, kind: str | None, g: np.ndarray, applied: np.ndarray,
                      old: dict | None, new: dict, sizes: list[int], allgather, where: str) -> bool:
    """One bucket after one step on the Adam path, on this rank (arguments as
    correction_checks.check_corrected_bucket's). False where ``g`` was not finite (skipped)."""
    corrections, path = algorithm.corrections, algorithm.corrections.adam
    dense = all(s < corrections.dense_below for s in sizes) or step < corrections.dense_steps
    finite = bool(np.isfinite(g).all())
    if dense:
        check_dense(rank, step, path, g, applied, old, new, allgather, where)
        return True
    shared = None
    if corrections.second_moment_refresh:
        expected = shared_second_moment(corrections, step, g, old, allgather, where)
        np.testing.assert_allclose(new["second_moment"], expected, rtol=1e-5, err_msg=f"{where}: shared v")
        shared = new["second_moment"]
        rows = allgather(shared, f"test.{where}.v")
        assert (rows == rows[0]).all(), f"{where}: the shared v differs across ranks"
    if finite:
        acc, u_ref, v_ref = accumulated(g, old, path, step, shared,
                                        corrections.second_moment_updates(step) if shared is not None else 0)
    else:
        acc, u_ref, v_ref = np.zeros_like(g), None, None
    n = g.size
    rows = allgather(np.concatenate([acc, new["residual"], [float(finite)]]), f"test.{where}")
    accs, residuals, finites = rows[:, :n], rows[:, n:2 * n], rows[:, 2 * n] > 0
    density = target_density(algorithm.density, corrections.dense_steps, corrections.warmup_steps, step)
    selections = selection_for(kind, accs, density, step)
    check_bucket(rank, accs, residuals, finites, applied, algorithm.pattern, False, selections, where)
    if not finite:
        check_skipped(old, new, where)
        if shared is None:
            np.testing.assert_array_equal(new["second_moment"], old["second_moment"],
                                          err_msg=f"{where}: v kept")
        return False
    np.testing.assert_array_equal(new["momentum"], u_ref, err_msg=f"{where}: first moment (never masked)")
    np.testing.assert_array_equal(new["second_moment"], v_ref, err_msg=f"{where}: the rank's own v")
    return True


def by_tensor(buckets: dict) -> dict:
    """checks.by_tensor with the Adam path's fields cut too."""
    out = {}
    for key, saved in buckets.items():
        members = saved.get("members") or ()
        if not members:
            out[key] = saved
            continue
        sizes = [int(np.prod(shape, dtype=np.int64)) for shape in saved["shapes"]]
        offsets = np.cumsum([0, *sizes])
        for member, shape, lo, hi in zip(members, saved["shapes"], offsets[:-1], offsets[1:], strict=True):
            out[member] = {"shapes": [shape], "step": saved["step"], "control": None,
                           **{field: None if saved.get(field) is None else saved[field][lo:hi]
                              for field in ("residual", "momentum", "second_moment")}}
    return out
