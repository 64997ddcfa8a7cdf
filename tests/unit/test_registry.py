"""The registry (hvd_sparse/registry.py): methods by name, for tools and configuration files."""

from __future__ import annotations

import hvd_sparse
from hvd_sparse.algorithms import DGC, GaussianK, RandomK, Threshold


def test_registry_knows_every_baseline():
    assert {"topk", "randomk", "threshold", "gaussiank", "dgc"} <= set(hvd_sparse.available())
    for name, cls in [("randomk", RandomK), ("threshold", Threshold), ("gaussiank", GaussianK),
                      ("dgc", DGC)]:
        algorithm = hvd_sparse.create(name, density=0.02)
        assert type(algorithm) is cls and algorithm.density == 0.02
