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
