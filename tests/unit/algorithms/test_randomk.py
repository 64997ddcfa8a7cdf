"""Random-k (hvd_sparse/algorithms/randomk.py) on N simulated ranks: exactly k entries drawn
reproducibly per seed, step, rank and bucket (or shared), exact error feedback, the same draws in
every framework, and its options."""

from __future__ import annotations

import numpy as np
import pytest

from hvd_sparse import ConfigurationError
from hvd_sparse.algorithms import RandomK
from hvd_sparse.backends import get_backend
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine
from tests.unit.algorithms.simulated import (
    NP,
    SHAPES,
    assert_step,
    heavy_tailed,
    make_engines,
    run_step,
    sent_where,
)


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


@pytest.mark.parametrize(("options", "message"), [
    (dict(shared_seed=1), "shared_seed must be"), (dict(seed=-1), "seed must be")])
def test_randomk_bad_options(options, message):
    with pytest.raises(ConfigurationError, match=message):
        RandomK(0.1, **options)
