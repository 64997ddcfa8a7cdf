"""LAGS-SGD on the NumPy backend with N simulated ranks: grouping, the density rule, exactness of
the aggregate and of error feedback per group, the adaptive protocol, the assumption check."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from hvd_sparse import ConfigurationError, create
from hvd_sparse.algorithms import LAGS
from hvd_sparse.algorithms.lags import (
    AssumptionMonitor,
    adaptive_density,
    backward_times,
    check_assumption,
    fit_allgather_model,
    plan_groups,
)
from hvd_sparse.backends import get_backend
from hvd_sparse.comm import ALLGATHER, ALLREDUCE
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine
from hvd_sparse.engine.planning import plan_buckets
from tests.reference.engine import expected_step, topk_indices

NP = get_backend("numpy")


# --- grouping --------------------------------------------------------------------------------------
def test_groups_merge_backward_until_the_threshold():
    keys, sizes = list("abcdef"), [100, 5000, 3000, 200, 9000, 10]
    # backward: f(10) + e(9000) = 9010 >= 8192 closes group0; d + c + b = 8200 closes group1;
    # a (100) is left over at the front and forms group2.
    assert plan_groups(keys, sizes, 8192) == [
        ("group0", ["f", "e"]), ("group1", ["d", "c", "b"]), ("group2", ["a"])]
    assert plan_groups(keys, sizes, 0) == [(f"group{i}", [k]) for i, k in enumerate("fedcba")]
    assert plan_groups(keys, sizes, 10**9) == [("group0", list("fedcba"))]
    # "at least": a group that reaches the threshold exactly is closed.
    assert plan_groups(["a", "b"], [4096, 4096], 8192) == [("group0", ["b", "a"])]
    assert plan_groups(["a", "b", "c"], [4096, 4096, 1], 8192) == [("group0", ["c", "b", "a"])]
    assert plan_groups(["a", "b", "c"], [1, 4096, 4096], 8192) == [("group0", ["c", "b"]),
                                                                   ("group1", ["a"])]
    assert plan_buckets(LAGS(0.1), keys, sizes) == plan_groups(keys, sizes, 8192)  # default threshold 8192


def test_scope_follows_the_merge_threshold():
    assert LAGS(0.1, merge_threshold=0).scope == "tensor"   # any Horovod grouping in TensorFlow
    assert LAGS(0.1).scope == "group"                       # TensorFlow needs num_groups=1
    assert create("lags", merge_threshold=0).merge_threshold == 0


# --- the density rule (docs/algorithms.md#adaptive-density) -----------------------------------------
@pytest.mark.parametrize(("comp", "size", "density", "expected"), [
    # t = 0.0035 - 1e-3*log2(4) = 0.0015; rho* = 0.0015 / (2*3*1e-8*1e5) = 0.25
    (0.0035, 4, 0.01, 0.25),
    # t <= 0: the floor 0.001, then the user's density wins
    (0.001, 4, 0.01, 0.01),
    (0.002, 4, 0.0001, 0.001),
    # rho* = 3e-6 / 6e-3 = 0.0005 < floor 0.001
    (0.002003, 4, 0.0001, 0.001),
    # rho* = 166.3 > 1: the authors' overflow value 0.05
    (1.0, 4, 0.01, 0.05),
    (1.0, 4, 0.2, 0.2),
    # 2 ranks: t = 0.0035 - 1e-3 = 0.0025; rho* = 0.0025 / (2*1*1e-8*1e5) = 1.25 > 1 -> 0.05
    (0.0035, 2, 0.01, 0.05),
    # 2 ranks: t = 0.0012 - 1e-3 = 2e-4; rho* = 2e-4 / 2e-3 = 0.1
    (0.0012, 2, 0.01, 0.1),
    # one rank communicates in no time: the overflow branch
    (0.0035, 1, 0.01, 0.05),
])
def test_adaptive_density_hand_worked(comp, size, density, expected):
    assert adaptive_density(comp, 100_000, size, 1e-3, 1e-8, density) == pytest.approx(expected)


def test_adaptive_density_options_replace_the_quirks():
    assert adaptive_density(1.0, 100_000, 4, 1e-3, 1e-8, 0.01, overflow_density=0.5) == 0.5
    assert adaptive_density(0.001, 100_000, 4, 1e-3, 1e-8, 0.0001, min_density=0.002) == 0.002


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_allgather_model_fit_recovers_alpha_and_beta(world):
    alpha, beta, sizes = 1.5e-3, 2e-8, (256, 262144)
    seconds = tuple(alpha * math.log2(world) + (world - 1) * s * beta for s in sizes)
    assert fit_allgather_model(sizes, seconds, world) == pytest.approx((alpha, beta))
    # Noise that makes the large allgather look cheaper than the small one: beta clamps at 0.
    assert fit_allgather_model(sizes, (2e-3, 1e-3), world) == (pytest.approx(2e-3 / math.log2(world)), 0.0)
    assert fit_allgather_model(sizes, seconds, 1) == (0.0, 0.0)


def test_backward_times_from_readiness():
    own, remaining = backward_times({"group0": 0.01, "group1": 0.03, "group2": 0.06})
    assert own == pytest.approx({"group0": 0.01, "group1": 0.02, "group2": 0.03})
    assert remaining == pytest.approx({"group0": 0.05, "group1": 0.03, "group2": 0.0})
    # Out of plan order: a group's own time runs from the one that became ready just before it.
    own, _ = backward_times({"group0": 0.05, "group1": 0.02})
    assert own == pytest.approx({"group1": 0.02, "group0": 0.03})


# --- exactness on N simulated ranks --------------------------------------------------------------------
SHAPES = {"w1": (20, 12), "b1": (20,), "w2": (6, 20), "b2": (6,), "w3": (3, 6), "b3": (3,)}


def random_grads(rng, size):
    return [{k: (rng.standard_t(3, s) * rng.uniform(0.1, 2.0)).astype(np.float32) for k, s in SHAPES.items()}
            for _ in range(size)]


def run_groups(engines, plan, grads):
    """One training step of every group on every rank; returns {key: each rank's tensor}."""
    group = LocalGroup(len(engines))
    out: dict[str, list] = {}
    for name, members in plan:
        results = group.run([e.step(name, [grads[r][k] for k in members]) for r, e in enumerate(engines)])
        for i, key in enumerate(members):
            out[key] = [results[r][i] for r in range(len(engines))]
    return out


def flat_residual(engine, name, numel):
    bucket = engine.buckets.get(name)
    return np.zeros(numel, np.float32) if bucket is None else bucket.residual.copy()


@pytest.mark.parametrize("threshold", [0, 20, 10**6])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_group_matches_the_reference_and_keeps_exact_error_feedback(size, threshold):
    algorithm = LAGS(0.05, merge_threshold=threshold)
    engines = [Engine(algorithm, NP, r, size) for r in range(size)]
    keys = list(SHAPES)
    plan = plan_buckets(algorithm, keys, [int(np.prod(SHAPES[k])) for k in keys])
    assert len(plan) == {0: len(keys), 20: 4, 10**6: 1}[threshold]
    rng = np.random.default_rng(size * 100 + threshold % 97)
    for _ in range(15):
        grads = random_grads(rng, size)
        accs = {name: [flat_residual(e, name, sum(grads[0][k].size for k in members))
                       + np.concatenate([grads[r][k].ravel() for k in members])
                       for r, e in enumerate(engines)] for name, members in plan}
        out = run_groups(engines, plan, grads)
        for name, members in plan:
            n = accs[name][0].size
            k = max(1, min(n, int(0.05 * n)))
            average, residuals, _ = expected_step(accs[name], [topk_indices(a, k) for a in accs[name]],
                                                  "gather")
            for rank, engine in enumerate(engines):
                got = np.concatenate([out[key][rank].ravel() for key in members])
                np.testing.assert_allclose(got, average, rtol=1e-5, atol=1e-6)
                residual = engine.buckets[name].residual
                np.testing.assert_array_equal(residual, residuals[rank])
                sent = np.where(residual == 0, accs[name][rank], 0)
                np.testing.assert_array_equal(sent + residual, accs[name][rank])
    stats = engines[0].stats()
    assert not engines[0].measuring()
    assert stats["buckets"] == len(plan) and stats["adaptive_state"] == "off"
    assert set(stats["group_densities"]) == {name for name, _ in plan}
    assert set(stats["group_densities"].values()) == {0.05}


# --- the adaptive protocol ------------------------------------------------------------------------------
class RecordingGroup(LocalGroup):
    """LocalGroup that records every collective it executes (op, name)."""

    def __init__(self, size):
        super().__init__(size)
        self.log = []

    def _execute(self, phases):
        self.log += [(c.op, c.name) for c in phases[0]]
        return super()._execute(phases)


def adaptive_setup(size, **options):
    algorithm = LAGS(0.01, merge_threshold=20, adaptive=True, profile_steps=3, **options)
    engines = [Engine(algorithm, NP, r, size, prefix="job") for r in range(size)]
    keys = list(SHAPES)
    plan = plan_buckets(algorithm, keys, [int(np.prod(SHAPES[k])) for k in keys])
    return algorithm, engines, plan


def ready_times(plan, rank, step):
    # group i becomes ready at (i+1) * 10 ms, a little later on higher ranks and later steps
    return {name: (i + 1) * 0.010 * (1 + 0.1 * rank) + 0.001 * step for i, (name, _) in enumerate(plan)}


@pytest.mark.parametrize("comp_time", ["own", "remaining"])
def test_adaptive_densities_follow_the_rule_from_agreed_medians(comp_time):
    size, alpha, beta = 3, 1e-4, 1e-4   # slow "network": the groups get different densities
    _, engines, plan = adaptive_setup(size, alpha=alpha, beta=beta, comp_time=comp_time)
    group, rng = RecordingGroup(size), np.random.default_rng(5)
    assert engines[0].measuring()  # drivers make readiness times exact while profiling
    for step in range(4):
        run_groups(engines, plan, random_grads(rng, size))
        assert engines[0].measuring() == (step < 3)
        before = len(group.log)
        group.run([e.end_step(ready_times(plan, r, step)) for r, e in enumerate(engines)])
        issued = group.log[before:]
        if step < 2:
            assert issued == [] and engines[0].stats()["adaptive_state"] == "profiling"
        elif step == 2:  # the third sample: ONE named collective, then the densities are fixed
            assert issued == [(ALLREDUCE, "job.lags.profile")]
        else:
            assert issued == []
    # Hand computation: per rank the median over steps 0..2 is the step-1 value; then the mean
    # over ranks of each group's own / remaining backward time.
    names = [name for name, _ in plan]
    own = np.zeros(len(names))
    remaining = np.zeros(len(names))
    for rank in range(size):
        times = [ready_times(plan, rank, 1)[n] for n in names]
        own += np.diff([0.0, *times]) / size
        remaining += (times[-1] - np.array(times)) / size
    comp = own if comp_time == "own" else remaining
    numels = {name: sum(int(np.prod(SHAPES[k])) for k in members) for name, members in plan}
    expected = {n: adaptive_density(c, numels[n], size, alpha, beta, 0.01)
                for n, c in zip(names, comp, strict=True)}
    assert len(set(expected.values())) > 1  # the example does differentiate the groups
    for engine in engines:
        stats = engine.stats()
        assert stats["adaptive_state"] == "fixed"
        assert stats["group_densities"] == pytest.approx(expected)
        assert stats["group_comp_seconds"] == pytest.approx(dict(zip(names, comp, strict=True)))
        assert (stats["comm_alpha"], stats["comm_beta"]) == (alpha, beta)
        assert min(stats["group_densities"].values()) >= 0.01
    # Identical on every rank (computed from the agreed numbers only), and used from now on.
    assert all(e.stats()["group_densities"] == engines[0].stats()["group_densities"] for e in engines)
    run_groups(engines, plan, random_grads(rng, size))
    assert engines[0].stats()["k"] == sum(max(1, int(expected[n] * numels[n])) for n in names)


def test_calibration_times_named_allgathers_and_agrees():
    size = 2
    _, engines, plan = adaptive_setup(size, calibration_sizes=(8, 64), calibration_repeats=2)
    group, rng = RecordingGroup(size), np.random.default_rng(6)
    for step in range(3):
        run_groups(engines, plan, random_grads(rng, size))
        before = len(group.log)
        group.run([e.end_step(ready_times(plan, r, step)) for r, e in enumerate(engines)])
    calibration = [(ALLGATHER, f"job.lags.calibrate.{n}.{i}") for n in (8, 64) for i in ("warmup", 0, 1)]
    assert group.log[before:] == [*calibration, (ALLREDUCE, "job.lags.profile")]
    first, second = (e.stats() for e in engines)
    assert first["adaptive_state"] == "fixed"
    assert first["group_densities"] == second["group_densities"]
    assert (first["comm_alpha"], first["comm_beta"]) == (second["comm_alpha"], second["comm_beta"])
    assert first["comm_alpha"] >= 0 and first["comm_beta"] >= 0


def test_adaptive_without_readiness_times_warns_and_stays_uniform():
    """What TensorFlow does: no driver hands readiness times to end_step."""
    size = 2
    _, engines, plan = adaptive_setup(size, alpha=1e-4, beta=1e-7)
    rng = np.random.default_rng(2)
    run_groups(engines, plan, random_grads(rng, size))
    with pytest.warns(RuntimeWarning, match="only the PyTorch face"):
        run_groups(engines, plan, random_grads(rng, size))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            run_groups(engines, plan, random_grads(rng, size))
    stats = engines[1].stats()
    assert stats["adaptive_state"] == "uniform"
    assert set(stats["group_densities"].values()) == {0.01}


def test_checkpoint_keeps_fixed_densities_and_another_world_size_profiles_again():
    size = 2
    algorithm, engines, plan = adaptive_setup(size, alpha=1e-4, beta=2e-7)
    rng = np.random.default_rng(3)
    for step in range(3):
        run_groups(engines, plan, random_grads(rng, size))
        LocalGroup(size).run([e.end_step(ready_times(plan, r, step)) for r, e in enumerate(engines)])
    densities = engines[0].stats()["group_densities"]
    states = [e.state_dict() for e in engines]
    resumed = [Engine(algorithm, NP, r, size, prefix="job") for r in range(size)]
    for engine, state in zip(resumed, states, strict=True):
        engine.load_state_dict(state)
    run_groups(resumed, plan, random_grads(rng, size))
    assert resumed[0].stats()["group_densities"] == densities
    assert resumed[0].stats()["adaptive_state"] == "fixed"
    bigger = [Engine(algorithm, NP, r, 3, prefix="job") for r in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for rank, engine in enumerate(bigger):
            engine.load_state_dict(states[rank % size])
    run_groups(bigger, plan, random_grads(rng, 3))
    assert bigger[0].stats()["adaptive_state"] == "profiling"
    # Profiling restarts at the restored step: it still needs its samples, and no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(3):
            LocalGroup(3).run([e.end_step(ready_times(plan, r, step)) for r, e in enumerate(bigger)])
            run_groups(bigger, plan, random_grads(rng, 3))
    assert bigger[0].stats()["adaptive_state"] == "fixed"


@pytest.mark.parametrize(("options", "message"), [
    ({"merge_threshold": -1}, "merge_threshold must be an int >= 0"),
    ({"merge_threshold": 8192.0}, "merge_threshold must be an int >= 0"),
    ({"merge_threshold": True}, "merge_threshold must be an int >= 0"),
    ({"alpha": 1e-3}, "give both alpha and beta"),
    ({"alpha": -1.0, "beta": 1e-8}, "alpha must be a finite number"),
    ({"comp_time": "backward"}, "comp_time must be one of"),
    ({"profile_steps": 0}, "profile_steps must be an int >= 1"),
    ({"calibration_sizes": (1000, 10)}, "calibration_sizes must be two increasing"),
    ({"calibration_repeats": 0}, "calibration_repeats must be an int >= 1"),
    ({"adaptive": "yes"}, "adaptive must be True or False"),
    ({"min_density": 0}, "density must be"),
])
def test_bad_options_name_the_fix(options, message):
    with pytest.raises(ConfigurationError, match=message):
        LAGS(0.01, **options)


# --- the assumption check (docs/algorithms.md#assumption-check) -----------------------------------------
def test_assumption_delta_hand_worked():
    # d = 4, k = 1: top-k keeps 16 of 25, error 9; random-k expected error (1 - 1/4) * 25 = 18.75
    deltas = check_assumption({"w": np.array([3.0, -4.0, 0.0, 0.0]), "flat": np.ones(4)}, 0.25)
    assert deltas["w"] == pytest.approx(9 / 18.75)
    assert deltas["flat"] == pytest.approx(1.0)  # all magnitudes equal: top-k is no better
    assert check_assumption([np.zeros(3)], 0.5) == {"0": 0.0}


def test_assumption_accepts_framework_tensors_and_samples_random_k():
    torch = pytest.importorskip("torch")
    x = torch.tensor([1.0, 1.0, 1.0, 1.0])
    # Equal magnitudes: one random draw of k loses exactly what top-k loses.
    assert check_assumption([("x", x)], 0.5, randk="sampled", rng=np.random.default_rng(0)) == {"x": 1.0}
    with pytest.raises(ConfigurationError, match="randk must be"):
        check_assumption([x], 0.5, randk="uniform")


def test_assumption_monitor_is_the_ratio_of_means():
    monitor = AssumptionMonitor(0.25)
    monitor.add({"w": np.array([3.0, -4.0, 0.0, 0.0])})   # errors 9 and 18.75
    monitor.add({"w": np.array([1.0, 1.0, 1.0, 1.0])})    # errors 3 and 3
    assert monitor.delta()["w"] == pytest.approx((9 + 3) / (18.75 + 3))
    assert monitor.steps == 2
    monitor.reset()
    assert monitor.delta() == {}
