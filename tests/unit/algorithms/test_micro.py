"""MiCRO (hvd_sparse/algorithms/micro.py): its pure rules (equal partitions, their rotation, the
initial threshold, the paper's scaling rule and the tracking controller, the imbalance metric, the
refusal of models smaller than the job), the single-rank case and a short simulated run without
build-up. What MiCRO shares with ExDyna on simulated ranks is in test_exdyna.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hvd_sparse import ConfigurationError
from hvd_sparse.algorithms import MiCRO
from hvd_sparse.algorithms.micro import (
    CREEP,
    DEAD,
    GAIN_DOWN,
    GAIN_RANGE,
    GAIN_UP,
    LOWER,
    RAISE,
    TRACKING_BIAS_RATE,
    TRACKING_MAX_FACTOR,
    adapt_gain,
    agreed_start,
    equal_chunks,
    imbalance,
    initial_threshold,
    local_start,
    owned_partition,
    owner_of,
    paper_factor,
    rank_counts,
    refuse_fewer_entries_than_ranks,
    share_of_k,
    tracking_factor,
)
from hvd_sparse.backends import get_backend
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine

NP = get_backend("numpy")


# --- partitions (docs/algorithms.md#micro) --------------------------------------------------------
@pytest.mark.parametrize(("n", "size"), [(10, 3), (7, 7), (5, 1), (1001, 4), (64, 64)])
def test_equal_chunks_tile_the_vector_and_differ_by_at_most_one(n, size):
    bounds = equal_chunks(n, size)
    lengths = np.diff(bounds)
    assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == size + 1
    assert lengths.max() - lengths.min() <= 1 and lengths.min() >= 1
    assert np.all(lengths[: n % size] == n // size + 1)   # the longer chunks come first


def test_a_model_smaller_than_the_job_is_refused_naming_the_fix():
    refuse_fewer_entries_than_ranks("MiCRO", 4, 4)   # one entry per rank is enough
    with pytest.raises(ConfigurationError, match=r"the model has 3, the job 4 ranks; use a larger model"):
        refuse_fewer_entries_than_ranks("MiCRO", 3, 4)


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
def test_initial_threshold_is_one_over_two_sqrt_k():
    assert initial_threshold(1) == 0.5
    assert initial_threshold(100) == pytest.approx(0.05)
    assert MiCRO(0.01).k(10_000) == 100


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


# --- the tracking controller (docs/algorithms.md#tracking-controller) -----------------------------
def test_tracking_factor_hand_worked():
    # At λ/c twice the entries of λ·c, c = √2: slope α = ln 4 / (2 ln √2) = 2; K = 2k with bias 1
    # gives the damped Newton step 2^(0.5/2), and the outer loop lowers the bias by e^(-0.05).
    factor, bias = tracking_factor(2000, 1000, below=0.02, above=0.005, bias=1.0)
    assert factor == pytest.approx(2 ** 0.25)
    assert bias == pytest.approx(math.exp(-TRACKING_BIAS_RATE))
    # On target with no bias to correct: λ and the bias stay.
    assert tracking_factor(1000, 1000, below=0.02, above=0.005, bias=1.0) == pytest.approx((1.0, 1.0))


def test_tracking_factor_is_clipped():
    # Flat counts (slope clipped to 0.5) would move λ by K/k itself: at most 4x either way, and
    # the outer loop's error is clipped to [-1, 8].
    factor, bias = tracking_factor(10**9, 10, below=0.5, above=0.5, bias=1.0)
    assert factor == TRACKING_MAX_FACTOR
    assert bias == pytest.approx(math.exp(-8 * TRACKING_BIAS_RATE))
    factor, bias = tracking_factor(1, 10**6, below=0.5, above=0.5, bias=1.0)
    assert factor == 1 / TRACKING_MAX_FACTOR
    assert bias == pytest.approx(math.exp(TRACKING_BIAS_RATE))


def test_tracking_factor_gain_scales_the_newton_step_and_one_is_the_fixed_step():
    fixed = tracking_factor(2000, 1000, below=0.02, above=0.005, bias=0.8)
    assert tracking_factor(2000, 1000, below=0.02, above=0.005, bias=0.8, gain=1.0) == fixed
    factor, bias = tracking_factor(2000, 1000, below=0.02, above=0.005, bias=0.8, gain=0.25)
    assert factor == pytest.approx((2 / 0.8) ** (0.25 * 0.5 / 2))
    assert bias == fixed[1]   # the outer loop does not depend on the gain


def test_adapt_gain_halves_on_an_overshoot_and_grows_while_the_error_keeps_its_sign():
    # The error is ln(K/(k·b)): K = 2k with b = 1 is ln 2 above target.
    gain, error = adapt_gain(1.0, -0.5, 2000, 1000, 1.0)
    assert error == pytest.approx(math.log(2)) and gain == GAIN_DOWN
    gain, error = adapt_gain(0.5, 0.1, 2000, 1000, 1.0)
    assert gain == 0.5 * GAIN_UP
    # The bias is part of the target: K = 2k against b = 4 is below it.
    gain, error = adapt_gain(0.5, 0.1, 2000, 1000, 4.0)
    assert error == pytest.approx(math.log(0.5)) and gain == 0.5 * GAIN_DOWN
    # Within its range; an error of 0 (on target, or the first step) leaves it.
    assert adapt_gain(GAIN_RANGE[0], -1.0, 2000, 1000, 1.0)[0] == GAIN_RANGE[0]
    assert adapt_gain(GAIN_RANGE[1], 1.0, 2000, 1000, 1.0)[0] == GAIN_RANGE[1]
    assert adapt_gain(0.3, 0.0, 2000, 1000, 1.0)[0] == 0.3
    assert adapt_gain(0.3, 1.0, 1000, 1000, 1.0) == (0.3, 0.0)
    # No entry at all counts as one (the fallback index), as in tracking_factor.
    assert adapt_gain(1.0, 0.0, 0, 100, 1.0)[1] == pytest.approx(math.log(0.01))


def test_tracking_gain_is_adaptive_under_the_momentum_correction_only_by_default():
    assert not MiCRO(0.01, threshold_scaling="tracking").adaptive_gain           # unchanged
    assert MiCRO(0.01, threshold_scaling="tracking", momentum=0.9).adaptive_gain
    assert not MiCRO(0.01, threshold_scaling="tracking", momentum=0.9, tracking_gain="fixed").adaptive_gain
    assert MiCRO(0.01, threshold_scaling="tracking", tracking_gain="adaptive").adaptive_gain
    assert not MiCRO(0.01, momentum=0.9).adaptive_gain                           # paper mode
    with pytest.raises(ConfigurationError, match="pass threshold_scaling='tracking'"):
        MiCRO(0.01, tracking_gain="adaptive")
    with pytest.raises(ConfigurationError, match="tracking_gain"):
        MiCRO(0.01, threshold_scaling="tracking", tracking_gain="slow")
    # The gain's state is in the checkpoint only where it is used: others stay as they were.
    for momentum, kept in ((0.9, True), (0.0, False)):
        algorithm = MiCRO(0.1, threshold_scaling="tracking", momentum=momentum)
        group = [Engine(algorithm, NP, r, 2) for r in range(2)]
        grads = np.linspace(-1.0, 1.0, 100, dtype=np.float32)
        LocalGroup(2).run([e.step("model", [grads.copy()]) for e in group])
        control = group[0].state_dict()["buckets"]["model"]["control"]
        assert ("gain" in control and "error_prev" in control) == kept


def bursty_run(tracking_gain: str, steps: int = 1200) -> np.ndarray:
    """Union/k per step of MiCRO tracking with the momentum correction on 4 numpy ranks, on
    gradients of a fixed heterogeneous scale and sign plus noise (the count curve's pile-up
    under λ that makes the fixed controller overshoot)."""
    size, n = 4, 20_000
    rng = np.random.default_rng(3)
    scale = rng.lognormal(0.0, 1.5, n).astype(np.float32) * rng.choice([-1, 1], n).astype(np.float32)
    algorithm = MiCRO(0.002, threshold_scaling="tracking", momentum=0.9, tracking_gain=tracking_gain)
    engines = [Engine(algorithm, NP, r, size) for r in range(size)]
    group, ratios = LocalGroup(size), []
    for _ in range(steps):
        grads = [(scale * (0.3 + rng.standard_normal(n).astype(np.float32))) for _ in range(size)]
        group.run([e.step("model", [g]) for e, g in zip(engines, grads, strict=True)])
        stats = engines[0].stats()
        ratios.append(stats["union"] / stats["k"])
    return np.asarray(ratios)


def test_adaptive_gain_holds_the_density_steady_under_the_momentum_correction():
    """The fixed step overshoots into a limit cycle (most steps far under k, every few steps a
    burst); the adaptive gain damps it: the count sits near k at nearly every step, and the mean
    stays on target."""
    fixed, adaptive = bursty_run("fixed")[300:], bursty_run("auto")[300:]
    low, high = np.quantile(fixed, [0.1, 0.9])
    assert np.median(fixed) < 0.6 and high / low > 8, (low, np.median(fixed), high)
    low, high = np.quantile(adaptive, [0.1, 0.9])
    assert low > 0.7 and high < 1.35, (low, high)
    assert abs(adaptive.mean() - 1.0) < 0.05
    assert np.all(np.abs(adaptive.reshape(-1, 100).mean(axis=1) - 1.0) < 0.10)


# --- metrics and a short run ------------------------------------------------------------------------
def test_imbalance_is_the_padding_waste():
    assert imbalance(np.array([5, 5, 5, 5])) == 0.0
    assert imbalance(np.array([8, 0, 0, 0])) == 3.0   # 4 x 8 slots for 8 entries
    assert imbalance(np.array([0, 0])) == 0.0


def test_a_short_simulated_run_has_no_buildup_and_one_threshold():
    sim = pytest.importorskip("hvd_sparse.sim")
    pytest.importorskip("sklearn")
    records = sim.simulate(MiCRO(0.01), 4, 30, task="digits-mlp")
    assert len(records) == 30
    for record in records:
        assert record["union"] == sum(record["counts"]) and len(record["counts"]) == 4
        assert record["buildup"] == pytest.approx(record["union"] / record["k"])
        assert isinstance(record["threshold"], float)   # one λ, the same on every rank
    assert records[0]["threshold"] == pytest.approx(initial_threshold(records[0]["k"]))


# --- the local start (docs/algorithms.md#local-start) -------------------------------------------------
def test_local_start_rules():
    assert share_of_k(100, 0, 250, 1000) == 25 and share_of_k(1, 0, 10, 1000) == 1
    assert share_of_k(100, 5, 5, 1000) == 0 and share_of_k(1000, 0, 3, 1000) == 3
    assert local_start(np.array([0.5, 0.25, 0.0])) == 0.25     # a zero is never worth sending
    assert local_start(np.array([0.0, 0.0])) == math.inf and local_start(np.array([])) == math.inf
    assert agreed_start(math.log(0.1) + math.log(0.4), 2.0, 100) == pytest.approx(0.2)
    assert agreed_start(0.0, 0.0, 100) == initial_threshold(100)   # no rank had a threshold


@pytest.mark.parametrize("dtype", ["float32", "float16"])   # values (and riders) travel in it
def test_local_start_selects_about_k_then_every_rank_continues_alike(dtype):
    size, n, rng = 4, 40_000, np.random.default_rng(3)
    algorithm = MiCRO(0.01, threshold_scaling="tracking", threshold_start="local")
    engines = [Engine(algorithm, NP, r, size) for r in range(size)]
    scale = np.where(np.arange(n) < n // 4, 100.0, 1.0)       # one partition 100x the others
    grads = [[(rng.standard_normal(n) * scale * 1e-3).astype(dtype)] for _ in range(size)]
    grads[2][0][:] = 0.0                                       # a rank with nothing to send
    LocalGroup(size).run([e.step("model", grads[r]) for r, e in enumerate(engines)])
    stats = [e.stats() for e in engines]
    k = algorithm.k(n)
    own = [s["own_partition"] for s in stats]
    assert stats[2]["threshold"] == math.inf and stats[2]["selected"] == 1     # its fallback index
    for rank in (0, 1, 3):
        lo, hi = own[rank]
        magnitudes = np.sort(np.abs(grads[rank][0][lo:hi].astype(np.float32)))[::-1]
        assert stats[rank]["threshold"] == magnitudes[share_of_k(k, lo, hi, n) - 1]
        share = share_of_k(k, lo, hi, n)                                     # plus any ties
        assert stats[rank]["selected"] == np.count_nonzero(magnitudes >= magnitudes[share - 1]) >= share
    mean = math.exp(np.mean([math.log(stats[r]["threshold"]) for r in (0, 1, 3)]))
    rel = 1e-2 if dtype == "float16" else 1e-5                               # the riders' dtype
    assert stats[0]["next_threshold"] == pytest.approx(mean, rel=rel)
    assert all(s["next_threshold"] == stats[0]["next_threshold"] for s in stats)


def test_local_start_on_a_non_finite_first_step_uses_the_other_ranks():
    size, n = 3, 9000
    algorithm = MiCRO(0.01, threshold_start="local")
    engines = [Engine(algorithm, NP, r, size) for r in range(size)]
    grads = [[np.random.default_rng(r).standard_normal(n).astype(np.float32)] for r in range(size)]
    grads[1][0][5] = np.nan
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        LocalGroup(size).run([e.step("model", grads[r]) for r, e in enumerate(engines)])
    stats = [e.stats() for e in engines]
    assert stats[1]["threshold"] == math.inf and stats[1]["nonfinite_steps"] == 1
    mean = math.exp((math.log(stats[0]["threshold"]) + math.log(stats[2]["threshold"])) / 2)
    assert all(s["next_threshold"] == pytest.approx(mean, rel=1e-5) for s in stats)
    assert engines[1].buckets["model"].residual.tolist() == [0.0] * n         # kept as it was
