"""TopK (hvd_sparse/algorithms/topk.py): k from the density (docs/algorithms.md#rounding-of-k), and
per-tensor steps that send each tensor's k largest magnitudes, in both patterns, against
tests/reference/engine.py. The engine's model-scope steps with TopK, its statistics and its
refusals are in tests/unit/engine/test_core.py."""

from __future__ import annotations

import numpy as np
import pytest

from hvd_sparse.algorithms import TopK
from hvd_sparse.comm.local import LocalGroup
from tests.reference.engine import topk_indices
from tests.unit.algorithms.simulated import SHAPES, assert_step, heavy_tailed, make_engines, run_step


@pytest.mark.parametrize(("density", "numel", "k"), [
    (0.01, 1000, 10), (0.01, 1099, 10), (0.01, 50, 1), (0.3, 10, 3), (1.0, 7, 7)])
def test_k_is_the_floor_of_density_times_n_and_at_least_one(density, numel, k):
    assert TopK(density).k(numel) == k


@pytest.mark.parametrize("pattern", ["gather", "union"])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_each_tensor_sends_its_k_largest_magnitudes(pattern, size):
    algorithm = TopK(0.1, pattern=pattern)
    engines, group = make_engines(algorithm, size), LocalGroup(size)
    rng = np.random.default_rng(40 + size)
    for _ in range(8):
        grads = [[heavy_tailed(rng, s) for s in SHAPES] for _ in range(size)]
        for i in range(len(SHAPES)):
            key = f"t{i}"
            accs, outputs, residuals = run_step(engines, group, key, [[g[i]] for g in grads])
            k = algorithm.k(accs[0].size)
            union = assert_step(accs, outputs, residuals, [topk_indices(acc, k) for acc in accs], pattern)
            stats = engines[0].buckets[key].stats
            assert stats.selected == k and stats.union() == union and k <= union <= size * k
