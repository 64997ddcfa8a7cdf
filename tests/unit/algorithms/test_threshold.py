"""The hard threshold (hvd_sparse/algorithms/threshold.py) on N simulated ranks: every step against
tests/reference/threshold.py, the authors' default λ, the fallback index, and its options."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hvd_sparse import ConfigurationError
from hvd_sparse.algorithms import Threshold
from hvd_sparse.comm.local import LocalGroup
from tests.reference.threshold import threshold_selection
from tests.unit.algorithms.simulated import SHAPES, assert_step, heavy_tailed, make_engines, run_step


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


@pytest.mark.parametrize(("options", "message"), [
    (dict(threshold=0), "threshold must be a positive"),
    (dict(threshold=float("nan")), "threshold must be a positive"),
    (dict(pattern="shared"), "pattern must be one of"),
])
def test_bad_hyperparameters_name_the_option(options, message):
    with pytest.raises((ConfigurationError, TypeError), match=message):
        Threshold(0.01, **options)
