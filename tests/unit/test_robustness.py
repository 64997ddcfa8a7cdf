"""Bad shapes, ranks that disagree, odd inputs: every case either trains or fails the same way on
every rank (N simulated ranks, comm/local.py, which raises where a real job would hang)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from hvd_sparse import ConfigurationError, RankMismatchError, create
from hvd_sparse.algorithms import TopK
from hvd_sparse.backends import get_backend
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine
from hvd_sparse.registry import available

NP = get_backend("numpy")

# Every method, and the ExDyna modes with their own code paths.
VARIANTS = [(m, {}) for m in available()] + [
    ("exdyna", {"rebalance": "neighbour"}), ("exdyna", {"rebalance": "histogram"}),
    ("exdyna", {"threshold_scaling": "tracking"}), ("topk", {"pattern": "union"}),
    ("randomk", {"shared_seed": True})]


def run_steps(method, options, size, numel, steps=3, seed=0):
    """Train ``steps`` steps of one bucket of ``numel`` entries on ``size`` ranks; returns each
    rank's last output, or raises what every rank raised."""
    engines = [Engine(create(method, density=0.1, **options), NP, r, size) for r in range(size)]
    rng = np.random.default_rng(seed)
    out = None
    for _ in range(steps):
        grads = [[rng.standard_normal(numel).astype(np.float32)] for _ in range(size)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = LocalGroup(size).run([e.step("model", grads[r]) for r, e in enumerate(engines)])
            LocalGroup(size).run([e.end_step() for e in engines])
    return out


@pytest.mark.parametrize(("method", "options"), VARIANTS, ids=lambda v: str(v))
@pytest.mark.parametrize("size", [2, 3, 4])
def test_every_method_trains_or_refuses_tiny_models_on_every_rank(method, options, size):
    for numel in sorted({1, size - 1, size, 31, 32 * size} - {0}):
        try:
            out = run_steps(method, options, size, numel)
        except RankMismatchError as error:  # some rank raised while others went on: a hang
            pytest.fail(f"{method} {options} N={size} n={numel}: {error}")
        except ConfigurationError as error:
            assert error.ranks_raised == list(range(size)), (method, numel, error)
            assert numel < size, f"{method} {options} refused n={numel} at N={size}: {error}"
            assert "use a larger model" in str(error), error
            continue
        for rank in range(1, size):
            np.testing.assert_array_equal(out[rank][0], out[0][0])


@pytest.mark.parametrize("method", ["micro", "exdyna", "deft"])
def test_partitioned_methods_refuse_fewer_entries_than_ranks_naming_the_fix(method):
    with pytest.raises(ConfigurationError, match="at least as many gradient entries as ranks") as raised:
        run_steps(method, {}, 2, 1)
    assert raised.value.ranks_raised == [0, 1]


def agree(configs, layouts, size=2):
    """Run the first-step configuration check of ``size`` ranks; returns the error or None."""
    engines = [Engine(create(m, **o), NP, r, size) for r, (m, o) in enumerate(configs)]
    try:
        LocalGroup(size).run([e.agree_on_config(layouts[r]) for r, e in enumerate(engines)])
    except RankMismatchError as error:
        assert error.ranks_raised == list(range(size))
        return str(error)
    return None


LAYOUT = [("conv.weight", (4, 3), "float32"), ("conv.bias", (4,), "float32"),
          ("fc.weight", (2, 4), "float32")]


def test_identical_configurations_pass_the_check():
    same = ("exdyna", {"density": 0.01})
    assert agree([same, same], [LAYOUT, LAYOUT]) is None
    # A NumPy scalar equal to the Python number is the same configuration.
    assert agree([("topk", {"density": 0.5}), ("topk", {"density": np.float64(0.5)})],
                 [LAYOUT, LAYOUT]) is None


@pytest.mark.parametrize(("configs", "layouts", "expected"), [
    ([("exdyna", {"density": 0.01}), ("exdyna", {"density": 0.02})], [LAYOUT, LAYOUT],
     "density=0.01 on rank 0, 0.02 on rank 1"),
    ([("exdyna", {"density": 0.01}), ("topk", {"density": 0.01})], [LAYOUT, LAYOUT],
     "rank 0 runs 'exdyna', ranks [1] run 'topk'"),
    ([("exdyna", {"density": 0.01}), ("micro", {"density": 0.01})], [LAYOUT, LAYOUT],
     "method: rank 0 runs 'exdyna'"),
    ([("exdyna", {}), ("exdyna", {"threshold_scaling": "tracking"})], [LAYOUT, LAYOUT],
     "threshold_scaling='paper' on rank 0, 'tracking' on rank 1"),
    ([("topk", {}), ("topk", {})], [LAYOUT, [*LAYOUT, ("extra.weight", (3,), "float32")]],
     "only on rank 1: ['extra.weight']"),
    ([("topk", {}), ("topk", {})], [LAYOUT, LAYOUT[::-1]], "same order on every rank"),
    ([("topk", {}), ("topk", {})], [LAYOUT, [LAYOUT[0], ("conv.bias", (5,), "float32"), LAYOUT[2]]],
     "conv.bias [4] float32 on rank 0, [5] float32 on rank 1"),
    ([("topk", {}), ("topk", {})], [LAYOUT, None], "named_parameters was passed to the compressor on rank 0"),
])
def test_configurations_that_differ_fail_on_every_rank_naming_the_difference(configs, layouts, expected):
    message = agree(configs, layouts)
    assert message is not None and expected in message, message


def test_the_check_names_every_rank_that_differs():
    configs = [("topk", {"density": 0.1})] * 2 + [("topk", {"density": 0.2})] * 2
    message = agree(configs, [LAYOUT] * 4, size=4)
    assert "differ on ranks [2, 3]" in message


def test_a_bucket_that_differs_across_ranks_is_refused_at_its_first_step():
    engines = [Engine(TopK(0.1), NP, r, 2) for r in range(2)]
    grads = [[np.ones(10, np.float32)], [np.ones(12, np.float32)]]
    with pytest.raises(RankMismatchError, match=r"model \[10\] float32 on rank 0, \[12\] float32"):
        LocalGroup(2).run([e.step("model", grads[r]) for r, e in enumerate(engines)])


def test_numpy_scalar_hyperparameters_are_accepted():
    assert TopK(np.float32(0.25)).density == 0.25
    assert isinstance(TopK(np.float32(0.01)).density, float)
    assert create("exdyna", density=np.float64(0.01), num_blocks=np.int64(64)).num_blocks == 64
    with pytest.raises(ConfigurationError, match=r"\(e.g. 0.01\), got '0.01' of type str"):
        TopK("0.01")
    with pytest.raises(ConfigurationError, match="real number"):
        TopK(np.bool_(True))


@pytest.mark.parametrize("method", ["topk", "randomk", "gaussiank", "dgc", "threshold"])
def test_zero_size_tensors_are_passed_through_without_a_collective(method):
    options = {"scope": "tensor"} if method == "threshold" else {}
    engines = [Engine(create(method, density=0.5, **options), NP, r, 2) for r in range(2)]

    def step(engine):
        empty = yield from engine.step("empty", [np.zeros((0, 3), np.float32)])
        full = yield from engine.step("w", [np.ones(4, np.float32)])
        return empty, full

    outputs = LocalGroup(2).run([step(e) for e in engines])
    assert outputs[0][0][0].shape == (0, 3)
    assert engines[0].schedule("empty", 0, ("float32",)) == []
    assert "empty" not in engines[0].buckets


def test_residual_norm_is_kept_on_a_step_a_rank_skipped():
    size = 2
    engines = [Engine(TopK(0.25), NP, r, size) for r in range(size)]
    grads = [[np.array([1.0, 2.0, 3.0, 4.0], np.float32)] for _ in range(size)]
    LocalGroup(size).run([e.step("w", grads[r]) for r, e in enumerate(engines)])
    before = engines[1].stats()["residual_norm"]
    assert before == pytest.approx(np.sqrt(1 + 4 + 9))
    grads[1][0][0] = np.nan
    with pytest.warns(RuntimeWarning, match="non-finite"):
        LocalGroup(size).run([e.step("w", grads[r]) for r, e in enumerate(engines)])
    assert engines[1].stats()["residual_norm"] == pytest.approx(before)   # kept, and reported
    assert engines[1].stats()["nonfinite_steps"] == 1


@pytest.mark.parametrize(("method", "options"), [("topk", {}), ("topk", {"pattern": "union"}),
                                                 ("exdyna", {}), ("randomk", {"shared_seed": True})])
def test_after_a_raised_nonfinite_step_training_goes_on_consistently(method, options):
    """nonfinite="raise": the step is applied nowhere, every rank keeps g + e in its residual
    (exact error feedback with nothing sent) and the bucket's step is unchanged, so the next step
    runs as on every rank alike."""
    size, rng = 3, np.random.default_rng(5)
    engines = [Engine(create(method, density=0.2, **options), NP, r, size, nonfinite="raise")
               for r in range(size)]

    def grads():
        return [[rng.standard_normal(40).astype(np.float32)] for _ in range(size)]

    LocalGroup(size).run([e.step("model", g) for e, g in zip(engines, grads(), strict=True)])
    before = [e.buckets["model"].residual.copy() for e in engines]
    bad = grads()
    bad[1][0][7] = np.nan
    with pytest.raises(FloatingPointError, match="applied nowhere") as raised:
        LocalGroup(size).run([e.step("model", g) for e, g in zip(engines, bad, strict=True)])
    assert raised.value.ranks_raised == [0, 1, 2]
    for rank, engine in enumerate(engines):
        expected = before[rank] if rank == 1 else before[rank] + bad[rank][0]
        np.testing.assert_allclose(engine.buckets["model"].residual, expected, rtol=1e-6)
        assert engine.buckets["model"].step == 1
    out = LocalGroup(size).run([e.step("model", g) for e, g in zip(engines, grads(), strict=True)])
    for rank in range(1, size):
        np.testing.assert_array_equal(out[rank][0], out[0][0])
    assert all(e.buckets["model"].step == 2 for e in engines)


def test_take_back_puts_a_finished_bucket_step_back_into_its_residual():
    """Per-tensor buckets: one raises for a NaN, the faces then take back the others' step."""
    size = 2
    engines = [Engine(TopK(0.5), NP, r, size, nonfinite="raise") for r in range(size)]
    good = [[np.array([1.0, -4.0, 2.0, 3.0], np.float32) * (r + 1)] for r in range(size)]
    LocalGroup(size).run([e.step("a", good[r]) for r, e in enumerate(engines)])
    before = [e.buckets["a"].residual.copy() for e in engines]
    LocalGroup(size).run([e.step("a", good[r]) for r, e in enumerate(engines)])
    bad = [[np.array([np.nan if r == 0 else 1.0, 2.0], np.float32)] for r in range(size)]
    with pytest.raises(FloatingPointError):
        LocalGroup(size).run([e.step("b", bad[r]) for r, e in enumerate(engines)])
    for rank, engine in enumerate(engines):
        engine.take_back(["a", "b"])
        np.testing.assert_array_equal(engine.buckets["a"].residual, before[rank] + good[rank][0])
        assert engine.buckets["a"].step == 1 and engine.buckets["b"].step == 0
        engine.take_back(["a"])    # only once
        assert engine.buckets["a"].step == 1


def test_shape_advice_names_named_parameters_only_where_gradients_were_matched_by_arrival():
    by_name = agree([("topk", {})] * 2, [LAYOUT, [LAYOUT[0], ("conv.bias", (5,), "float32"), LAYOUT[2]]])
    assert "named_parameters" not in by_name
    arrival = [("t0", (4, 3), "float32"), ("t1", (4,), "float32")]
    other_hook_order = [("t0", (4,), "float32"), ("t1", (4, 3), "float32")]
    by_arrival = agree([("topk", {})] * 2, [arrival, other_hook_order])
    assert "pass named_parameters to the compressor" in by_arrival


@pytest.mark.parametrize("method", available())
def test_a_bucket_holding_a_zero_size_tensor_trains(method):
    engines = [Engine(create(method, density=0.2), NP, r, 2) for r in range(2)]
    rng = np.random.default_rng(0)
    for _ in range(3):
        grads = [np.zeros((0, 3), np.float32), rng.standard_normal(20).astype(np.float32)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = LocalGroup(2).run([e.step("model", grads) for e in engines])
            LocalGroup(2).run([e.end_step() for e in engines])
    assert out[0][0].shape == (0, 3)
    np.testing.assert_array_equal(out[0][1], out[1][1])


@pytest.mark.parametrize(("method", "options"), [
    ("dgc", {"momentum": np.float32(0.9), "clip_norm": np.float64(1.0), "max_adaptation_iters": np.int64(5),
             "warmup_epochs": np.int32(1), "seed": np.int64(3)}),
    ("lags", {"merge_threshold": np.int64(0), "profile_steps": np.int32(2), "alpha": np.float32(1e-4),
              "beta": np.float32(1e-9), "calibration_sizes": (np.int64(8), np.int64(64)),
              "calibration_repeats": np.int64(2), "min_density": np.float32(0.001)}),
    ("threshold", {"threshold": np.float32(0.5)}),
    ("gaussiank", {"max_loops": np.int64(3)}),
    ("randomk", {"seed": np.int64(4)}),
    ("exdyna", {"num_blocks": np.int64(64), "histogram_decay": np.float32(0.5)}),
])
def test_numpy_scalar_options_are_accepted_and_kept_as_python_numbers(method, options):
    algorithm = create(method, density=np.float32(0.05), **options)
    for value in algorithm.describe().values():
        assert not isinstance(value, np.generic), (method, algorithm.describe())
    run_steps(method, options, 2, 64)   # and it trains
