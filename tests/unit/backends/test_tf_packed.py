"""The TensorFlow face hands the engine a bucket packed (``tf_backend.Packed``: the tensors'
specs and their flattened values): every method must then make the decisions it makes on the
bucket's tensors one by one, bit for bit -- selected indices, residuals, control state and the
average cut back into the tensors -- with the op library's kernels and without."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import hvd_sparse  # noqa: E402
from hvd_sparse import kernels  # noqa: E402
from hvd_sparse.backends import get_backend  # noqa: E402
from hvd_sparse.backends.tf_backend import Packed, packed_dtype, unpack  # noqa: E402
from hvd_sparse.comm.local import LocalGroup  # noqa: E402
from hvd_sparse.engine import Engine  # noqa: E402
from hvd_sparse.engine.planning import plan_buckets  # noqa: E402

SIZE = 2
SHAPES = [(7, 5), (5,), (3, 3, 4, 6), (1,), (300,), (12, 33)]
METHODS = [
    ("exdyna", {"threshold_scaling": "tracking"}),
    ("exdyna", {"rebalance": "histogram"}),
    ("micro", {}),
    ("deft", {}),
    ("topk", {"scope": "model"}),
    ("lags", {"merge_threshold": 0}),
    ("gaussiank", {"scope": "model"}),
    ("dgc", {"scope": "model"}),
    ("threshold", {"threshold": 1e-3}),
    ("randomk", {"scope": "model", "shared_seed": True}),
    ("exdyna", {"momentum": 0.9, "threshold_scaling": "tracking"}),
    ("topk", {"scope": "model", "dense_below": 10}),
]


def gradients(step: int, rank: int, dtypes: list[str]) -> list:
    rng = np.random.default_rng(100 * step + rank)
    out = []
    for shape, dtype in zip(SHAPES, dtypes, strict=True):
        x = rng.standard_t(3, size=shape) * 1e-3
        if step == 3 and rank == 1 and shape == (300,):
            x[17] = np.nan   # a skipped step on one rank
        out.append(tf.constant(x.astype(dtype)))
    return out


def run(method: str, options: dict, dtypes: list[str], packed: bool) -> tuple[list, list]:
    """Every step's averaged tensors and the residuals at the end, on every rank."""
    algorithm = hvd_sparse.create(method, density=0.05, **options)
    backend = get_backend("tensorflow")
    engines = [Engine(algorithm, backend, rank, SIZE) for rank in range(SIZE)]
    group = LocalGroup(SIZE, backend)
    keys = [f"g{i}" for i in range(len(SHAPES))]
    plan = plan_buckets(algorithm, keys, [int(np.prod(s)) for s in SHAPES])
    averages = []
    for step in range(6):
        grads = [gradients(step, rank, dtypes) for rank in range(SIZE)]
        for bucket, members in plan:
            chosen = [[g[keys.index(key)] for key in members] for g in grads]
            if packed:
                specs = [tf.TensorSpec(t.shape, t.dtype) for t in chosen[0]]
                inputs = [Packed(specs, ts) for ts in chosen]
            else:
                inputs = chosen
            with pytest.warns(RuntimeWarning) if step == 3 and "g4" in members else nullcontext():
                results = group.run([e.step(bucket, x) for e, x in zip(engines, inputs, strict=True)])
            if packed:
                results = [unpack(r.parts, list(r)) for r in results]
            averages.append([[t.numpy() for t in r] for r in results])
    residuals = [{key: b.residual.numpy() for key, b in e.buckets.items()} for e in engines]
    return averages, residuals


@pytest.mark.parametrize(("method", "options"), METHODS, ids=lambda v: v if isinstance(v, str) else
                         "-".join(f"{k}={x}" for k, x in v.items()) or "default")
@pytest.mark.parametrize("dtypes", [["float32"] * 6, ["float32", "float16", "float32", "bfloat16",
                                                      "float64", "float32"]], ids=["fp32", "mixed"])
@pytest.mark.parametrize("kernel_mode", ["auto", "off"])
def test_packed_bucket_makes_the_same_decisions(method, options, dtypes, kernel_mode):
    """Against the tensors one by one on the reference path: the packed bucket, with the op
    library's kernels (which write the residual in place and read the parts) and without."""
    previous = kernels.mode()
    try:
        kernels.set_mode("off")
        plain = run(method, options, dtypes, packed=False)
        kernels.set_mode(kernel_mode)
        packed = run(method, options, dtypes, packed=True)
    finally:
        kernels.set_mode(previous)
    for step, (a, b) in enumerate(zip(plain[0], packed[0], strict=True)):
        for rank_a, rank_b in zip(a, b, strict=True):
            for x, y in zip(rank_a, rank_b, strict=True):
                assert x.dtype == y.dtype and x.shape == y.shape
                np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8), err_msg=f"step {step}")
    for a, b in zip(plain[1], packed[1], strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key].view(np.uint8), b[key].view(np.uint8))


def test_packed_dtype_is_exact():
    assert packed_dtype(["float16"] * 3) == "float16"
    assert packed_dtype(["float16", "bfloat16"]) == "float32"
    assert packed_dtype(["float32", "float64"]) == "float64"


@pytest.mark.parametrize("lengths", [[25_000], [5, 1, 300, 64, 2], [5, 1, 300, 64, 2] * 3])
def test_segment_norms_match_numpy(lengths):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(sum(lengths)) * 1e-3).astype(np.float32)
    expected = get_backend("numpy").segment_norms(x, lengths)
    np.testing.assert_array_equal(get_backend("tensorflow").segment_norms(tf.constant(x), lengths), expected)
