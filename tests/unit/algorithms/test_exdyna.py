"""ExDyna (and what it shares with MiCRO): the block layout and partition rules against hand-worked
cases and the authors' numbers, properties of the rebalancers, and N simulated ranks on real
gradients. MiCRO's own rules are in test_micro.py."""

from __future__ import annotations

import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hvd_sparse import ConfigurationError
from hvd_sparse.algorithms import ExDyna, MiCRO
from hvd_sparse.algorithms.exdyna import (
    block_bounds,
    block_edges,
    block_layout,
    can_give_block,
    histogram_blocks,
    initial_blocks,
    neighbour_update,
    sweep,
)
from hvd_sparse.algorithms.micro import equal_chunks, initial_threshold
from hvd_sparse.backends import get_backend
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine
from tests.unit.compare_runs import assert_step_identical

NP = get_backend("numpy")
OVER, UNDER = Fraction("1.05"), Fraction("0.95238")


# --- the authors' numbers (docs/algorithms.md#sanity-numbers) --------------------------------------
@pytest.mark.parametrize(("n", "block", "tail", "k", "lam", "shift"), [
    (11_173_962, 10_912, 74, 11_173, 4.730e-3, 10),       # ResNet-18 / CIFAR-10
    (11_220_132, 10_944, 13_476, 11_220, 4.720e-3, 10),   # ResNet-18 / CIFAR-100
    (6_166_250, 6_016, 5_866, 6_166, 6.367e-3, 6),        # GoogLeNet / CIFAR-10
    (28_949_319, 28_256, 15_175, 28_949, 2.939e-3, 28),   # LSTM / WikiText-2
])
def test_sanity_numbers_of_the_paper_setups(n, block, tail, k, lam, shift):
    assert block_layout(n, 8, 1024) == (1024, block, tail)
    assert ExDyna(0.001).k(n) == k
    assert initial_threshold(k) == pytest.approx(lam, rel=1e-3)
    assert int(block * (k / n)) == shift          # the sweep's load shift at density ρ
    assert initial_blocks(1024, 8) == [128] * 8
    assert can_give_block(33, 1024, 8) and not can_give_block(32, 1024, 8)   # min_blk = 32
    assert can_give_block(17, 1024, 16) and not can_give_block(16, 1024, 16)  # min_blk = 16


def test_initial_blocks_and_bounds():
    assert initial_blocks(1024, 3) == [342, 341, 341]
    bounds = block_bounds([342, 341, 341], 10, 10_250)
    assert bounds.tolist() == [0, 3420, 6830, 10_250]   # the tail (10) goes to the last partition
    assert equal_chunks(10, 3).tolist() == [0, 4, 7, 10]


def test_small_models_get_fewer_blocks_never_empty_ones():
    assert block_layout(20_000, 4, 1024) == (625, 32, 0)     # n < 32 x 1024: blocks of 32
    assert block_layout(100, 4, 1024) == (4, 25, 0)          # n < 32 x N: N blocks
    with pytest.raises(ConfigurationError, match="at least as many gradient entries as ranks"):
        block_layout(3, 4, 1024)


@given(n=st.integers(1, 10**7), size=st.integers(1, 64), blocks=st.sampled_from([1024, 2048, "auto"]))
def test_block_layout_always_covers_the_vector(n, size, blocks):
    requested = max(1024, 16 * size) if blocks == "auto" else blocks
    if n < size:
        return
    count, block, tail = block_layout(n, size, requested)
    assert block >= 1 and count >= size and tail >= 0 and count * block + tail == n


# --- the sweep (docs/algorithms.md#the-sweep) ------------------------------------------------------
def test_sweep_moves_one_block_from_overloaded_to_underloaded():
    blocks, moves = sweep([256, 256, 256, 256], [200, 100, 100, 100], union=500, n=32_768, block=32,
                          num_blocks=1024, over=OVER, under=UNDER)
    assert blocks == [255, 257, 256, 256] and moves == 1     # mean 125: 200 over, 100 under


def test_sweep_moves_right_when_the_right_side_is_overloaded():
    blocks, moves = sweep([256, 256, 256, 256], [100, 100, 110, 190], union=500, n=32_768, block=32,
                          num_blocks=1024, over=OVER, under=UNDER)
    assert blocks == [256, 256, 257, 255] and moves == 1     # mean 125: 110 under, 190 over


def test_sweep_is_sequential_predicted_loads_feed_the_next_boundary():
    common = dict(union=480, num_blocks=30, over=OVER, under=UNDER)
    # shift = int(block * union / n) = int(1000 * 480 / 9600) = 50: after the first move the middle
    # partition is predicted at 170 > 1.05 x 160, so the second boundary moves too.
    blocks, moves = sweep([10, 10, 10], [300, 120, 60], n=9600, block=1000, **common)
    assert blocks == [9, 10, 11] and moves == 2
    # With shift 0 the middle stays under-loaded and only the first boundary moves.
    blocks, moves = sweep([10, 10, 10], [300, 120, 60], n=10**9, block=1000, **common)
    assert blocks == [9, 11, 10] and moves == 1


def test_sweep_respects_min_blk_and_exact_band_edges():
    # N = 4, 1024 blocks: min_blk = 64, so a 64-block partition cannot give.
    blocks, moves = sweep([64, 320, 320, 320], [400, 100, 100, 100], union=700, n=32_768, block=32,
                          num_blocks=1024, over=OVER, under=UNDER)
    assert blocks == [64, 320, 320, 320] and moves == 0
    # mean 100: 105 is not over (strict), 95.238 would not be under; 106 / 95 are.
    assert sweep([8, 8], [105, 95], 200, 512, 32, 16, OVER, UNDER)[1] == 0
    assert sweep([8, 8], [106, 94], 200, 512, 32, 16, OVER, UNDER)[1] == 1


def _valid(blocks, num_blocks, size, floor):
    return sum(blocks) == num_blocks and all(b >= floor for b in blocks)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), size=st.integers(2, 12), extra=st.integers(0, 3000))
def test_any_count_sequence_keeps_the_table_valid(data, size, extra):
    num_blocks = 4 * size + extra
    floor = min(initial_blocks(num_blocks, size))
    floor = min(floor, math.ceil(num_blocks / (4 * size)))
    n = num_blocks * 32 + data.draw(st.integers(0, 31))
    blocks = initial_blocks(num_blocks, size)
    for _ in range(20):
        loads = data.draw(st.lists(st.integers(1, 10_000), min_size=size, max_size=size))
        blocks, _ = sweep(blocks, loads, sum(loads), n, 32, num_blocks, OVER, UNDER)
        assert _valid(blocks, num_blocks, size, floor)
        bounds = block_bounds(blocks, 32, n)
        assert bounds[0] == 0 and bounds[-1] == n and np.all(np.diff(bounds) > 0)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), size=st.integers(2, 12), extra=st.integers(0, 500))
def test_neighbour_rounds_agree_across_ranks_and_keep_the_table_valid(data, size, extra):
    """Every partition's owner decides its boundaries from its neighbours' (count, blocks) only;
    the ranges they end up with must tile the blocks exactly, whatever the counts."""
    num_blocks = 4 * size + extra
    floor = min(min(initial_blocks(num_blocks, size)), math.ceil(num_blocks / (4 * size)))
    blocks = initial_blocks(num_blocks, size)
    for step in range(20):
        loads = data.draw(st.lists(st.integers(1, 10_000), min_size=size, max_size=size))
        union = sum(loads)
        firsts = np.concatenate([[0], np.cumsum(blocks)[:-1]])
        updated = []
        for p in range(size):
            left = (loads[p - 1], blocks[p - 1]) if p > 0 else None
            right = (loads[p + 1], blocks[p + 1]) if p < size - 1 else None
            updated.append(neighbour_update(p, step, int(firsts[p]), blocks[p], loads[p], left, right,
                                            union, num_blocks, size, OVER, UNDER))
        for p in range(size - 1):   # shared boundaries agree
            assert updated[p][0] + updated[p][1] == updated[p + 1][0]
        assert updated[0][0] == 0
        blocks = [u[1] for u in updated]
        assert _valid(blocks, num_blocks, size, floor)


# --- histogram placement ------------------------------------------------------------------------------
def test_histogram_blocks_split_the_cumulative_load_evenly():
    assert histogram_blocks(np.ones(8), 4) == [2, 2, 2, 2]
    # All the load in the first two blocks: those become partitions of one block each, the rest
    # share what is left, every partition keeping at least one block.
    assert histogram_blocks(np.array([5.0, 5.0, 0, 0, 0, 0, 0, 0]), 4) == [1, 1, 1, 5]
    assert histogram_blocks(np.array([0, 0, 0, 0, 0, 0, 0, 9.0]), 4) == [5, 1, 1, 1]
    assert histogram_blocks(np.zeros(8), 4) is None
    assert block_edges(4, 10, 45).tolist() == [0, 10, 20, 30, 45]   # the tail in the last block


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=64), st.integers(1, 8))
@settings(max_examples=200, deadline=None)
def test_histogram_blocks_always_tile_the_blocks(loads, size):
    if len(loads) < size:
        return
    blocks = histogram_blocks(np.array(loads), size)
    if blocks is not None:
        assert sum(blocks) == len(loads) and len(blocks) == size and min(blocks) >= 1


def test_histogram_rebalancer_follows_a_concentrated_load_faster_than_the_sweep():
    """Load concentrated in the first 10% of the vector: the sweep moves one block per boundary
    per step, the histogram places the boundaries at once."""
    size, n, rng = 4, 64 * 1024, np.random.default_rng(1)
    scale = np.where(np.arange(n) < n // 10, 1.0, 0.05).astype(np.float32)
    waste = {}
    for mode in ("exact", "histogram"):
        engines = [Engine(ExDyna(0.01, rebalance=mode, threshold_scaling="tracking"), NP, r, size)
                   for r in range(size)]
        imbalances = []
        for _ in range(60):
            grads = [[(rng.standard_normal(n) * scale).astype(np.float32)] for _ in range(size)]
            LocalGroup(size).run([e.step("model", grads[r]) for r, e in enumerate(engines)])
            stats = engines[0].stats()
            assert stats["union"] == sum(stats["counts"])
            imbalances.append(stats["imbalance"])
        waste[mode] = float(np.mean(imbalances[30:]))
    assert waste["histogram"] < 0.5 * waste["exact"], waste


# --- configuration errors ------------------------------------------------------------------------
def test_configuration_errors_name_the_fix():
    with pytest.raises(ConfigurationError, match="rebalance must be one of"):
        ExDyna(0.01, rebalance="ring")
    with pytest.raises(ConfigurationError, match="underload_ratio < 1 < overload_ratio"):
        ExDyna(0.01, overload_ratio="0.9")
    with pytest.raises(ConfigurationError, match="threshold_scaling must be one of"):
        MiCRO(0.01, threshold_scaling="exact")
    with pytest.raises(ConfigurationError, match="threshold_start must be one of"):
        ExDyna(0.01, threshold_start="sampled")
    with pytest.raises(ConfigurationError, match="histogram_decay must be in"):
        ExDyna(0.01, rebalance="histogram", histogram_decay=1.0)
    engines = [Engine(ExDyna(0.01), NP, r, 300) for r in range(300)]
    with pytest.raises(ConfigurationError, match="num_blocks='auto'"):
        LocalGroup(300).run([e.step("model", [np.ones(20_000, np.float32)]) for e in engines])


def test_auto_blocks_lift_the_256_rank_limit():
    size = 300
    engines = [Engine(ExDyna(0.01, num_blocks="auto"), NP, r, size) for r in range(size)]
    rng = np.random.default_rng(0)
    for _ in range(3):
        grads = [[rng.standard_normal(40_000).astype(np.float32)] for _ in range(size)]
        LocalGroup(size).run([e.step("model", grads[r]) for r, e in enumerate(engines)])
    stats = engines[0].stats()
    assert stats["union"] == sum(stats["counts"]) and len(stats["counts"]) == size


# --- simulated ranks --------------------------------------------------------------------------------
METHODS = [
    MiCRO(0.02), MiCRO(0.02, threshold_scaling="tracking"), ExDyna(0.02), ExDyna(0.02, rebalance="neighbour"),
    ExDyna(0.02, threshold_scaling="tracking", threshold_band="symmetric"), ExDyna(0.02, rebalance="off"),
    ExDyna(0.02, rebalance="histogram"),
    ExDyna(0.02, threshold_scaling="tracking", threshold_start="local"),
    MiCRO(0.02, threshold_start="local"), ExDyna(0.02, rebalance="neighbour", threshold_start="local"),
]


@pytest.mark.parametrize("algorithm", METHODS, ids=repr)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_exclusive_selection_union_and_error_feedback(algorithm, size):
    engines, group = [Engine(algorithm, NP, r, size) for r in range(size)], LocalGroup(size)
    rng = np.random.default_rng(size)
    n = 5000
    scale = np.where(np.arange(n) > 4000, 10.0, 1.0).astype(np.float32)   # a "classifier" at the end
    ranges_seen = set()
    for step in range(40):
        grads = [[(rng.standard_normal(n) * scale * 0.05).astype(np.float32)] for _ in range(size)]
        accs = [(e.buckets["model"].residual.copy() if "model" in e.buckets else 0) + grads[r][0]
                for r, e in enumerate(engines)]
        outputs = group.run([e.step("model", grads[r]) for r, e in enumerate(engines)])
        stats = [e.stats() for e in engines]
        residuals = [e.buckets["model"].residual for e in engines]
        union = np.flatnonzero(residuals[0] != accs[0])   # every rank clears the whole union
        ranges = [tuple(s["own_partition"]) for s in stats]
        ranges_seen.update(ranges)
        # Partitions tile the vector; each rank selected exactly its entries >= λ (or one fallback).
        assert sorted(r[0] for r in ranges)[0] == 0
        assert sum(hi - lo for lo, hi in ranges) == n
        for rank, (lo, hi) in enumerate(ranges):
            mine = union[(union >= lo) & (union < hi)]
            expected = lo + np.flatnonzero(np.abs(accs[rank][lo:hi]) >= stats[rank]["threshold"])
            if expected.size == 0:
                expected = np.array([lo + step % (hi - lo)])
            np.testing.assert_array_equal(mine, expected)
            assert stats[rank]["selected"] == mine.size
            np.testing.assert_array_equal(residuals[rank][union], 0)
            keep = np.setdiff1d(np.arange(n), union)
            np.testing.assert_array_equal(residuals[rank][keep], accs[rank][keep])
        assert stats[0]["union"] == union.size == sum(s["selected"] for s in stats)
        if "counts" in stats[0]:   # neighbour mode knows only its own count
            assert stats[0]["counts"] == [s["selected"] for s in stats]
            assert all(s["partition"] == stats[0]["partition"] for s in stats)
        expected_average = sum(acc[union] for acc in accs) / size
        np.testing.assert_allclose(outputs[0][0][union], expected_average, rtol=1e-5, atol=1e-6)
        if step == 0 and algorithm.threshold_start == "local":
            # The local start: each rank's own threshold selects its partition's share of k by
            # magnitude, and every rank continues from their geometric mean.
            k = algorithm.k(n)
            for rank, (lo, hi) in enumerate(ranges):
                share = max(1, round(k * (hi - lo) / n))
                top = np.sort(np.abs(accs[rank][lo:hi]))[::-1][:share]
                assert stats[rank]["threshold"] == top[-1]
            mean = np.exp(np.mean([np.log(s["threshold"]) for s in stats]))
            assert all(s["next_threshold"] == pytest.approx(mean, rel=1e-5) for s in stats)
        else:
            assert all(s["threshold"] == stats[0]["threshold"] for s in stats)
        assert all(s["next_threshold"] == stats[0]["next_threshold"] for s in stats)
    if size > 1:
        assert len(ranges_seen) >= size   # partitions rotate


@pytest.mark.parametrize("algorithm", [ExDyna(0.02), ExDyna(0.02, rebalance="neighbour"),
                                       ExDyna(0.02, rebalance="histogram"),
                                       MiCRO(0.02, threshold_scaling="tracking"),
                                       ExDyna(0.02, threshold_scaling="tracking", momentum=0.9)],
                         ids=repr)
def test_checkpoint_resumes_with_identical_decisions(algorithm):
    size, rng = 3, np.random.default_rng(5)
    batches = [[[rng.standard_normal(3000).astype(np.float32)] for _ in range(size)] for _ in range(30)]
    original = [Engine(algorithm, NP, r, size) for r in range(size)]
    group = LocalGroup(size)
    for grads in batches[:15]:
        group.run([e.step("model", grads[r]) for r, e in enumerate(original)])
    resumed = [Engine(algorithm, NP, r, size) for r in range(size)]
    for engine, twin in zip(resumed, original, strict=True):
        engine.load_state_dict(twin.state_dict())
    for grads in batches[15:]:
        assert_step_identical(group, original, resumed, grads)
        assert resumed[0].stats()["threshold"] == original[0].stats()["threshold"]
        assert resumed[1].stats()["own_partition"] == original[1].stats()["own_partition"]


def test_resume_at_another_world_size_rebuilds_partitions_and_says_so():
    old = [Engine(ExDyna(0.05), NP, r, 2) for r in range(2)]
    LocalGroup(2).run([e.step("model", [np.arange(1.0, 2001.0, dtype=np.float32)]) for e in old])
    files = [e.state_dict() for e in old]
    new = [Engine(ExDyna(0.05), NP, r, 4) for r in range(4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rank, engine in enumerate(new):
            engine.load_state_dict(files[rank % 2])
        LocalGroup(4).run([e.step("model", [np.arange(1.0, 2001.0, dtype=np.float32)]) for e in new])
    messages = " ".join(str(w.message) for w in caught)
    assert "partitions rebuilt for 4 ranks" in messages
    assert len(new[0].stats()["partition"]) == 5


# --- 1000 steps on real gradients ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def digits_runs():
    sim = pytest.importorskip("hvd_sparse.sim")
    pytest.importorskip("sklearn")
    runs = {}
    for name, algorithm in [("micro", MiCRO(0.01)), ("exdyna", ExDyna(0.01)),
                            ("micro-tracking", MiCRO(0.01, threshold_scaling="tracking")),
                            ("exdyna-tracking", ExDyna(0.01, threshold_scaling="tracking"))]:
        runs[name] = sim.simulate(algorithm, 4, 1000, task="digits-mlp")
    return runs


def test_no_buildup_every_step(digits_runs):
    for records in digits_runs.values():
        for r in records:
            assert r["union"] == sum(r["counts"])


def test_tracking_threshold_holds_the_density(digits_runs):
    ratios = np.array([r["density_actual"] / r["density_target"] for r in digits_runs["exdyna-tracking"]])
    windows = ratios[100:].reshape(9, 100).mean(axis=1)
    assert np.all(np.abs(windows - 1) < 0.10), windows
    assert abs(ratios[100:].mean() - 1) < 0.05


def test_exdyna_balances_better_than_micro(digits_runs):
    for paper, tracked in [("micro", "exdyna"), ("micro-tracking", "exdyna-tracking")]:
        micro = np.mean([r["imbalance"] for r in digits_runs[paper][200:]])
        exdyna = np.mean([r["imbalance"] for r in digits_runs[tracked][200:]])
        assert exdyna < micro, (paper, micro, exdyna)
