"""DGC's selection in one call (``Backend.sampled_threshold_select``), in every segment of a
vector: the reference composition matches an independent NumPy reference applied segment by
segment, and the CPU kernel (torch, through ctypes) and the TensorFlow op match the reference
composition bit for bit: indices and each segment's final threshold."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import hvd_sparse
from hvd_sparse.backends import Backend, SampledSegment, ThresholdBand, get_backend
from tests.reference.dgc import dgc_sampled_selection

PAPER = ThresholdBand(1.3, 0.8, 10, True)


def segment_of(rng, x, offset, size, trial):
    """A random plan for x[offset:offset + size]."""
    k = max(1, size // int(rng.choice([1000, 100, 3]))) if trial % 4 else int(rng.integers(1, size + 1))
    stride = 1 if trial % 7 == 0 or size < 3 else int(rng.integers(2, min(size, 70) + 1))
    start = 0 if stride == 1 else int(rng.integers(0, stride))
    top = int(rng.integers(1, (size - start + stride - 1) // stride + 1))
    iterations = 0 if stride == 1 and trial % 2 else int(rng.integers(0, 12))
    return SampledSegment(offset, size, k, start, stride, top, iterations)


def cases(count: int = 160):
    """(x, segments, band): random vectors with zeros, ties, NaN and huge values, cut into one to
    four segments (some of x left out)."""
    rng = np.random.default_rng(7)
    for trial in range(count):
        n = int(rng.integers(1, 12_000))
        x = rng.standard_normal(n).astype(np.float32 if trial % 2 else np.float64)
        if trial % 5 == 0:
            x[rng.integers(0, n, max(1, n // 3))] = 0.0
        if trial % 6 == 0:
            x = np.round(x * 2)                     # many ties
        if trial % 9 == 0:
            x[rng.integers(0, n)] = np.nan          # in or out of a sample
        if trial % 10 == 0:
            x[rng.integers(0, n)] = np.inf
        if trial % 13 == 0:                         # thresholds that overflow float32 when raised
            x = (np.clip(x, -4, 4) * (np.finfo(np.float32).max / 4)).astype(x.dtype)
        cuts = np.sort(rng.choice(np.arange(1, n), min(n - 1, int(rng.integers(0, 5))), replace=False))
        bounds = [0, *cuts.tolist(), n]
        segments = [segment_of(rng, x, lo, hi - lo, trial) for lo, hi in itertools.pairwise(bounds)
                    if len(bounds) == 2 or rng.random() < 0.8]
        band = PAPER if trial % 3 == 0 else ThresholdBand(
            float(rng.choice([1.0, 1.3, 4.0])), float(rng.choice([0.25, 0.8, 1.0])), 0,
            bool(rng.integers(0, 2)))
        yield x, segments, band


def same(expected: tuple, got: tuple, to_numpy) -> None:
    (idx, thresholds), (got_idx, got_thresholds) = expected, got
    np.testing.assert_array_equal(to_numpy(got_idx).astype(np.int64), np.asarray(idx, np.int64))
    assert len(thresholds) == len(got_thresholds)
    for threshold, got_threshold in zip(thresholds, got_thresholds, strict=True):
        assert (math.isnan(threshold) and math.isnan(got_threshold)) or threshold == got_threshold


def reference(x, segments, band):
    with np.errstate(over="ignore"):
        return Backend.sampled_threshold_select(get_backend("numpy"), x, segments, band)


def test_reference_composition_matches_the_specification_in_every_segment():
    for x, segments, band in cases():
        parts, thresholds = [], []
        for seg in segments:
            with np.errstate(over="ignore"):
                idx, threshold = dgc_sampled_selection(
                    x[seg.offset:seg.offset + seg.size], seg.k, seg.start, seg.stride, seg.top,
                    band.upper, band.lower, seg.iterations, band.resample)
            parts.append(np.asarray(idx, np.int64) + seg.offset)
            thresholds.append(threshold)
        same((np.concatenate(parts) if parts else np.zeros(0, np.int64), thresholds),
             reference(x, segments, band), np.asarray)


@pytest.mark.parametrize("kernels", ["auto", "off"])
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_frameworks_match_the_reference(framework, kernels):
    module = pytest.importorskip(framework)
    backend = get_backend(framework)
    tensor = module.from_numpy if framework == "torch" else module.constant
    hvd_sparse.set_kernels(kernels)
    try:
        for x, segments, band in cases(160 if framework == "torch" else 80):
            got = backend.sampled_threshold_select(tensor(x), segments, band)
            same(reference(x, segments, band), got, lambda t: t.numpy())
    finally:
        hvd_sparse.set_kernels("auto")


def test_kernels_answer_in_both_index_dtypes_and_decline_what_they_cannot_take():
    torch = pytest.importorskip("torch")
    from hvd_sparse.kernels import cpu

    x = np.random.default_rng(3).standard_normal(5000).astype(np.float32)
    plan = [SampledSegment(0, 3000, 5, 4, 33, 2, 10), SampledSegment(3000, 2000, 3, 0, 1, 3, 0)]
    expected = reference(x, plan, PAPER)
    assert expected[0][-1] >= 3000 and len(expected[1]) == 2
    for index_dtype in (torch.int32, torch.int64):
        got = cpu.sampled_threshold_select(torch.from_numpy(x), plan, PAPER, index_dtype)
        assert got[0].dtype == index_dtype
        same(expected, got, lambda t: t.numpy())
    one = [SampledSegment(0, 10, 1, 0, 1, 1, 0)]
    assert cpu.sampled_threshold_select(torch.ones(10, dtype=torch.float16), one, PAPER) is None
    assert cpu.sampled_threshold_select(torch.ones(2, 5), one, PAPER) is None
    assert cpu.sampled_threshold_select(torch.ones(10), [one[0]._replace(k=11)], PAPER) is None
    assert cpu.sampled_threshold_select(torch.ones(10), one * 2, PAPER) is None   # more than x holds
    four_samples = [SampledSegment(0, 10, 1, 0, 3, 5, 0)]   # asks for the 5th of 4 samples
    with pytest.raises(RuntimeError, match="refused its arguments"):
        cpu.sampled_threshold_select(torch.ones(10), four_samples, PAPER)
    with pytest.raises(RuntimeError, match="refused its arguments"):   # beyond x's end
        cpu.sampled_threshold_select(torch.ones(10), [SampledSegment(5, 6, 1, 0, 1, 1, 0)], PAPER)
    tf = pytest.importorskip("tensorflow")
    ops = hvd_sparse.kernels.tensorflow_ops()
    for index_dtype in ("int32", "int64"):
        got = ops.sampled_threshold_select(tf.constant(x), plan, PAPER, index_dtype)
        assert got[0].dtype.name == index_dtype
        same(expected, got, lambda t: t.numpy())
    assert ops.sampled_threshold_select(tf.ones([10], tf.float16), one, PAPER) is None
    with pytest.raises(tf.errors.InvalidArgumentError, match="refused its arguments"):
        ops.sampled_threshold_select(tf.ones([10]), four_samples, PAPER)
