"""Framework-free checks for the workers that train with the corrections every method takes
(``momentum``, ``nesterov``, ``dense_steps``, ``warmup_steps``, ``dense_below``:
hvd_sparse/algorithms/corrections.py): torch_corrections.py and tf_corrections.py.

The baseline workers check DGC's momentum correction by reading ``state_dict()`` before and after
each step; this generalizes that to every method. Per bucket and step, from this rank's raw
gradient g and the bucket's state before the step (residual e, velocity u), ``accumulated``
computes what the engine must have sparsified -- u' = mu*u + g and e + u' (Nesterov u' = mu*(u + g)
and (e + u') + g), in the same float32 operations -- and every rank's such vector is allgathered
by the worker. ``check_bucket`` then checks, against tests/reference/engine.py:

* what each rank sent is the method's selection re-derived where the worker can (top-k, LAGS's
  per-group top-k, the hard threshold), else read off its new residual (the entries cleared to
  exactly zero); the whole bucket on dense steps and in dense buckets;
* the applied gradient is the average of every rank's accumulated values there;
* exact error feedback: this rank's new residual is its accumulated vector with the sent entries
  cleared, bit for bit (sent + new residual == old residual + what was accumulated);
* ``check_momentum``: the new velocity is u' cleared where this rank's values left (factor
  masking), and u' itself on dense steps and buckets; a rank whose gradient was not finite
  (``nonfinite="skip"``) keeps its residual and velocity bit for bit and contributes zeros
  (``check_skipped``); ``check_raised``: what a step that raised (``nonfinite="raise"``) leaves.
"""

from __future__ import annotations

import numpy as np

from tests.reference.engine import expected_step, topk_indices
from tests.reference.threshold import threshold_selection


def target_density(density: float, dense_steps: int, warmup_steps: int, step: int) -> float:
    """The step's target density by the corrections' definition: 1 for the first ``dense_steps``
    steps, then DGC's exponential warm-up max(rho^((t+1)/(W+1)), rho) over ``warmup_steps``."""
    if step < dense_steps:
        return 1.0
    t = step - dense_steps
    if t >= warmup_steps:
        return density
    return max(density ** ((t + 1) / (warmup_steps + 1)), density)


def k_of(density: float, numel: int) -> int:
    """floor(density * n), at least one, at most n (top-k, LAGS, random-k)."""
    return max(1, min(numel, int(density * numel)))


def accumulated(raw: np.ndarray, old: dict | None, momentum: float, nesterov: bool
                ) -> tuple[np.ndarray, np.ndarray | None]:
    """(accumulated vector, new velocity u' or None) of a bucket from its raw gradient and its
    ``state_dict`` entry before the step (None before its first step)."""
    g = raw.astype(np.float32)
    e = np.zeros_like(g) if old is None else old["residual"]
    if momentum == 0.0:
        return e + g, None
    u = np.zeros_like(g) if old is None or old["momentum"] is None else old["momentum"]
    mu = np.float32(momentum)
    if nesterov:
        u = (u + g) * mu
        return (e + u) + g, u
    u = u * mu + g
    return e + u, u


def selection_for(kind: str, accs: np.ndarray, density: float, step: int) -> list[np.ndarray] | None:
    """Every rank's selection re-derived from its accumulated vector, for the methods whose rule
    the worker can replay: "topk" (and LAGS's groups), "threshold" (the authors' λ for the step's
    target density); None for the others (read off the residuals)."""
    n = accs.shape[1]
    if kind == "topk":
        return [topk_indices(acc, k_of(density, n)) for acc in accs]
    if kind == "threshold":
        lam = 1.0 / (2.0 * np.sqrt(k_of(density, n)))
        return [threshold_selection(acc, lam, step) for acc in accs]
    return None


def check_bucket(rank: int, accs: np.ndarray, residuals: np.ndarray, finite: np.ndarray,
                 applied: np.ndarray, pattern: str, dense: bool, selections: list | None,
                 label: str) -> list[np.ndarray]:
    """accs, residuals: (N, n) every rank's accumulated vector (zeros for a rank whose gradient
    was not finite) and new residual; finite: (N,) booleans; applied: this rank's averaged
    gradient. Returns every rank's sent entries (as far as they can be seen: entries whose
    accumulated value is exactly zero move nothing either way)."""
    size, n = accs.shape
    if dense:
        selections = [np.arange(n)] * size
    elif selections is None:
        selections = [np.flatnonzero((res == 0) & (acc != 0))
                      for acc, res in zip(accs, residuals, strict=True)]
    selections = [sel if ok else np.zeros(0, dtype=np.int64)
                  for sel, ok in zip(selections, finite, strict=True)]
    mode = "gather" if dense or pattern == "gather" else "union"   # shared: every rank clears the same
    average, expected, _ = expected_step(list(accs), selections, mode)
    scale = float(np.abs(accs).max()) + 1e-30
    np.testing.assert_allclose(applied, average, rtol=1e-5, atol=2e-6 * scale,
                               err_msg=f"{label}: applied gradient differs from the reference")
    if finite[rank]:
        np.testing.assert_array_equal(
            residuals[rank], expected[rank],
            err_msg=f"{label}: new residual is not exactly the accumulated vector less what was sent")
        if dense:
            assert not residuals[rank].any(), f"{label}: a dense step kept a residual"
    if mode == "union" and not dense:
        union = np.unique(np.concatenate(selections))
        return [union] * size
    return selections


def check_momentum(new_u: np.ndarray | None, u_ref: np.ndarray, sent: np.ndarray, masked: bool,
                   label: str) -> None:
    """The velocity after the step: u' cleared where this rank's values were sent (``masked``),
    else u' (dense steps and buckets, DGC at k = n), bit for bit."""
    assert new_u is not None, f"{label}: no velocity kept"
    expected = u_ref.copy()
    if masked:
        expected[sent] = 0
    np.testing.assert_array_equal(new_u, expected,
                                  err_msg=f"{label}: velocity differs (correction or masking)")


def check_corrected_bucket(rank: int, step: int, algorithm, kind: str | None, g: np.ndarray,
                           applied: np.ndarray, old: dict | None, new: dict, sizes: list[int],
                           allgather, where: str) -> bool:
    """One bucket after one step, on this rank: ``algorithm`` the compressor's method (its
    corrections, pattern, density), ``kind`` how its selection is re-derived (``selection_for``;
    "shared": read off, and every rank sent the same k entries), ``g``/``applied`` this rank's raw
    and averaged gradient of the bucket, ``old``/``new`` its ``state_dict`` entries before and
    after, ``sizes`` its tensors' sizes, ``allgather(vector, name)`` every rank's copy of a
    vector. Checks the step's target density was followed where it can be seen, then
    ``check_bucket`` and ``check_momentum``, or ``check_skipped`` where ``g`` was not finite
    (then returns False)."""
    corrections = algorithm.corrections
    finite = bool(np.isfinite(g).all())
    if finite:
        acc, u_ref = accumulated(g, old, corrections.momentum, corrections.nesterov)
    else:
        acc, u_ref = np.zeros_like(g), None
    n = g.size
    rows = allgather(np.concatenate([acc, new["residual"], [float(finite)]]), f"test.{where}")
    accs, residuals, finites = rows[:, :n], rows[:, n:2 * n], rows[:, 2 * n] > 0
    dense = all(s < corrections.dense_below for s in sizes) or step < corrections.dense_steps
    density = target_density(algorithm.density, corrections.dense_steps, corrections.warmup_steps, step)
    if algorithm.name == "lags" and density != algorithm.density:
        # LAGS's group density in a warm-up: its own scaled by the schedule, computed as the
        # method does (the product may differ from the target in its last bit)
        density = min(1.0, algorithm.density * density / algorithm.density)
    selections = None if dense else selection_for(kind, accs, density, step)
    sent = check_bucket(rank, accs, residuals, finites, applied, algorithm.pattern, dense, selections, where)
    if kind == "shared" and not dense:
        assert sent[0].size <= k_of(density, n), f"{where}: ranks drew different indices"
    if not finite:
        check_skipped(old, new, where)
        return False
    if corrections.momentum:
        # DGC's authors keep the velocity where a bucket is sent whole (k = n)
        whole = dense or (algorithm.name == "dgc" and algorithm.k(n, density) >= n)
        masked = corrections.momentum_masking and not whole
        check_momentum(new["momentum"], u_ref, sent[rank], masked, where)
    return True


def check_skipped(old: dict | None, new: dict, label: str) -> None:
    """nonfinite="skip": the rank with the non-finite gradient kept residual and velocity."""
    for field in ("residual", "momentum"):
        before = None if old is None else old[field]
        after = new[field]
        if before is None:
            assert after is None or not np.any(after), f"{label}: {field} appeared on a skipped step"
        else:
            np.testing.assert_array_equal(after, before, err_msg=f"{label}: a skipped rank's {field} moved")


def check_raised(before: dict, after: dict, raws: dict[str, np.ndarray], momentum: float, nesterov: bool,
                 label: str, packed_with: dict[str, tuple[str, ...]] | None = None) -> None:
    """nonfinite="raise", on the step that raised: every bucket's step counter is as before the
    step (``Engine._keep_residual``, ``take_back``); where this rank's gradient was not finite its
    residual and velocity are as before, else it keeps everything accumulated, as if nothing had
    been sent: the old residual plus what was accumulated, and the velocity u' unmasked, bit for
    bit. ``raws``: this rank's raw gradient of every bucket; ``packed_with``: the tensors of a
    bucket packing per-tensor steps, by tensor (its step was finite only if all of theirs were)."""
    assert set(after) == set(before) == set(raws), (label, sorted(before), sorted(after), sorted(raws))
    for key, saved in before.items():
        now, where = after[key], f"{label} bucket {key}"
        assert now["step"] == saved["step"], (where, saved["step"], now["step"])
        finite = all(np.isfinite(raws[m]).all() for m in (packed_with or {}).get(key, (key,)))
        acc, velocity = accumulated(raws[key], saved, momentum, nesterov) if finite else (None, None)
        expected_velocity = velocity if finite else saved["momentum"]
        if expected_velocity is None:
            assert now["momentum"] is None or not np.any(now["momentum"]), f"{where}: a velocity appeared"
        else:
            np.testing.assert_array_equal(now["momentum"], expected_velocity,
                                          err_msg=f"{where}: velocity (finite={finite})")
        kept = acc if finite else saved["residual"]
        np.testing.assert_array_equal(now["residual"], kept, err_msg=f"{where}: residual (finite={finite})")
