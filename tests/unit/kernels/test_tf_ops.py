"""The TensorFlow custom ops (hvd_sparse/kernels/tf_ops.py over hvd_sparse/kernels/cpu/tf_ops.cc)
against the TensorFlow backend's reference ops, bit for bit: random, heavy-tailed, tied, all-zero
and NaN/Inf data, empty and full selections, fp32 and fp64, int32 and int64 indices; and the
backend's switch."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import hvd_sparse  # noqa: E402
from hvd_sparse import kernels  # noqa: E402
from hvd_sparse.backends import get_backend  # noqa: E402


@pytest.fixture(scope="module")
def ops():
    try:
        from hvd_sparse.kernels import tf_ops
    except kernels.KernelUnavailable as error:
        pytest.skip(f"the TensorFlow op library is not usable here: {error}")
    return tf_ops


def reference(x: np.ndarray, k: int) -> np.ndarray:
    hvd_sparse.set_kernels("off")
    try:
        return get_backend("tensorflow").topk_abs_indices(tf.constant(x), k).numpy()
    finally:
        hvd_sparse.set_kernels("auto")


def cases(rng):
    for trial in range(240):
        n = int(rng.integers(1, 4000)) if trial % 10 else int(rng.integers(20_000, 200_000))
        x = rng.standard_t(3, n) * 1e-3
        kind = trial % 5
        if kind == 1:
            x = np.round(x * 2000) / 2000   # many ties
        elif kind == 2:
            x[rng.integers(0, n, 5)] = np.nan
            x[rng.integers(0, n, 3)] = -0.0
            x[rng.integers(0, n, 2)] = -np.inf
        elif kind == 3:
            x[:] = 0.0
        k = [0, n, 1, int(rng.integers(0, n + 1)), max(1, n // 1000)][trial % 5]
        yield x.astype(rng.choice(["float32", "float64"])), k


def test_topk_matches_the_reference(ops):
    rng = np.random.default_rng(0)
    for x, k in cases(rng):
        expected = reference(x, k)
        for index_dtype in ("int32", "int64"):
            got = ops.topk_abs(tf.constant(x), k, index_dtype).numpy()
            assert got.dtype == np.dtype(index_dtype)
            np.testing.assert_array_equal(got.astype(np.int64), expected, err_msg=f"n={x.size} k={k}")


def test_topk_segments_match_the_reference_per_segment(ops):
    """DEFT's one-call selection: each segment as the reference selects it alone, offset, in the
    order given (not sorted: units are taken in bin order), empty and whole segments included."""
    rng = np.random.default_rng(1)
    backend = get_backend("tensorflow")
    for x, _ in list(cases(rng))[:60]:
        n = x.size
        cuts = np.unique(np.concatenate([[0, n], rng.integers(0, n + 1, 6)]))
        segments = [(int(lo), int(hi - lo), int(rng.integers(0, hi - lo + 1)) if trial % 3 else
                     [0, int(hi - lo)][trial % 2])
                    for trial, (lo, hi) in enumerate(itertools.pairwise(cuts))]
        segments = [segments[i] for i in rng.permutation(len(segments))]
        expected = np.concatenate([reference(x[lo:lo + size], k) + lo for lo, size, k in segments]
                                  or [np.zeros(0, np.int64)])
        for index_dtype in ("int32", "int64"):
            got = ops.topk_abs_segments(tf.constant(x), segments, index_dtype).numpy()
            assert got.dtype == np.dtype(index_dtype)
            np.testing.assert_array_equal(got.astype(np.int64), expected, err_msg=f"{segments}")
        via_backend = backend.topk_abs_segments(tf.constant(x), segments).numpy()
        np.testing.assert_array_equal(via_backend, expected)
    assert ops.topk_abs_segments(tf.constant(np.ones(5, np.float32)), [(3, 3, 1)]) is None
    assert ops.topk_abs_segments(tf.constant(np.ones(5, np.float32)), [(0, 2, 3)]) is None
    assert ops.topk_abs_segments(tf.constant(np.ones(5, np.float32)), []).shape == (0,)


def test_topk_declines_what_it_has_no_kernel_for(ops):
    assert ops.topk_abs(tf.constant(np.ones(5, np.float16)), 2) is None
    assert ops.topk_abs(tf.constant(np.ones(5, np.float32)), 6) is None


def test_backend_uses_the_op_and_the_switch_turns_it_off(ops, monkeypatch):
    calls = []
    monkeypatch.setattr(ops, "topk_abs", lambda x, k, index_dtype="int64": calls.append(k))
    backend = get_backend("tensorflow")
    x = tf.constant(np.arange(10, dtype=np.float32))
    backend.topk_abs_indices(x, 3)   # the (recording) op's None: the reference path answers
    assert calls == [3]
    hvd_sparse.set_kernels("off")
    try:
        backend.topk_abs_indices(x, 3)
    finally:
        hvd_sparse.set_kernels("auto")
    assert calls == [3]


def reference_norms(x: np.ndarray, lengths: list[int]) -> list[float]:
    hvd_sparse.set_kernels("off")
    try:
        return list(get_backend("tensorflow").segment_norms(tf.constant(x), lengths))
    finally:
        hvd_sparse.set_kernels("auto")


def test_segment_norms_match_the_reference(ops):
    """DEFT's per-unit norms through the op (one read, float64 sums of known depth) are the
    reference's float32 norms exactly, down to segments whose float64 sum cannot decide."""
    rng = np.random.default_rng(1)
    backend = get_backend("tensorflow")
    for trial in range(60):
        count = int(rng.integers(1, 80))
        lengths = [int(v) for v in rng.integers(0, 9000 if trial % 6 else 300_000, count)]
        lengths[int(rng.integers(0, count))] = 0
        x = rng.standard_t(3, sum(lengths)) * 10.0 ** rng.integers(-20, 3)
        if trial % 4 == 1:
            x = np.round(x * 64) / 64   # many equal squares
        elif trial % 4 == 2:
            x[:] = 0.0
        x = x.astype(["float32", "float64"][trial % 2])
        sums, depths = ops.segment_sums(tf.constant(x), lengths)
        assert len(sums) == len(depths) == count and min(depths) >= 1
        got = list(backend.segment_norms(tf.constant(x), lengths))
        assert got == reference_norms(x, lengths), f"trial {trial}"
    assert list(backend.segment_norms(tf.constant(np.float32([3, 4, 0])), [2, 1])) == [5.0, 0.0]


def test_segment_sums_decline_what_they_have_no_kernel_for(ops):
    assert ops.segment_sums(tf.constant(np.ones(5, np.float16)), [5]) is None
    assert ops.segment_sums(tf.constant(np.ones(5, np.float32)), [2, 2]) is None
    assert ops.segment_sums(tf.constant(np.ones(5, np.float32)), [6, -1]) is None


def test_backend_norms_use_the_op_unless_kernels_are_off(ops, monkeypatch):
    calls = []
    monkeypatch.setattr(ops, "segment_sums", lambda x, lengths: calls.append(lengths))
    backend = get_backend("tensorflow")
    x = tf.constant(np.arange(10, dtype=np.float32))
    assert list(backend.segment_norms(x, [4, 6])) == reference_norms(x.numpy(), [4, 6])
    assert calls == [[4, 6]]


def _off(fn):
    """fn() on the reference path (kernels off)."""
    hvd_sparse.set_kernels("off")
    try:
        return fn()
    finally:
        hvd_sparse.set_kernels("auto")


def _bits(x) -> np.ndarray:
    x = np.asarray(x.numpy() if hasattr(x, "numpy") else x)
    return x.view(np.uint8)


def _fused_cases(rng):
    """Random buckets: mixed input dtypes, a NaN now and then, ranges, thresholds, sampled probes."""
    for trial in range(60):
        sizes = [int(s) for s in rng.integers(0, 3000, int(rng.integers(1, 5)))]
        n = sum(sizes)
        if n == 0:
            continue
        dtype = "float64" if trial % 7 == 0 else "float32"
        inputs = [(rng.standard_t(3, s) * 1e-3).astype(rng.choice(["float16", "float32", dtype]))
                  for s in sizes]
        if trial % 9 == 4 and sizes[0]:
            inputs[0][0] = np.nan
        lo, hi = sorted(int(v) for v in rng.integers(0, n + 1, 2))
        yield dict(inputs=[tf.constant(x) for x in inputs], lo=lo, hi=hi,
                   residual=(rng.standard_t(3, n) * 1e-3).astype(dtype),
                   velocity=(rng.standard_t(3, n) * 1e-3).astype(dtype),
                   threshold=float(rng.choice([0.0, 1e-3, 3e-3, np.inf])),
                   probes=[1e-3, 2e-3][: trial % 3], every=int(rng.choice([1, 4])),
                   index_dtype="int32" if trial % 2 else "int64")


def _fused(case: dict, momentum: str | None, owned: bool):
    """The backend's accumulate_select on the case: (Selected, velocity, the residual passed)."""
    from hvd_sparse.backends.base import Momentum
    b = get_backend("tensorflow")

    def tensor(values):
        return b.copy(tf.constant(values)) if owned else tf.constant(values)

    residual = tensor(case["residual"])
    velocity = None if momentum is None else Momentum(tensor(case["velocity"]), 0.9, momentum == "nesterov")
    done = b.accumulate_select(residual, case["inputs"], case["lo"], case["hi"], case["threshold"],
                               case["probes"], case["every"], case["index_dtype"], check_finite=True,
                               momentum=velocity)
    return done, None if velocity is None else velocity.buffer, residual


@pytest.mark.parametrize("momentum", [None, "plain", "nesterov"])
def test_accumulate_select_matches_the_reference(ops, momentum):
    """The fused op (through the backend, on tensors it owns and on tensors it does not) against
    the backend's reference composition: the same accumulated vector, velocity, indices and
    probe counts, bit for bit; a tensor the backend does not own is never written."""
    for case in _fused_cases(np.random.default_rng(5)):
        expected, expected_u, _ = _off(lambda case=case: _fused(case, momentum, False))
        for owned in (True, False):
            got, got_u, given = _fused(case, momentum, owned)
            assert got.finite == expected.finite
            np.testing.assert_array_equal(_bits(got.acc), _bits(expected.acc))
            if momentum is not None:
                np.testing.assert_array_equal(_bits(got_u), _bits(expected_u))
            if not expected.finite:
                assert got.idx is None
                continue
            np.testing.assert_array_equal(got.idx.numpy().astype(np.int64), expected.idx.numpy())
            assert got.counts == expected.counts
            if not owned:
                np.testing.assert_array_equal(_bits(given), _bits(case["residual"]))


def test_select_at_least_matches_the_reference(ops, monkeypatch):
    """The select-only op (through the backend) against the reference composition: the same
    indices and probe counts, NaN never selected and Inf always, fp32 and fp64, any range; the
    backend calls it, and not with kernels off."""
    b = get_backend("tensorflow")
    for case in _fused_cases(np.random.default_rng(11)):
        x = tf.constant(case["residual"])
        if case["lo"] < case["hi"]:
            x = tf.tensor_scatter_nd_update(x, [[case["lo"]], [case["hi"] - 1]],
                                            tf.constant([np.nan, -np.inf], x.dtype))
        args = (x, case["lo"], case["hi"], case["threshold"], case["probes"], case["every"])
        idx, counts = _off(lambda args=args: b.select_at_least(*args))
        got_idx, got_counts = b.select_at_least(*args)
        np.testing.assert_array_equal(got_idx.numpy(), idx.numpy())
        assert got_idx.dtype == tf.int64 and got_counts == counts
        assert ops.select_at_least(x, *args[1:], "int32")[0].dtype == tf.int32
    assert ops.select_at_least(tf.zeros([4], tf.float16), 0, 4, 0.0, [], 1) is None
    assert ops.select_at_least(tf.zeros([4]), 0, 5, 0.0, [], 1) is None
    calls = []
    monkeypatch.setattr(ops, "select_at_least", lambda *a, **k: calls.append(a) or None)
    b.select_at_least(tf.zeros([3]), 0, 3, 1.0)
    _off(lambda: b.select_at_least(tf.zeros([3]), 0, 3, 1.0))
    assert len(calls) == 1


def test_in_place_ops_write_only_what_the_backend_owns(ops):
    b = get_backend("tensorflow")
    values = np.arange(6, dtype=np.float32) + 1
    theirs = tf.constant(values)
    out = b.zero_at(theirs, tf.constant([1, 4]))
    np.testing.assert_array_equal(theirs.numpy(), values)   # the caller's tensor is left alone
    np.testing.assert_array_equal(out.numpy(), [1, 0, 3, 4, 0, 6])
    again = b.put(out, tf.constant([0], tf.int32), tf.constant([9.0]))   # owned now: in place
    np.testing.assert_array_equal(out.numpy(), [9, 0, 3, 4, 0, 6])
    np.testing.assert_array_equal(again.numpy(), out.numpy())
    kept = b.copy(again)   # a copy of its own, not an alias
    b.zero_at(again, tf.constant([0]))
    assert kept.numpy()[0] == 9.0
    with pytest.raises(tf.errors.InvalidArgumentError, match="outside"):
        ops.set_at(kept, tf.constant([6]), None, True)


def test_scatter_split_matches_scatter_nd(ops):
    """Duplicates summed in order from zeros (-0.0 becomes +0.0), as tf.scatter_nd sums them."""
    rng = np.random.default_rng(8)
    for _ in range(40):
        sizes = [int(s) for s in rng.integers(0, 500, int(rng.integers(1, 6)))]
        n = sum(sizes)
        if n == 0:
            continue
        k = int(rng.integers(0, 3 * n))
        idx = rng.integers(0, n, k).astype(rng.choice(["int32", "int64"]))
        vals = (rng.standard_normal(k) * 1e-3).astype(rng.choice(["float32", "float64"]))
        vals[: k // 10] = -0.0
        expected = tf.scatter_nd(tf.reshape(tf.constant(idx), [-1, 1]), tf.constant(vals), [n]).numpy()
        got = ops.scatter_split(tf.constant(idx), tf.constant(vals), sizes)
        assert [p.shape[0] for p in got] == sizes
        np.testing.assert_array_equal(_bits(np.concatenate([p.numpy() for p in got])), _bits(expected))
    with pytest.raises(tf.errors.InvalidArgumentError, match="outside"):
        ops.scatter_split(tf.constant([5]), tf.constant([1.0]), [2, 3])


def test_scatter_split_reuses_large_buffers_cleanly(ops):
    """Pieces of 64 KB and more come from buffers earlier pieces freed: each comes back zeroed
    but for its own entries, step after step."""
    rng = np.random.default_rng(9)
    sizes = [70_000, 3, 40_000]
    for _ in range(4):
        idx = np.sort(rng.choice(sum(sizes), 500, replace=False)).astype(np.int64)
        vals = rng.standard_normal(500).astype(np.float32)
        parts = ops.scatter_split(tf.constant(idx), tf.constant(vals), sizes)
        got = np.concatenate([p.numpy() for p in parts])
        expected = np.zeros(sum(sizes), np.float32)
        expected[idx] = vals
        np.testing.assert_array_equal(got, expected)
