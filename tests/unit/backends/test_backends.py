"""Every backend agrees with the NumPy reference on every bulk operation the engine uses, and the
engine gives identical results on all three."""

from __future__ import annotations

import numpy as np
import pytest

from hvd_sparse.algorithms import DEFT, ExDyna, TopK
from hvd_sparse.backends import get_backend
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine
from tests.unit.compare_runs import assert_backend_agrees

FRAMEWORKS = ["torch", "tensorflow"]


@pytest.fixture(params=FRAMEWORKS)
def backend(request):
    pytest.importorskip(request.param)
    return get_backend(request.param)


def test_bulk_ops_match_numpy(backend):
    ref = get_backend("numpy")
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1000).astype(np.float32)
    idx = np.array([3, 7, 7, 999, 0], dtype=np.int64)
    uniq = np.unique(idx)
    t = backend.from_numpy(x)

    def same(a, b):
        np.testing.assert_array_equal(backend.to_numpy(a), b)

    same(backend.abs(t), np.abs(x))
    same(backend.take(t, backend.from_numpy(idx)), x[idx])
    same(backend.scatter(1000, backend.from_numpy(idx), backend.from_numpy(x[:5])),
         ref.scatter(1000, idx, x[:5]))
    same(backend.unique(backend.from_numpy(idx)), uniq)
    same(backend.zero_at(backend.from_numpy(x.copy()), backend.from_numpy(uniq)),
         ref.zero_at(x.copy(), uniq))
    same(backend.put(backend.from_numpy(x.copy()), backend.from_numpy(uniq), backend.from_numpy(x[:4])),
         ref.put(x.copy(), uniq, x[:4]))
    same(backend.indices_where_at_least(t, 1.5, offset=10), ref.indices_where_at_least(x, 1.5, offset=10))
    same(backend.topk_abs_indices(t, 17), ref.topk_abs_indices(x, 17))
    segments = [(300, 200, 7), (0, 100, 0), (100, 5, 5), (999, 1, 1)]
    same(backend.topk_abs_segments(t, segments), ref.topk_abs_segments(x, segments))
    assert ref.topk_abs_segments(x, segments).tolist()[:7] == (ref.topk_abs_indices(x[300:500], 7)
                                                              + 300).tolist()
    assert backend.sum_of_squares(t) == pytest.approx(ref.sum_of_squares(x))
    assert backend.count_at_least(t, [0.5, 2.0]) == ref.count_at_least(x, [0.5, 2.0])
    big = rng.standard_normal(200_000).astype(np.float32)
    sampled = backend.count_at_least(backend.from_numpy(big), [1.0, 3.0], every=8)
    assert sampled == pytest.approx(ref.count_at_least(big, [1.0, 3.0], every=8))
    assert sampled[0] == pytest.approx(np.count_nonzero(big >= 1.0), rel=0.05)
    bounds = np.array([0, 100, 101, 640, 1000])
    spread = np.array([5, 99, 100, 100, 639, 640, 999, 0], dtype=np.int64)
    assert backend.count_in_ranges(backend.from_numpy(spread), bounds).tolist() == [3, 2, 1, 2]
    assert ref.count_in_ranges(spread, bounds).tolist() == [3, 2, 1, 2]
    duplicate = backend.copy(t)
    same(duplicate, x)
    mean, std = backend.mean_std(t)
    assert mean == pytest.approx(ref.mean_std(x)[0], rel=1e-4, abs=1e-6)
    assert std == pytest.approx(ref.mean_std(x)[1], rel=1e-5)
    assert backend.mean_std(backend.from_numpy(x[:1])) == (pytest.approx(float(x[0])), 0.0)
    assert backend.all_finite(t) and not backend.all_finite(backend.from_numpy(np.array([1.0, np.inf])))
    residual = backend.zeros(12)
    pieces = [x[:6].reshape(2, 3), x[6:12]]
    acc = backend.accumulate(residual, [backend.from_numpy(p) for p in pieces])
    same(acc, x[:12])
    back = backend.split_like(acc, [backend.from_numpy(p) for p in pieces])
    assert [tuple(b.shape) for b in back] == [(2, 3), (6,)]


@pytest.mark.parametrize("make", [
    lambda: TopK(0.1, pattern="union", scope="model"),
    lambda: ExDyna(0.1, threshold_scaling="tracking", threshold_start="local"),
    lambda: ExDyna(0.1, threshold_scaling="tracking", momentum=0.9, warmup_steps=2),
    lambda: TopK(0.1, scope="model", momentum=0.8, nesterov=True, dense_steps=1),
    lambda: DEFT(0.1, momentum=0.9),
], ids=["topk", "exdyna-local-start", "exdyna-momentum-warmup", "topk-nesterov-dense-step", "deft-momentum"])
def test_engine_is_identical_on_every_backend(backend, make):
    rng = np.random.default_rng(1)
    batches = [[[rng.standard_normal((6, 5)).astype(np.float32), rng.standard_normal(7).astype(np.float32)]
                for _ in range(3)] for _ in range(4)]
    assert_backend_agrees(backend.name, lambda b: [Engine(make(), b, r, 3) for r in range(3)], batches)


@pytest.mark.parametrize("name", ["numpy", "torch"])
@pytest.mark.parametrize("pattern", ["gather", "union"])
def test_writing_into_the_inputs_gives_the_same_average(name, pattern):
    pytest.importorskip(name)
    b = get_backend(name)
    rng = np.random.default_rng(2)
    shapes, dtype = [(6, 5), (7,), (3, 2, 2)], np.float16
    batches = [[[rng.standard_normal(s).astype(dtype) for s in shapes] for _ in range(3)] for _ in range(3)]
    results = []
    for in_place in (False, True):
        algorithm = TopK(0.2, pattern=pattern, scope="model")
        engines = [Engine(algorithm, b, r, 3, write_into_inputs=in_place) for r in range(3)]
        outs = []
        for grads in batches:
            inputs = [[b.from_numpy(g.copy()) for g in grads[r]] for r in range(3)]
            step = LocalGroup(3, b).run([e.step("model", inputs[r]) for r, e in enumerate(engines)])
            if in_place:
                assert all(o is i for o, i in zip(step[0], inputs[0], strict=True))
            outs.append([b.to_numpy(t).copy() for t in step[1]])
        results.append(outs)
    for a, c in zip(*results, strict=True):
        for x, y in zip(a, c, strict=True):
            assert x.dtype == y.dtype == dtype
            np.testing.assert_array_equal(x, y)

def test_segment_norms_match_numpy(backend):
    ref = get_backend("numpy")
    x = np.random.default_rng(2).standard_normal(1000).astype(np.float32)
    lengths = [0, 3, 500, 0, 1, 496]
    expected = ref.segment_norms(x, lengths)   # float32 norms, bit for bit on every backend
    bounds = [(0, 0), (0, 3), (3, 503), (503, 503), (503, 504), (504, 1000)]
    np.testing.assert_array_equal(expected, [np.float32(np.linalg.norm(x[lo:hi].astype(np.float64)))
                                             for lo, hi in bounds])
    got = backend.segment_norms(backend.from_numpy(x), lengths)
    assert isinstance(got, np.ndarray) and got.dtype == np.float64
    np.testing.assert_array_equal(got, expected)
    # Lower-precision input: accumulated in float64 all the same.
    half = backend.cast(backend.from_numpy(x), "float16")
    np.testing.assert_array_equal(backend.segment_norms(half, lengths),
                                  ref.segment_norms(x.astype(np.float16), lengths))

def test_torch_ordered_scatter_sums_duplicates_in_order():
    """The CUDA scatter path (run here on the CPU): bitwise what NumPy's in-order sum gives."""
    torch = pytest.importorskip("torch")
    from hvd_sparse.backends.torch_backend import _ordered_index_add

    rng = np.random.default_rng(3)
    idx = np.concatenate([rng.choice(500, 60, replace=False) for _ in range(4)])  # 4 ranks' picks
    values = (rng.standard_normal(idx.size) * 10.0 ** rng.integers(-4, 4, idx.size)).astype(np.float32)
    expected = np.zeros(500, np.float32)
    np.add.at(expected, idx, values)
    got = _ordered_index_add(torch.zeros(500), torch.from_numpy(idx), torch.from_numpy(values))
    np.testing.assert_array_equal(got.numpy(), expected)
    assert _ordered_index_add(torch.zeros(3), torch.zeros(0, dtype=torch.long), torch.zeros(0)).sum() == 0
