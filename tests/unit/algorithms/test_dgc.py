"""DGC (hvd_sparse/algorithms/dgc.py) on N simulated ranks: momentum correction, factor masking and
selection against tests/reference/dgc.py, the sampled threshold, warm-up, local clipping,
non-finite steps, checkpoints, and its options."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from hvd_sparse import ConfigurationError
from hvd_sparse.algorithms import DGC
from hvd_sparse.algorithms.base import StepContext
from hvd_sparse.backends import get_backend
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine
from tests.reference.dgc import dgc_density, dgc_momentum_step, dgc_unsampled_selection
from tests.reference.engine import expected_step
from tests.unit.algorithms.simulated import NP, heavy_tailed, make_engines, residual_of, sent_where


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_dgc_momentum_correction_masking_and_selection_match_reference(nesterov, size):
    """Tensors of n <= 2/ρ are not sampled, so the selection is exactly re-derivable."""
    density, momentum = 0.05, 0.9
    algorithm = DGC(density, momentum=momentum, nesterov=nesterov)
    engines, group = make_engines(algorithm, size), LocalGroup(size)
    rng = np.random.default_rng(30 + size)
    n = 40  # <= 2 / 0.05
    u = [np.zeros(n, np.float32) for _ in range(size)]
    v = [np.zeros(n, np.float32) for _ in range(size)]
    for _ in range(15):
        grads = [heavy_tailed(rng, (n,)) for _ in range(size)]
        outputs = group.run([e.step("w", [grads[r]]) for r, e in enumerate(engines)])
        velocities, selections = [], []
        for r in range(size):
            u[r], v[r] = dgc_momentum_step(u[r], v[r], grads[r], momentum, nesterov)
            velocities.append(v[r].copy())
            selections.append(dgc_unsampled_selection(v[r], density))
        average, residuals, _ = expected_step(velocities, selections, "gather")
        for r, engine in enumerate(engines):
            np.testing.assert_allclose(outputs[r][0], average, rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(engine.buckets["w"].residual, residuals[r])
            u[r][selections[r]] = 0  # momentum factor masking
            v[r] = residuals[r]
            np.testing.assert_array_equal(engine.buckets["w"].momentum, u[r])
        assert engines[0].stats()["selected"] == math.ceil(n * density)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_dgc_unsampled_ties_take_the_lowest_indices_and_nan_selects_nothing(backend):
    """An unsampled bucket sends, as the authors do, the first k of ``|v| >= λ`` in index order, λ
    the k-th largest |v|: with |v| tied at λ that may leave a larger |v| behind; a NaN makes λ
    NaN, and nothing passes."""
    backend_ = get_backend(backend)
    algorithm = DGC(0.1, momentum=0.0)
    ctx = StepContext(key="w", step=0, rank=0, size=1, numel=40, backend=backend_)
    velocity = np.tile(np.array([1, -3, 2, 3, 0, -3, 1, 2], np.float32), 5)  # k = 4 of 40
    behind = np.concatenate([np.ones(39, np.float32), [5.0]]).astype(np.float32)   # λ = 1
    np.testing.assert_array_equal(dgc_unsampled_selection(behind, 0.1), [0, 1, 2, 3])
    for values in (velocity, -velocity, np.roll(velocity, 3), behind):
        idx = algorithm.select_local(backend_.from_numpy(values.copy()), algorithm.init_control(ctx), ctx)
        np.testing.assert_array_equal(backend_.to_numpy(idx), dgc_unsampled_selection(values, 0.1))
    values = velocity.copy()
    values[17] = np.nan
    control = algorithm.init_control(ctx)
    assert backend_.numel(algorithm.select_local(backend_.from_numpy(values), control, ctx)) == 0
    assert math.isnan(control.threshold)


def test_dgc_sampled_threshold_sends_at_most_k_and_masks_momentum_where_sent():
    size, density = 3, 0.01
    algorithm = DGC(density, momentum=0.5)
    engines, group = make_engines(algorithm, size), LocalGroup(size)
    rng = np.random.default_rng(4)
    n = 30_000
    k = math.ceil(n * density)
    u = [np.zeros(n, np.float32) for _ in range(size)]
    for step in range(6):
        grads = [[heavy_tailed(rng, (n,))] for _ in range(size)]
        velocities = []
        for r in range(size):
            u[r] = u[r] * np.float32(0.5) + grads[r][0]
            velocities.append(residual_of(engines[r], "w", n) + u[r])
        outputs = group.run([e.step("w", grads[r]) for r, e in enumerate(engines)])
        residuals = [e.buckets["w"].residual.copy() for e in engines]
        selections = [sent_where(res, vel) for res, vel in zip(residuals, velocities, strict=True)]
        for r, sel in enumerate(selections):
            assert 0.8 * k <= sel.size <= k, (step, r, sel.size, k)
            lam = engines[r].buckets["w"].control.threshold
            assert np.abs(velocities[r][sel]).min() >= np.float32(lam)
            u[r][sel] = 0
            np.testing.assert_array_equal(engines[r].buckets["w"].momentum, u[r])
        average, expected_residuals, union = expected_step(velocities, selections, "gather")
        np.testing.assert_allclose(outputs[0][0], average, rtol=1e-5, atol=1e-6)
        for r in range(size):
            np.testing.assert_array_equal(residuals[r], expected_residuals[r])
        assert engines[0].stats()["k"] == k and 0.8 <= union / k <= size


def test_dgc_warmup_follows_the_authors_schedule():
    densities = [dgc_density(0.001, 4, e) for e in range(6)]
    assert [round(100 * (1 - d), 1) for d in densities] == [74.9, 93.7, 98.4, 99.6, 99.9, 99.9]
    algorithm = DGC(0.001, warmup_epochs=4)
    engines, group = make_engines(algorithm, 2), LocalGroup(2)
    rng = np.random.default_rng(5)
    n = 50_000
    for epoch in range(6):
        algorithm.set_epoch(epoch)
        group.run([e.step("w", [rng.standard_normal(n).astype(np.float32)]) for e in engines])
        stats = engines[0].stats()
        assert stats["density_target"] == pytest.approx(densities[epoch])
        assert stats["k"] == math.ceil(n * densities[epoch])
        assert stats["selected"] <= stats["k"]
    with pytest.raises(ConfigurationError, match="epoch must be"):
        algorithm.set_epoch(-1)


def test_dgc_local_clipping_scales_to_clip_over_sqrt_n():
    size = 4
    engines, group = make_engines(DGC(0.5, momentum=0.0, clip_norm=1.0), size), LocalGroup(size)
    grads = [[np.full(16, 3.0 * (r + 1), np.float32)] for r in range(size)]  # norms 12, 24, ...
    outputs = group.run([e.step("w", grads[r]) for r, e in enumerate(engines)])
    # Clipped to norm 1/sqrt(4) = 0.5: sixteen entries of 0.125; k = 8 of them are sent.
    for engine in engines:
        residual = engine.buckets["w"].residual
        assert np.count_nonzero(residual == 0) == 8
        assert np.linalg.norm(residual) == pytest.approx(0.125 * math.sqrt(8), rel=1e-5)
    np.testing.assert_allclose(outputs[0][0], [0.125] * 8 + [0] * 8, rtol=1e-5)


def test_dgc_nonfinite_step_leaves_momentum_and_velocity_untouched():
    engines, group = make_engines(DGC(0.25, momentum=0.9), 2), LocalGroup(2)
    good = [[np.arange(1, 9, dtype=np.float32)] for _ in range(2)]
    group.run([e.step("w", good[r]) for r, e in enumerate(engines)])
    before = [(e.buckets["w"].momentum.copy(), e.buckets["w"].residual.copy()) for e in engines]
    bad = [[np.arange(1, 9, dtype=np.float32)], [np.full(8, np.nan, np.float32)]]
    with pytest.warns(RuntimeWarning, match="non-finite gradient in 'w' on rank 1"):
        group.run([e.step("w", bad[r]) for r, e in enumerate(engines)])
    np.testing.assert_array_equal(engines[1].buckets["w"].momentum, before[1][0])
    np.testing.assert_array_equal(engines[1].buckets["w"].residual, before[1][1])
    assert not np.array_equal(engines[0].buckets["w"].momentum, before[0][0])


def test_dgc_checkpoint_resumes_momentum_exactly():
    size, rng = 2, np.random.default_rng(6)
    batches = [[[heavy_tailed(rng, (3000,))] for _ in range(size)] for _ in range(8)]
    original = make_engines(DGC(0.01), size)
    group = LocalGroup(size)
    for grads in batches[:4]:
        group.run([e.step("w", grads[r]) for r, e in enumerate(original)])
    resumed = make_engines(DGC(0.01), size)
    for engine, state in zip(resumed, [e.state_dict() for e in original], strict=True):
        engine.load_state_dict(state)
    for grads in batches[4:]:
        expected = group.run([e.step("w", grads[r]) for r, e in enumerate(original)])
        got = group.run([e.step("w", grads[r]) for r, e in enumerate(resumed)])
        for a, b in zip(expected, got, strict=True):
            np.testing.assert_array_equal(a[0], b[0])
    bigger = [Engine(DGC(0.01), NP, r, 3) for r in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for r, engine in enumerate(bigger):
            engine.load_state_dict(original[r % 2].state_dict())
    LocalGroup(3).run([e.step("w", [np.ones(3000, np.float32)]) for e in bigger])
    u = bigger[0].buckets["w"].momentum  # reset, then one step of ones, masked
    assert set(np.unique(u)) <= {0.0, 1.0}


@pytest.mark.parametrize(("options", "message"), [
    (dict(momentum=1.5), "momentum must be a number in"),
    (dict(clip_norm=0), "clip_norm must be in"),
    (dict(upper=0.9), "upper must be in"),
    (dict(lower=0), "lower must be in"),
    (dict(sample_ratio=0), "sample_ratio must be in"),
    (dict(warmup_epochs=-2), "warmup_epochs must be"),
    (dict(nesterov="yes"), "nesterov must be"),
    (dict(pattern="union"), "pattern must be one of"),
])
def test_bad_hyperparameters_name_the_option(options, message):
    with pytest.raises((ConfigurationError, TypeError), match=message):
        DGC(0.01, **options)
