"""World-size changes on simulated ranks: a checkpoint resumed at another N, and an elastic reset
(``Engine.adopt``: rank 0's agreed state, each surviving process's own residual).

Every step after the change is checked on every rank: the output is the average of what the ranks
sent (sent = accumulated - new residual, so an index aggregated twice or a value lost would show),
exclusive methods aggregate disjoint selections (union = sum of counts) whose partitions tile the
vector, and rank-consistent decisions (threshold, partition table, step) are identical.
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest

from hvd_sparse.algorithms import DEFT, DGC, LAGS, ExDyna, MiCRO, RandomK, Threshold, TopK
from hvd_sparse.backends import get_backend
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine
from hvd_sparse.engine.planning import plan_buckets

NP = get_backend("numpy")
SIZES = (700, 300, 1000)   # three tensors: DEFT splits the large ones into N units
NUMEL = sum(SIZES)
METHODS = [
    ExDyna(0.05), ExDyna(0.05, rebalance="histogram"), ExDyna(0.05, rebalance="neighbour"),
    ExDyna(0.05, threshold_scaling="tracking"), MiCRO(0.05), DEFT(0.05), DEFT(0.05, agreed_k=True),
    LAGS(0.05, merge_threshold=0), TopK(0.05), TopK(0.05, pattern="union", scope="model"),
    RandomK(0.05), Threshold(0.05), DGC(0.05),
    ExDyna(0.05, threshold_scaling="tracking", momentum=0.9, warmup_steps=4),   # the corrections
    LAGS(0.05, merge_threshold=0, momentum=0.9, nesterov=True, dense_below=400, dense_steps=2),
]


def gradients(rng, size):
    scale = np.where(np.arange(NUMEL) > 1500, 8.0, 1.0)   # load concentrated at the end
    return [[(rng.standard_normal(n) * 0.05 * part).astype(np.float32)
             for n, part in zip(SIZES, np.split(scale, np.cumsum(SIZES)[:-1]), strict=True)]
            for _ in range(size)]


def buckets_of(algorithm):
    """(bucket key, tensor positions) as a face would file the three tensors."""
    keys = [f"t{i}" for i in range(len(SIZES))]
    return [(bucket, [keys.index(k) for k in members])
            for bucket, members in plan_buckets(algorithm, keys, list(SIZES))]


def residual_before(engine, bucket, numel):
    """The residual the bucket's next step starts from (restored ones appear at that step)."""
    if bucket in engine.buckets:
        return engine.buckets[bucket].residual.copy()
    saved = engine._restored.get(bucket)
    if saved is not None and saved["residual"] is not None and (
            saved.get("own_residual") or engine._restored_size == engine.size):
        return saved["residual"].astype(np.float32)
    return np.zeros(numel, np.float32)


def run_step(engines, grads, algorithm, check_exact=True):
    """One step of every bucket on every rank, checked (module docstring)."""
    size, group = len(engines), LocalGroup(len(engines))
    for bucket, positions in buckets_of(algorithm):
        numel = sum(SIZES[p] for p in positions)
        before = [residual_before(e, bucket, numel) for e in engines]
        tensors = [[grads[r][p] for p in positions] for r in range(size)]
        outputs = group.run([e.step(bucket, tensors[r]) for r, e in enumerate(engines)])
        flat = [np.concatenate([np.ravel(t) for t in out]) for out in outputs]
        for r in range(1, size):
            np.testing.assert_array_equal(flat[r], flat[0])   # every rank applies the same update
        if check_exact:   # with momentum (DGC's, or the correction) acc != residual + grad
            sent = [before[r] + np.concatenate(tensors[r]) - e.buckets[bucket].residual
                    for r, e in enumerate(engines)]
            np.testing.assert_allclose(flat[0], sum(sent) / size, rtol=1e-5, atol=1e-7)
    stats = [e.stats() for e in engines]
    if engines[0].algorithm.exclusive:
        union = stats[0]["union"]
        assert union == sum(s["selected"] for s in stats) + stats[0].get("common", 0)
        if "own_partition" in stats[0]:
            ranges = sorted(tuple(s["own_partition"]) for s in stats)
            assert ranges[0][0] == 0 and ranges[-1][1] == NUMEL
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))   # tile, no overlap
    for key in ("threshold", "partition", "step", "master"):
        if key in stats[0] and not isinstance(engines[0].algorithm, (DGC, Threshold)):
            assert all(s[key] == stats[0][key] for s in stats), key
    return stats


def train(engines, algorithm, rng, steps):
    for _ in range(steps):
        run_step(engines, gradients(rng, len(engines)), algorithm, algorithm.corrections.momentum == 0)


@pytest.mark.parametrize("algorithm", METHODS, ids=repr)
@pytest.mark.parametrize("new_size", [2, 3, 4])
def test_resume_at_another_world_size_is_consistent_and_exclusive(algorithm, new_size):
    rng = np.random.default_rng(new_size)
    old = [Engine(algorithm, NP, r, 3) for r in range(3)]
    train(old, algorithm, rng, 9)
    files = [e.state_dict() for e in old]
    new = [Engine(algorithm, NP, r, new_size) for r in range(new_size)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "rebuilt for N ranks" (tested in each method's tests)
        for rank, engine in enumerate(new):
            engine.load_state_dict(files[rank % 3])
        train(new, algorithm, rng, 9)
    assert new[0].stats()["step"] == 18


@pytest.mark.parametrize("algorithm", METHODS, ids=repr)
@pytest.mark.parametrize("new_size", [1, 2, 3, 4])
def test_elastic_reset_keeps_each_survivors_residual(algorithm, new_size):
    """3 ranks; old rank 1 leaves; the survivors (old ranks 2 and 0, renumbered) and any newcomers
    adopt old rank 0's agreed state, the survivors with their own residuals."""
    rng = np.random.default_rng(10 + new_size)
    old = [Engine(algorithm, NP, r, 3) for r in range(3)]
    train(old, algorithm, rng, 9)
    agreed = old[0].agreed_state()
    assert all("residual" not in saved for saved in agreed["buckets"].values())
    survivors = [old[2], old[0]][:new_size]
    new = [Engine(algorithm, NP, r, new_size) for r in range(new_size)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a reset is not news: no warning
        for rank, engine in enumerate(new):
            own = None
            if rank < len(survivors):
                own = {key: bk.residual.copy() for key, bk in survivors[rank].buckets.items()}
            engine.adopt(agreed, own)
    for rank, engine in enumerate(new):   # the residual is the survivor's own, exactly
        for key, bucket in survivors[rank].buckets.items() if rank < len(survivors) else ():
            assert key not in engine.buckets   # buckets come back when their gradients first arrive
            np.testing.assert_array_equal(engine._restored[key]["residual"], bucket.residual)
    train(new, algorithm, rng, 9)
    stats = new[0].stats()
    assert stats["step"] == 18
    if "counts" in stats:
        assert len(stats["counts"]) == new_size


def test_neighbour_mode_after_a_resume_owns_partition_t_plus_r():
    """The bug this guards: rank r rebuilt partition r while at step t it owns (t + r) mod N, so
    ranges overlapped after a resume at another N (4 -> 3 counted thousands of entries twice)."""
    algorithm, rng = ExDyna(0.05, rebalance="neighbour"), np.random.default_rng(3)
    old = [Engine(algorithm, NP, r, 4) for r in range(4)]
    train(old, algorithm, rng, 7)   # t = 7: (7 + r) mod 3 != r
    new = [Engine(algorithm, NP, r, 3) for r in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for rank, engine in enumerate(new):
            engine.load_state_dict(old[rank].state_dict())
    stats = run_step(new, gradients(rng, 3), algorithm)
    starts = [s["own_partition"][0] for s in stats]
    assert starts.index(0) == (0 - 7) % 3   # partition 0 is owned by rank (0 - t) mod N


@pytest.mark.parametrize("shape", [(3, 4), (0,)])
def test_tensorflow_placeholder_is_not_a_constant(shape):
    """What Horovod allreduces in a gradient's place must not be a constant: Grappler's constant
    folding runs a Horovod collective on constant inputs while it optimizes the traced step, so a
    worker joining an elastic job (optimizing alone) waited there for ever."""
    tf = pytest.importorskip("tensorflow")
    from hvd_sparse.tensorflow.compressor import _placeholder

    @tf.function
    def placeholder(gradient):
        out = _placeholder(gradient, tf.float32)
        assert tf.get_static_value(out) is None
        return out

    assert placeholder(tf.ones(shape, tf.float16)).shape == (1,)
