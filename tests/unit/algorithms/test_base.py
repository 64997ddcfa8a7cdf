"""What the baseline methods (TopK, RandomK, Threshold, GaussianK, DGC) share through Algorithm
(hvd_sparse/algorithms/base.py) and the engine: the density check, refused integer gradients, and
fp16/bf16 gradients with fp32 residuals."""

from __future__ import annotations

import numpy as np
import pytest

from hvd_sparse import ConfigurationError, UnsupportedTensorError
from hvd_sparse.algorithms import DGC, GaussianK, RandomK, Threshold, TopK
from hvd_sparse.comm.local import LocalGroup
from tests.unit.algorithms.simulated import make_engines, residual_of

METHODS = [TopK, RandomK, Threshold, GaussianK, DGC]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("density", [0, -0.5, 1.01, float("inf"), "0.1", None])
def test_density_outside_unit_interval_is_refused_with_the_fix(method, density):
    with pytest.raises(ConfigurationError, match=r"density must be"):
        method(density)


@pytest.mark.parametrize("method", METHODS)
def test_integer_gradients_are_refused_on_every_rank_before_any_collective(method):
    size = 3
    engines, group = make_engines(method(0.1), size), LocalGroup(size)
    with pytest.raises(UnsupportedTensorError, match="floating-point") as raised:
        group.run([e.step("w", [np.arange(30, dtype=np.int64)]) for e in engines])
    assert raised.value.ranks_raised == [0, 1, 2]


@pytest.mark.parametrize("method", METHODS)
def test_fp16_and_bf16_gradients_work_with_fp32_residuals(method):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(7)
    for dtype, transport in ((np.float16, "float16"), (ml_dtypes.bfloat16, "float32")):
        engines, group = make_engines(method(0.2), 2), LocalGroup(2)
        for _ in range(3):
            grads = [[rng.standard_normal(60).astype(np.float32).astype(dtype)] for _ in range(2)]
            accs = [residual_of(e, "w", 60) + grads[r][0].astype(np.float32) for r, e in enumerate(engines)]
            outputs = group.run([e.step("w", grads[r]) for r, e in enumerate(engines)])
            assert outputs[0][0].dtype == dtype
            for r, engine in enumerate(engines):
                bucket = engine.buckets["w"]
                assert bucket.residual.dtype == np.float32 and bucket.value_dtype == transport
                if method is not DGC:  # DGC's residual is the velocity, not g + e
                    changed = np.flatnonzero(bucket.residual != accs[r])
                    rounded = accs[r][changed].astype(transport).astype(np.float32)
                    np.testing.assert_array_equal(rounded + bucket.residual[changed], accs[r][changed])
