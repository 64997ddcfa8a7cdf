"""MiCRO (hvd_sparse/algorithms/micro.py): the rotation of partitions, the paper's threshold rule
and the single-rank case. What MiCRO shares with ExDyna on simulated ranks is in test_exdyna.py."""

from __future__ import annotations

import numpy as np
import pytest

from hvd_sparse.algorithms import MiCRO
from hvd_sparse.algorithms.micro import (
    CREEP,
    DEAD,
    LOWER,
    RAISE,
    initial_threshold,
    owned_partition,
    owner_of,
    paper_factor,
    rank_counts,
)
from hvd_sparse.backends import get_backend
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine

NP = get_backend("numpy")


# --- rotation (docs/algorithms.md#rotation-mapping) ----------------------------------------------
def test_rank_owns_partition_t_plus_r_and_counts_map_back():
    size = 5
    for step in range(12):
        owners = [owned_partition(r, step, size) for r in range(size)]
        assert owners == [(step + r) % size for r in range(size)]
        assert sorted(owners) == list(range(size))
        assert all(owner_of(owned_partition(r, step, size), step, size) == r for r in range(size))
        per_partition = np.arange(10, 10 + size)
        per_rank = rank_counts(per_partition, step)
        assert [per_rank[r] for r in range(size)] == [per_partition[(step + r) % size] for r in range(size)]


# --- the threshold rule (docs/algorithms.md#threshold-scaling) -----------------------------------
def test_paper_threshold_factor_and_its_dead_branch():
    k = 1000
    assert paper_factor(1101, k) == RAISE
    assert paper_factor(1100, k) == CREEP          # K/k = 1.1 exactly is inside the band
    assert paper_factor(1000, k) == CREEP
    assert paper_factor(910, k) == CREEP           # 0.91 > 0.909
    assert paper_factor(909, k) == LOWER           # K/k = 0.909 exactly is below
    assert paper_factor(950, k) == CREEP           # raises even below target: docs/algorithms.md#dead-branch
    assert paper_factor(950, k, band="symmetric") == DEAD
    assert paper_factor(1050, k, band="symmetric") == CREEP


def test_single_rank_counts_its_own_selection():
    """With one rank K_prev is its count, so λ does not decay forever (docs/algorithms.md#single-rank)."""
    engine = Engine(MiCRO(0.1), NP, 0, 1)
    rng = np.random.default_rng(0)
    for _ in range(200):   # λ0 = 0.05 is far below |g| ~ 1: K/k stays > 1.1, λ rises 0.5% a step
        LocalGroup(1).run([engine.step("model", [rng.standard_normal(1000).astype(np.float32)])])
    assert engine.stats()["next_threshold"] == pytest.approx(initial_threshold(100) * RAISE**200)
