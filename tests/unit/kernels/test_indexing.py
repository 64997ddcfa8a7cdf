"""The CPU index-write kernels (hvd_sparse/kernels/cpu/indexing.cpp) and the int32-preserving backend ops they
serve (``zero_at``, ``scatter_into``, ``take``, ``count_in_ranges``): the same result as the
reference ops, bit for bit, for both index dtypes; an invalid index raises and writes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hvd_sparse.backends import get_backend
from tests.unit.kernels.test_cpu import cpu_ops, needs_kernels
from tests.unit.kernels.test_topk import reference

TB = get_backend("torch")
VALUES = [torch.float32, torch.float64]
INDICES = [torch.int32, torch.int64]


def sample(n: int, count: int, value_dtype, index_dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64).to(value_dtype)
    idx = torch.randperm(n, generator=g)[:count].sort().values.to(index_dtype)
    return x, idx


@needs_kernels
@pytest.mark.parametrize("value_dtype", VALUES)
@pytest.mark.parametrize("index_dtype", INDICES)
@pytest.mark.parametrize("count", [0, 1, 37, 1000])
def test_zero_at_matches_reference(value_dtype, index_dtype, count):
    cpu_ops()
    x, idx = sample(1000, count, value_dtype, index_dtype)
    expected = reference(TB.zero_at, x.clone(), idx)
    got = TB.zero_at(x.clone(), idx)
    assert torch.equal(got, expected)
    assert cpu_ops().zero_at(x.clone(), idx) is True   # the kernel ran, not the fallback


@needs_kernels
@pytest.mark.parametrize("value_dtype", VALUES)
@pytest.mark.parametrize("index_dtype", INDICES)
def test_put_at_writes_fp32_values_exactly(value_dtype, index_dtype):
    ops = cpu_ops()
    x, idx = sample(500, 123, value_dtype, index_dtype)
    idx = idx + 7   # absolute indices of a tensor that starts at entry 7 of the bucket
    values = torch.randn(123, dtype=torch.float32)
    expected = x.clone()
    expected[idx.long() - 7] = values.to(value_dtype)
    got = x.clone()
    assert ops.put_at(got, idx, values, 7) is True
    assert torch.equal(got, expected)


@needs_kernels
@pytest.mark.parametrize("index_dtype", INDICES)
@pytest.mark.parametrize("bad", [-1, 1000])
def test_invalid_index_raises_and_writes_nothing(index_dtype, bad):
    ops = cpu_ops()
    x, idx = sample(1000, 10, torch.float32, index_dtype)
    idx[-1] = bad
    before = x.clone()
    with pytest.raises(IndexError, match="outside a vector of 1000"):
        ops.zero_at(x, idx)
    with pytest.raises(IndexError, match="outside a vector of 1000"):
        ops.put_at(x, idx, torch.ones(10), 0)
    assert torch.equal(x, before)


@needs_kernels
def test_unhandled_arguments_fall_back():
    ops = cpu_ops()
    x16, idx = sample(100, 10, torch.float16, torch.int32)
    assert ops.zero_at(x16, idx) is None
    x, idx = sample(100, 10, torch.float32, torch.int32)
    assert ops.put_at(x, idx, torch.ones(10, dtype=torch.float64)) is None   # values not fp32
    assert ops.zero_at(x[::2], idx[:5]) is None                               # not contiguous


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("index_dtype", INDICES)
@pytest.mark.parametrize("unique", [True, False])
def test_scatter_into_same_with_kernels_on_and_off(grad_dtype, index_dtype, unique):
    shapes = [(7, 3), (0,), (50,), (4, 4, 2)]
    n = sum(int(np.prod(s)) for s in shapes)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, n, (60,), generator=g).to(index_dtype)
    if unique:
        idx = torch.unique(idx)
    values = torch.randn(idx.numel(), generator=g)

    def run():
        tensors = [torch.full(s, 5.0, dtype=grad_dtype) for s in shapes]
        return TB.scatter_into(tensors, idx, values, unique)

    expected = reference(run)
    got = run()
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == grad_dtype and torch.equal(a, b)
    dense = torch.zeros(n, dtype=torch.float32).index_add_(0, idx.long(), values)
    assert torch.equal(torch.cat([t.reshape(-1) for t in got]), dense.to(grad_dtype))


@pytest.mark.parametrize("index_dtype", INDICES)
def test_count_in_ranges_and_take_keep_the_index_dtype(index_dtype):
    x, idx = sample(1000, 300, torch.float32, index_dtype)
    bounds = np.array([0, 10, 10, 500, 999, 1000])
    counts = TB.count_in_ranges(idx, bounds)
    expected = np.histogram(idx.numpy(), bins=bounds)[0]
    expected[-1] = int(np.sum(idx.numpy() >= 999))   # histogram's last bin is closed
    assert counts.dtype == np.int64 and counts.tolist() == expected.tolist()
    assert torch.equal(TB.take(x, idx), x[idx.long()])
