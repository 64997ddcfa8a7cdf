"""The TensorFlow custom ops (kernels/tf_ops.py over kernels/cpu/tf_ops.cc) against the TensorFlow
backend's reference ops, bit for bit: random, heavy-tailed, tied, all-zero and NaN/Inf data, empty
and full selections, fp32 and fp64, int32 and int64 indices; and the backend's switch."""

from __future__ import annotations

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
