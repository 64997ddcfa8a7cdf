"""DGC's selection in one call (``Backend.sampled_threshold_select``): the reference composition
matches an independent NumPy reference, and the CPU kernel (torch, through ctypes) and the
TensorFlow op match the reference composition bit for bit: indices and final threshold."""

from __future__ import annotations

import math

import numpy as np
import pytest

import hvd_sparse
from hvd_sparse.backends import Backend, ThresholdBand, get_backend
from tests.reference.dgc import dgc_sampled_selection

PAPER = ThresholdBand(1.3, 0.8, 10, True)


def cases(count: int = 160):
    """(x, k, start, stride, top, band): random vectors with zeros, ties, NaN and huge values."""
    rng = np.random.default_rng(7)
    for trial in range(count):
        n = int(rng.integers(1, 12_000))
        x = rng.standard_normal(n).astype(np.float32 if trial % 2 else np.float64)
        if trial % 5 == 0:
            x[rng.integers(0, n, max(1, n // 3))] = 0.0
        if trial % 6 == 0:
            x = np.round(x * 2)                     # many ties
        if trial % 9 == 0:
            x[rng.integers(0, n)] = np.nan          # in or out of the sample
        if trial % 10 == 0:
            x[rng.integers(0, n)] = np.inf
        if trial % 13 == 0:                         # thresholds that overflow float32 when raised
            x = (np.clip(x, -4, 4) * (np.finfo(np.float32).max / 4)).astype(x.dtype)
        k = max(1, n // int(rng.choice([1000, 100, 3]))) if trial % 4 else int(rng.integers(1, n + 1))
        stride = 1 if trial % 7 == 0 or n < 3 else int(rng.integers(2, min(n, 70) + 1))
        start = 0 if stride == 1 else int(rng.integers(0, stride))
        top = int(rng.integers(1, (n - start + stride - 1) // stride + 1))
        band = PAPER if trial % 3 == 0 else ThresholdBand(
            float(rng.choice([1.0, 1.3, 4.0])), float(rng.choice([0.25, 0.8, 1.0])),
            int(rng.integers(0, 12)), bool(rng.integers(0, 2)))
        yield x, k, start, stride, top, band


def same(expected: tuple, got: tuple, to_numpy) -> None:
    (idx, threshold), (got_idx, got_threshold) = expected, got
    np.testing.assert_array_equal(to_numpy(got_idx).astype(np.int64), np.asarray(idx, np.int64))
    assert (math.isnan(threshold) and math.isnan(got_threshold)) or threshold == got_threshold


def reference(x, k, start, stride, top, band):
    with np.errstate(over="ignore"):
        return Backend.sampled_threshold_select(get_backend("numpy"), x, k, start, stride, top, band)


def test_reference_composition_matches_the_specification():
    for x, k, start, stride, top, band in cases():
        with np.errstate(over="ignore"):
            expected = dgc_sampled_selection(x, k, start, stride, top, *band)
        same(expected, reference(x, k, start, stride, top, band), np.asarray)


@pytest.mark.parametrize("kernels", ["auto", "off"])
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_frameworks_match_the_reference(framework, kernels):
    module = pytest.importorskip(framework)
    backend = get_backend(framework)
    tensor = module.from_numpy if framework == "torch" else module.constant
    hvd_sparse.set_kernels(kernels)
    try:
        for x, k, start, stride, top, band in cases(160 if framework == "torch" else 80):
            got = backend.sampled_threshold_select(tensor(x), k, start, stride, top, band)
            same(reference(x, k, start, stride, top, band), got, lambda t: t.numpy())
    finally:
        hvd_sparse.set_kernels("auto")


def test_kernels_answer_in_both_index_dtypes_and_decline_what_they_cannot_take():
    torch = pytest.importorskip("torch")
    from hvd_sparse.kernels import cpu

    x = np.random.default_rng(3).standard_normal(5000).astype(np.float32)
    expected = reference(x, 5, 4, 33, 2, PAPER)
    for index_dtype in (torch.int32, torch.int64):
        got = cpu.sampled_threshold_select(torch.from_numpy(x), 5, 4, 33, 2, PAPER, index_dtype)
        assert got[0].dtype == index_dtype
        same(expected, got, lambda t: t.numpy())
    assert cpu.sampled_threshold_select(torch.ones(10, dtype=torch.float16), 1, 0, 1, 1, PAPER) is None
    assert cpu.sampled_threshold_select(torch.ones(2, 5), 1, 0, 1, 1, PAPER) is None
    assert cpu.sampled_threshold_select(torch.ones(10), 11, 0, 1, 1, PAPER) is None
    with pytest.raises(RuntimeError, match="refused its arguments"):
        cpu.sampled_threshold_select(torch.ones(10), 1, 0, 3, 5, PAPER)   # 4 samples, not 5
    tf = pytest.importorskip("tensorflow")
    ops = hvd_sparse.kernels.tensorflow_ops()
    for index_dtype in ("int32", "int64"):
        got = ops.sampled_threshold_select(tf.constant(x), 5, 4, 33, 2, PAPER, index_dtype)
        assert got[0].dtype.name == index_dtype
        same(expected, got, lambda t: t.numpy())
    assert ops.sampled_threshold_select(tf.ones([10], tf.float16), 1, 0, 1, 1, PAPER) is None
    with pytest.raises(tf.errors.InvalidArgumentError, match="refused its arguments"):
        ops.sampled_threshold_select(tf.ones([10]), 1, 0, 3, 5, PAPER)
