"""The engine and top-k on the NumPy backend with N simulated ranks (comm/local.py)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from hvd_sparse import ConfigurationError, RankMismatchError, UnsupportedTensorError
from hvd_sparse.algorithms import SHARED, Algorithm, TopK
from hvd_sparse.backends import get_backend
from hvd_sparse.comm import ALLGATHER, Collective
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine
from tests.reference.engine import expected_step, topk_indices
from tests.unit.compare_runs import assert_step_identical

NP = get_backend("numpy")
SHAPES = [(12, 9), (9,), (5, 4, 3)]
NUMEL = sum(int(np.prod(s)) for s in SHAPES)


def make_engines(algorithm, size):
    return [Engine(algorithm, NP, rank, size) for rank in range(size)]


def residual_of(engine, key, numel):
    bucket = engine.buckets.get(key)
    return np.zeros(numel, np.float32) if bucket is None else bucket.residual.copy()


def random_grads(rng, size, shapes=SHAPES, dtype=np.float32):
    # Heavy-tailed like real gradients, different per rank.
    return [[(rng.standard_t(3, s) * rng.uniform(0.1, 2.0)).astype(dtype) for s in shapes]
            for _ in range(size)]


@pytest.mark.parametrize("pattern", ["gather", "union"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_topk_model_scope_matches_reference_every_step(pattern, size):
    algorithm = TopK(0.05, pattern=pattern, scope="model")
    engines, group = make_engines(algorithm, size), LocalGroup(size)
    rng = np.random.default_rng(size)
    numel = sum(int(np.prod(s)) for s in SHAPES)
    k = algorithm.k(numel)
    for step in range(30):
        grads = random_grads(rng, size)
        accs = [residual_of(e, "model", numel) + np.concatenate([g.ravel() for g in grads[r]])
                for r, e in enumerate(engines)]
        outputs = group.run([e.step("model", grads[r]) for r, e in enumerate(engines)])

        selections = [topk_indices(acc, k) for acc in accs]
        average, residuals, union = expected_step(accs, selections, pattern)
        for rank, engine in enumerate(engines):
            flat = np.concatenate([o.ravel() for o in outputs[rank]])
            np.testing.assert_allclose(flat, average, rtol=1e-5, atol=1e-6)  # fp32 sums
            assert [o.shape for o in outputs[rank]] == SHAPES
            np.testing.assert_array_equal(engine.buckets["model"].residual, residuals[rank])
            stats = engine.stats()
            assert stats["step"] == step + 1
            assert stats["union"] == union
            assert stats["selected"] == k
            assert stats["density_actual"] == pytest.approx(union / numel)
            assert k <= union <= size * k  # build-up lies in [1, N]


def test_error_feedback_is_exact_per_tensor_buckets():
    """sent + new residual == gradient + old residual, on every index, for every bucket."""
    size, algorithm = 3, TopK(0.1)
    engines, group = make_engines(algorithm, size), LocalGroup(size)
    rng = np.random.default_rng(7)
    for _ in range(10):
        grads = random_grads(rng, size)
        for i, shape in enumerate(SHAPES):
            key, numel = f"t{i}", int(np.prod(shape))
            accs = [residual_of(e, key, numel) + grads[r][i].ravel() for r, e in enumerate(engines)]
            group.run([e.step(key, [grads[r][i]]) for r, e in enumerate(engines)])
            for rank, engine in enumerate(engines):
                residual = engine.buckets[key].residual
                sent = np.where(residual == 0, accs[rank], 0)
                np.testing.assert_array_equal(sent + residual, accs[rank])
                assert np.count_nonzero(residual == 0) >= algorithm.k(numel)


def test_fp16_gradients_keep_fp32_residual_and_rounding_error():
    size, algorithm = 2, TopK(0.2, scope="model")
    engines, group = make_engines(algorithm, size), LocalGroup(size)
    rng = np.random.default_rng(3)
    for _ in range(5):
        grads = random_grads(rng, size, dtype=np.float16)
        accs = [residual_of(e, "model", NUMEL)
                + np.concatenate([g.ravel() for g in grads[r]]).astype(np.float32)
                for r, e in enumerate(engines)]
        outputs = group.run([e.step("model", grads[r]) for r, e in enumerate(engines)])
        assert all(o.dtype == np.float16 for o in outputs[0])
        for rank, engine in enumerate(engines):
            residual = engine.buckets["model"].residual
            assert residual.dtype == np.float32
            # fp16 data ties often, so read the selection off the residual: where it changed.
            selected = np.flatnonzero(residual != accs[rank])
            assert selected.size <= algorithm.k(NUMEL)
            sent = accs[rank][selected].astype(np.float16).astype(np.float32)
            np.testing.assert_array_equal(sent + residual[selected], accs[rank][selected])
    assert engines[0].buckets["model"].value_dtype == "float16"
    assert engines[0].stats()["bytes_sent"] == algorithm.k(NUMEL) * (4 + 2)


def test_bfloat16_gradients_travel_as_fp32():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    algorithm = TopK(0.1)
    engines, group = make_engines(algorithm, 2), LocalGroup(2)
    grads = [[np.arange(1, 21, dtype=np.float32).astype(ml_dtypes.bfloat16) * (r + 1)] for r in range(2)]
    outputs = group.run([e.step("w", grads[r]) for r, e in enumerate(engines)])
    assert engines[0].buckets["w"].value_dtype == "float32"
    assert outputs[0][0].dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(outputs[0][0].astype(np.float32)[-2:], [28.5, 30.0])


class FixedIndices(Algorithm):
    """Test-only method for the shared pattern: every rank picks the same indices."""

    name = "fixed"
    patterns = (SHARED,)

    def select_local(self, acc, control, ctx):
        return ctx.backend.arange(0, self.k(ctx.numel))


def test_shared_pattern_allreduces_values_at_agreed_indices():
    size, algorithm = 4, FixedIndices(0.25)
    engines, group = make_engines(algorithm, size), LocalGroup(size)
    grads = [[np.full(8, r + 1.0, np.float32)] for r in range(size)]
    outputs = group.run([e.step("b", grads[r]) for r, e in enumerate(engines)])
    np.testing.assert_array_equal(outputs[2][0], [2.5, 2.5, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(engines[1].buckets["b"].residual, [0, 0, 2, 2, 2, 2, 2, 2])
    stats = engines[0].stats()
    assert stats["union"] == 2 and stats["bytes_sent"] == stats["bytes_received"] == 8


def test_stats_have_the_documented_fields():
    engines, group = make_engines(TopK(0.1), 2), LocalGroup(2)
    group.run([e.step("x", [np.linspace(-1, 1, 50, dtype=np.float32)]) for e in engines])
    stats = engines[0].stats()
    for field in ("step", "density_target", "density_actual", "k", "selected", "union",
                  "bytes_sent", "bytes_received", "select_seconds", "residual_norm"):
        assert field in stats
    assert stats["density_target"] == 0.1 and stats["k"] == 5
    # 5 int32 indices + 5 fp32 values sent; the other rank's 5 pairs received.
    assert stats["bytes_sent"] == 40 and stats["bytes_received"] == 40
    assert stats["residual_norm"] == pytest.approx(np.linalg.norm(engines[0].buckets["x"].residual))


@pytest.mark.parametrize("density", [0, -0.1, 1.5, float("nan"), "0.1", True, None])
def test_bad_density_names_the_fix(density):
    with pytest.raises(ConfigurationError, match=r"density must be"):
        TopK(density)


def test_bad_pattern_and_scope():
    with pytest.raises(ConfigurationError, match="pattern must be one of"):
        TopK(0.1, pattern="shared")
    with pytest.raises(ConfigurationError, match="scope must be one of"):
        TopK(0.1, scope="layer")


def test_integer_gradient_is_refused():
    engine = Engine(TopK(0.1), NP, 0, 1)
    with pytest.raises(UnsupportedTensorError, match="floating-point"):
        LocalGroup(1).run([engine.step("i", [np.arange(10)])])


def test_model_that_differs_across_ranks_fails_on_every_rank():
    engines, group = make_engines(TopK(0.1), 2), LocalGroup(2)
    grads = [[np.ones(10, np.float32)], [np.ones(12, np.float32)]]
    with pytest.raises(RankMismatchError, match="tensor shapes or dtypes differ on ranks \\[1\\]"):
        group.run([e.step("w", grads[r]) for r, e in enumerate(engines)])


def test_local_group_detects_a_rank_that_skips_a_collective():
    def protocol(rank):
        if rank == 0:
            yield [Collective(ALLGATHER, "a", np.zeros(1))]
        return rank

    with pytest.raises(RankMismatchError, match="would hang"):
        LocalGroup(2).run([protocol(0), protocol(1)])


def test_checkpoint_resumes_with_identical_decisions():
    size, rng = 3, np.random.default_rng(11)
    batches = [random_grads(rng, size) for _ in range(10)]
    algorithm = TopK(0.05, pattern="union", scope="model")
    original, group = make_engines(algorithm, size), LocalGroup(size)
    for grads in batches[:5]:
        group.run([e.step("model", grads[r]) for r, e in enumerate(original)])
    states = [e.state_dict() for e in original]
    resumed = make_engines(TopK(0.05, pattern="union", scope="model"), size)
    for engine, state in zip(resumed, states, strict=True):
        engine.load_state_dict(state)
    for grads in batches[5:]:
        assert_step_identical(group, original, resumed, grads)
    assert resumed[0].stats()["step"] == 10


def test_checkpoint_errors_and_world_size_change():
    engines, group = make_engines(TopK(0.1), 2), LocalGroup(2)
    group.run([e.step("w", [np.arange(1, 11, dtype=np.float32)]) for e in engines])
    state = engines[0].state_dict()
    with pytest.raises(RankMismatchError, match="one file per rank"):
        Engine(TopK(0.1), NP, 1, 2).load_state_dict(state)
    other = dict(state, algorithm="exdyna")
    with pytest.raises(ConfigurationError, match="same method"):
        Engine(TopK(0.1), NP, 0, 2).load_state_dict(other)
    # Resuming at world size 4 from the files of 2 ranks: rank r loads file r % 2.
    files = [e.state_dict() for e in engines]
    bigger = [Engine(TopK(0.1), NP, r, 4) for r in range(4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rank, engine in enumerate(bigger):
            engine.load_state_dict(files[rank % 2])
    assert any("world size 2" in str(w.message) for w in caught)
    LocalGroup(4).run([e.step("w", [np.zeros(10, np.float32)]) for e in bigger])
    assert all(e.buckets["w"].step == 2 for e in bigger)
    np.testing.assert_array_equal(bigger[0].buckets["w"].residual, 0)  # reset, then a zero gradient


def test_nonfinite_gradient_is_skipped_by_that_rank_only():
    size = 3
    engines = [Engine(TopK(0.5), NP, r, size) for r in range(size)]
    grads = [[np.array([1.0, -2.0, 3.0, -4.0], np.float32) * (r + 1)] for r in range(size)]
    grads[1][0][2] = np.nan
    with pytest.warns(RuntimeWarning, match="non-finite gradient in 'w' on rank 1"):
        outputs = LocalGroup(size).run([e.step("w", grads[r]) for r, e in enumerate(engines)])
    # Ranks 0 and 2 send their top-2 (indices 2, 3); rank 1 sends zeros.
    np.testing.assert_allclose(outputs[0][0], [0, 0, (3 + 9) / 3, (-4 - 12) / 3])
    np.testing.assert_array_equal(engines[1].buckets["w"].residual, 0)  # untouched
    np.testing.assert_array_equal(engines[2].buckets["w"].residual, [3, -6, 0, 0])
    assert engines[1].stats()["nonfinite_steps"] == 1 and engines[0].stats()["nonfinite_steps"] == 0


@pytest.mark.parametrize("pattern", ["gather", "union"])
def test_nonfinite_gradient_raises_on_every_rank_when_asked(pattern):
    size = 4
    engines = [Engine(TopK(0.5, pattern=pattern), NP, r, size, nonfinite="raise") for r in range(size)]
    grads = [[np.ones(6, np.float32)] for _ in range(size)]
    grads[2][0][0] = np.inf
    with pytest.raises(FloatingPointError, match="raised on every rank") as raised:
        LocalGroup(size).run([e.step("w", grads[r]) for r, e in enumerate(engines)])
    assert raised.value.ranks_raised == [0, 1, 2, 3]


def test_bad_nonfinite_policy():
    with pytest.raises(ConfigurationError, match="nonfinite must be one of"):
        Engine(TopK(0.1), NP, 0, 1, nonfinite="drop")


def test_local_group_reports_a_rank_that_raises_while_others_wait():
    def protocol(rank):
        if rank == 1:
            raise ValueError("boom")
        yield [Collective(ALLGATHER, "a", np.zeros(1))]

    with pytest.raises(RankMismatchError, match="would hang"):
        LocalGroup(2).run([protocol(0), protocol(1)])


def test_stats_say_where_the_step_time_went():
    from hvd_sparse.algorithms import DEFT

    for algorithm in (TopK(0.1), DEFT(0.1)):
        engines, group = make_engines(algorithm, 2), LocalGroup(2)
        rng = np.random.default_rng(3)
        group.run([e.step("x", g) for e, g in zip(engines, random_grads(rng, 2), strict=True)])
        stats, times = engines[0].stats(), engines[0].step_times()
        parts = ("accumulate", "select", "exchange", "reconstruct")
        assert set(times) == {f"{p}_seconds" for p in (*parts, "select_wait", "engine")}
        assert all(stats[key] == value >= 0 for key, value in times.items())
        # The parts lie inside what the step's protocol ran; the waits are not work.
        assert sum(times[f"{p}_seconds"] for p in parts) <= times["engine_seconds"] + 1e-9
        assert times["select_seconds"] > 0 and times["engine_seconds"] > 0
    assert times["accumulate_seconds"] > 0   # DEFT accumulates (with its norms) before selecting
