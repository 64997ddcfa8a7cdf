"""The baseline sparsifiers (random-k, hard threshold, Gaussian-k, DGC) on the NumPy backend with
N simulated ranks: every step against an independent reference, exact error feedback, achieved
density where the method controls it, build-up, and the errors a user can cause."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

import hvd_sparse
from hvd_sparse import ConfigurationError, UnsupportedTensorError
from hvd_sparse.algorithms import DGC, GaussianK, RandomK, Threshold, TopK
from hvd_sparse.backends import get_backend
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine
from tests.reference.dgc import dgc_density, dgc_momentum_step, dgc_unsampled_selection
from tests.reference.engine import expected_step
from tests.reference.gaussiank import gaussiank_original, gaussiank_rescale
from tests.reference.threshold import threshold_selection

NP = get_backend("numpy")
SHAPES = [(20, 15), (15,), (6, 5, 4)]


def make_engines(algorithm, size, **options):
    return [Engine(algorithm, NP, rank, size, **options) for rank in range(size)]


def residual_of(engine, key, numel):
    bucket = engine.buckets.get(key)
    return np.zeros(numel, np.float32) if bucket is None else bucket.residual.copy()


def heavy_tailed(rng, shape, dtype=np.float32):
    return (rng.standard_t(3, shape) * rng.uniform(0.05, 2.0)).astype(dtype)


def flat(tensors):
    return np.concatenate([np.asarray(t, np.float32).ravel() for t in tensors])


def run_step(engines, group, key, grads):
    """One step of bucket ``key`` on every rank: (accumulated vectors, flat outputs, new residuals)."""
    numel = sum(int(np.prod(np.shape(t))) for t in grads[0])
    accs = [residual_of(e, key, numel) + flat(grads[r]) for r, e in enumerate(engines)]
    outputs = group.run([e.step(key, grads[r]) for r, e in enumerate(engines)])
    return accs, [flat(o) for o in outputs], [e.buckets[key].residual.copy() for e in engines]


def sent_where(residual, acc):
    """What a rank sent, read off its new residual: the entries it cleared."""
    return np.flatnonzero((residual == 0) & (acc != 0))


def assert_step(accs, outputs, residuals, selections, pattern):
    average, expected_residuals, union = expected_step(accs, selections, pattern)
    for rank, out in enumerate(outputs):
        np.testing.assert_allclose(out, average, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(residuals[rank], expected_residuals[rank])
    return union


# --- random-k -------------------------------------------------------------------------------------
@pytest.mark.parametrize("scope", ["tensor", "model"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_randomk_sends_exactly_k_random_entries_with_exact_error_feedback(scope, size):
    algorithm = RandomK(0.1, seed=3, scope=scope)
    engines, group = make_engines(algorithm, size), LocalGroup(size)
    rng = np.random.default_rng(size)
    distinct_seen = False
    for _ in range(12):
        grads = [[heavy_tailed(rng, s) for s in SHAPES] for _ in range(size)]
        buckets = ([("model", grads)] if scope == "model"
                   else [(f"t{i}", [[g[i]] for g in grads]) for i in range(len(SHAPES))])
        for key, bucket_grads in buckets:
            accs, outputs, residuals = run_step(engines, group, key, bucket_grads)
            k = algorithm.k(accs[0].size)
            selections = [sent_where(res, acc) for res, acc in zip(residuals, accs, strict=True)]
            assert all(sel.size == k for sel in selections)
            union = assert_step(accs, outputs, residuals, selections, "gather")
            assert k <= union <= size * k
            stats = engines[0].buckets[key].stats
            assert stats.selected == k and stats.union() == union
            if size > 1:
                distinct_seen |= not np.array_equal(selections[0], selections[1])
    assert size == 1 or distinct_seen
    assert 1 <= engines[0].stats()["buildup"] <= size


def test_randomk_shared_seed_draws_the_same_indices_and_sends_values_only():
    size, algorithm = 3, RandomK(0.1, seed=5, shared_seed=True)
    assert algorithm.pattern == "shared"
    engines, group = make_engines(algorithm, size), LocalGroup(size)
    rng = np.random.default_rng(0)
    for _ in range(8):
        grads = [[heavy_tailed(rng, (40, 5))] for _ in range(size)]
        accs, outputs, residuals = run_step(engines, group, "w", grads)
        selections = [sent_where(res, acc) for res, acc in zip(residuals, accs, strict=True)]
        assert all(np.array_equal(sel, selections[0]) for sel in selections)
        assert selections[0].size == 20
        assert_step(accs, outputs, residuals, selections, "gather")  # same set: gather == union
        stats = engines[1].stats()
        assert stats["union"] == 20 and stats["buildup"] == 1.0
        assert stats["bytes_sent"] == stats["bytes_received"] == 20 * 4  # no index on the wire


def test_randomk_draws_are_reproducible_uniform_and_depend_on_seed_step_rank_and_bucket():
    from hvd_sparse.algorithms.base import StepContext

    def draw(seed=0, step=0, rank=0, key="w", shared=False, numel=50):
        ctx = StepContext(rank, 4, step, key, numel, NP)
        return RandomK(0.1, seed=seed, shared_seed=shared).draw(ctx)

    assert np.array_equal(draw(), draw())
    assert not np.array_equal(draw(), draw(seed=1))
    assert not np.array_equal(draw(), draw(step=1))
    assert not np.array_equal(draw(), draw(rank=1))
    assert not np.array_equal(draw(), draw(key="b"))
    assert np.array_equal(draw(shared=True), draw(shared=True, rank=3))
    counts = np.bincount(np.concatenate([draw(step=t) for t in range(1000)]), minlength=50)
    assert counts.sum() == 5000 and counts.min() > 60 and counts.max() < 145  # mean 100


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_randomk_draws_the_same_indices_in_every_framework(framework):
    pytest.importorskip(framework)
    fb = get_backend(framework)
    grads = np.random.default_rng(1).standard_normal((2, 300)).astype(np.float32)

    def sent(backend):
        engines = [Engine(RandomK(0.05, seed=9), backend, r, 2) for r in range(2)]
        group = LocalGroup(2, backend)
        for _ in range(3):
            group.run([e.step("w", [backend.from_numpy(grads[r])]) for r, e in enumerate(engines)])
        return [np.flatnonzero(backend.to_numpy(e.buckets["w"].residual) == 0) for e in engines]

    for a, b in zip(sent(NP), sent(fb), strict=True):
        np.testing.assert_array_equal(a, b)


# --- hard threshold -------------------------------------------------------------------------------
@pytest.mark.parametrize("pattern", ["gather", "union"])
@pytest.mark.parametrize("scope", ["model", "tensor"])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_threshold_matches_reference_every_step(pattern, scope, size):
    algorithm = Threshold(0.05, pattern=pattern, scope=scope)
    engines, group = make_engines(algorithm, size), LocalGroup(size)
    rng = np.random.default_rng(10 + size)
    for step in range(10):
        grads = [[heavy_tailed(rng, s) * 0.3 for s in SHAPES] for _ in range(size)]
        buckets = ([("model", grads)] if scope == "model"
                   else [(f"t{i}", [[g[i]] for g in grads]) for i in range(len(SHAPES))])
        for key, bucket_grads in buckets:
            accs, outputs, residuals = run_step(engines, group, key, bucket_grads)
            lam = 1 / (2 * math.sqrt(max(1, int(0.05 * accs[0].size))))
            selections = [threshold_selection(acc, lam, step) for acc in accs]
            union = assert_step(accs, outputs, residuals, selections, pattern)
            stats = engines[0].buckets[key].stats
            assert stats.extra["threshold"] == pytest.approx(lam)
            assert max(s.size for s in selections) <= union <= sum(s.size for s in selections)


def test_threshold_default_is_the_authors_lambda_and_density_follows_the_gradient():
    assert Threshold.default_threshold(0.001, 11_173_962) == pytest.approx(4.73e-3, rel=1e-3)
    engines, group = make_engines(Threshold(0.01), 2), LocalGroup(2)
    rng = np.random.default_rng(0)
    densities = []
    for scale in (0.01, 0.1, 1.0):
        grads = [[rng.standard_normal(5000).astype(np.float32) * scale] for _ in range(2)]
        group.run([e.step("model", grads[r]) for r, e in enumerate(engines)])
        densities.append(engines[0].stats()["density_actual"])
    assert densities[0] < densities[1] < densities[2]       # not controlled: grows with |g|
    assert engines[0].stats()["threshold"] == pytest.approx(1 / (2 * math.sqrt(50)))


def test_threshold_sends_one_fallback_index_when_nothing_passes():
    engines, group = make_engines(Threshold(0.1, threshold=10.0), 2), LocalGroup(2)
    grads = [[np.full(8, 0.5 * (r + 1), np.float32)] for r in range(2)]
    for step in range(3):
        accs, outputs, residuals = run_step(engines, group, "model", grads)
        index = step % 8
        expected = np.zeros(8, np.float32)
        expected[index] = (accs[0][index] + accs[1][index]) / 2
        np.testing.assert_allclose(outputs[0], expected)
        assert engines[0].stats()["selected"] == 1 and residuals[0][index] == 0


# --- Gaussian-k ------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["original", "rescale"])
@pytest.mark.parametrize("size", [1, 3])
def test_gaussiank_matches_reference_every_step(variant, size):
    algorithm = GaussianK(0.02, variant=variant)
    engines, group = make_engines(algorithm, size), LocalGroup(size)
    rng = np.random.default_rng(20 + size)
    reference = gaussiank_original if variant == "original" else gaussiank_rescale
    for _ in range(10):
        grads = [[heavy_tailed(rng, s) for s in SHAPES] for _ in range(size)]
        for i in range(len(SHAPES)):
            accs, outputs, residuals = run_step(engines, group, f"t{i}", [[g[i]] for g in grads])
            selections = [reference(acc, 0.02) for acc in accs]
            if any(sel.size == 0 for sel in selections):
                continue  # the engine's fallback index; covered by the threshold test
            assert_step(accs, outputs, residuals, selections, "gather")
    assert "threshold" in engines[0].stats()


def test_gaussiank_lands_near_k_on_gaussian_data():
    size, algorithm = 4, GaussianK(0.01, scope="model")
    engines, group = make_engines(algorithm, size), LocalGroup(size)
    rng = np.random.default_rng(2)
    k = algorithm.k(20_000)
    for _ in range(5):
        grads = [[rng.standard_normal(20_000).astype(np.float32)] for _ in range(size)]
        accs, _, residuals = run_step(engines, group, "model", grads)
        counts = [sent_where(res, acc).size for res, acc in zip(residuals, accs, strict=True)]
        assert all(2 * k / 3 <= c <= 4 * k / 3 for c in counts), counts
        stats = engines[0].stats()
        assert max(counts) <= stats["union"] <= sum(counts)
        assert 2 / 3 <= stats["buildup"] <= size * 4 / 3


# --- DGC --------------------------------------------------------------------------------------------
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
            np.testing.assert_array_equal(engine.buckets["w"].control.momentum, u[r])
        assert engines[0].stats()["selected"] == math.ceil(n * density)


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
            np.testing.assert_array_equal(engines[r].buckets["w"].control.momentum, u[r])
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
    before = [(e.buckets["w"].control.momentum.copy(), e.buckets["w"].residual.copy()) for e in engines]
    bad = [[np.arange(1, 9, dtype=np.float32)], [np.full(8, np.nan, np.float32)]]
    with pytest.warns(RuntimeWarning, match="non-finite gradient in 'w' on rank 1"):
        group.run([e.step("w", bad[r]) for r, e in enumerate(engines)])
    np.testing.assert_array_equal(engines[1].buckets["w"].control.momentum, before[1][0])
    np.testing.assert_array_equal(engines[1].buckets["w"].residual, before[1][1])
    assert not np.array_equal(engines[0].buckets["w"].control.momentum, before[0][0])


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
    u = bigger[0].buckets["w"].control.momentum  # reset, then one step of ones, masked
    assert set(np.unique(u)) <= {0.0, 1.0}


# --- every method: precision, dtypes, errors, registry ----------------------------------------------
METHODS = [TopK, RandomK, Threshold, GaussianK, DGC]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("density", [0, -0.5, 1.01, float("inf"), "0.1", None])
def test_density_outside_unit_interval_is_refused_with_the_fix(method, density):
    with pytest.raises(ConfigurationError, match=r"density must be"):
        method(density)


@pytest.mark.parametrize("method", METHODS)
def test_integer_gradients_are_refused_on_every_rank_before_any_collective(method):
    size = 3
    engines, group = make_engines(method(0.1), size), LocalGroup(size)
    with pytest.raises(UnsupportedTensorError, match="floating-point") as raised:
        group.run([e.step("w", [np.arange(30, dtype=np.int64)]) for e in engines])
    assert raised.value.ranks_raised == [0, 1, 2]


@pytest.mark.parametrize("method", METHODS)
def test_fp16_and_bf16_gradients_work_with_fp32_residuals(method):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(7)
    for dtype, transport in ((np.float16, "float16"), (ml_dtypes.bfloat16, "float32")):
        engines, group = make_engines(method(0.2), 2), LocalGroup(2)
        for _ in range(3):
            grads = [[rng.standard_normal(60).astype(np.float32).astype(dtype)] for _ in range(2)]
            accs = [residual_of(e, "w", 60) + grads[r][0].astype(np.float32) for r, e in enumerate(engines)]
            outputs = group.run([e.step("w", grads[r]) for r, e in enumerate(engines)])
            assert outputs[0][0].dtype == dtype
            for r, engine in enumerate(engines):
                bucket = engine.buckets["w"]
                assert bucket.residual.dtype == np.float32 and bucket.value_dtype == transport
                if method is not DGC:  # DGC's residual is the velocity, not g + e
                    changed = np.flatnonzero(bucket.residual != accs[r])
                    rounded = accs[r][changed].astype(transport).astype(np.float32)
                    np.testing.assert_array_equal(rounded + bucket.residual[changed], accs[r][changed])


@pytest.mark.parametrize(("options", "message"), [
    (dict(shared_seed=1), "shared_seed must be"), (dict(seed=-1), "seed must be")])
def test_randomk_bad_options(options, message):
    with pytest.raises(ConfigurationError, match=message):
        RandomK(0.1, **options)


@pytest.mark.parametrize(("method", "options", "message"), [
    (Threshold, dict(threshold=0), "threshold must be a positive"),
    (Threshold, dict(threshold=float("nan")), "threshold must be a positive"),
    (Threshold, dict(pattern="shared"), "pattern must be one of"),
    (GaussianK, dict(variant="fast"), "variant must be one of"),
    (GaussianK, dict(max_loops=-1), "max_loops must be"),
    (DGC, dict(momentum=1.5), "momentum must be in"),
    (DGC, dict(clip_norm=0), "clip_norm must be in"),
    (DGC, dict(upper=0.9), "upper must be in"),
    (DGC, dict(lower=0), "lower must be in"),
    (DGC, dict(sample_ratio=0), "sample_ratio must be in"),
    (DGC, dict(warmup_epochs=-2), "warmup_epochs must be"),
    (DGC, dict(nesterov="yes"), "nesterov must be"),
    (DGC, dict(pattern="union"), "unexpected keyword"),
])
def test_bad_hyperparameters_name_the_option(method, options, message):
    with pytest.raises((ConfigurationError, TypeError), match=message):
        method(0.01, **options)


def test_registry_knows_every_baseline():
    assert {"topk", "randomk", "threshold", "gaussiank", "dgc"} <= set(hvd_sparse.available())
    for name, cls in [("randomk", RandomK), ("threshold", Threshold), ("gaussiank", GaussianK),
                      ("dgc", DGC)]:
        algorithm = hvd_sparse.create(name, density=0.02)
        assert type(algorithm) is cls and algorithm.density == 0.02
