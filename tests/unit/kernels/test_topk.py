"""Exact top-k by magnitude: the tie rule on every backend, the CPU kernel against the reference op;
DEFT's segment norms, identical float32 values on every backend and kernel; every method built on
top-k making identical decisions with kernels on and off."""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch

import hvd_sparse
from hvd_sparse.algorithms import DEFT, DGC, LAGS, GaussianK, TopK
from hvd_sparse.backends import exact as numerics
from hvd_sparse.backends import get_backend
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine
from hvd_sparse.engine.planning import plan_buckets
from tests.unit.kernels.test_cpu import cpu_ops, gradients, needs_kernels, same

NP, TB = get_backend("numpy"), get_backend("torch")

# The kernel samples min(1024, n // 256) runs of 64 entries and takes the sampled bracket from 16
# runs (4096 entries) up; below, the radix select. LARGE samples the most runs, MID fewer.
LARGE = 300_000
MID = (5_000, 40_000, 150_000)
SAMPLE_RUNS, RUN_LENGTH, SAMPLE_SHARE, MIN_RUNS = 1024, 64, 4, 16   # as in hvd_sparse/kernels/cpu/topk.cpp


def sampled_runs(n: int) -> list[int]:
    """Where the kernel's sampled runs start in a vector of n entries (none: radix select)."""
    runs = min(SAMPLE_RUNS, n // (RUN_LENGTH * SAMPLE_SHARE))
    stride = n // runs if runs >= MIN_RUNS else 0
    return [run * stride + (stride - RUN_LENGTH) // 2 for run in range(runs)] if stride else []


def reference(function: Callable, *args):
    """``function(*args)`` on the reference path (kernels off), the mode restored after."""
    previous = hvd_sparse.kernels_mode()
    hvd_sparse.set_kernels("off")
    try:
        return function(*args)
    finally:
        hvd_sparse.set_kernels(previous)


def tie_rule(x: np.ndarray, k: int) -> np.ndarray:
    """The rule written out by a full sort: magnitudes with NaN above +Inf and -0 == +0, ties by
    the lowest index; ascending indices."""
    magnitude = np.abs(x.astype(np.float64))
    magnitude[np.isnan(magnitude)] = np.inf
    rank_nan = np.isnan(x)   # NaN above +Inf: sort key (is NaN, magnitude), descending
    order = np.lexsort((np.arange(x.size), -magnitude, ~rank_nan))
    return np.sort(order[:k]).astype(np.int64)


def vectors(n: int, seed: int) -> dict[str, np.ndarray]:
    """fp64 vectors: random, heavy-tailed, all equal, all zero (both signs), few distinct values,
    non-finite, and one whose large entries hide between the kernel's sampled runs."""
    rng = np.random.default_rng(seed)
    special = rng.standard_normal(n)
    special[rng.random(n) < 0.01] = np.nan
    special[rng.random(n) < 0.01] = np.inf
    special[rng.random(n) < 0.01] = -np.inf
    special[rng.random(n) < 0.01] = -np.nan
    hidden = rng.standard_normal(n) * 100.0
    for start in sampled_runs(n):   # the runs the kernel samples: small entries
        hidden[start:start + RUN_LENGTH] = rng.standard_normal(RUN_LENGTH) * 1e-3
    return {
        "random": rng.standard_normal(n),
        "heavy": rng.standard_t(2, n) * np.exp(rng.standard_normal(n)),
        "tied": np.full(n, -0.25),
        "zero": np.where(rng.random(n) < 0.5, -0.0, 0.0),
        "few": rng.integers(-3, 4, n).astype(np.float64),
        "nonfinite": special,
        "hidden": hidden,
    }


def ks(n: int) -> list[int]:
    return sorted(k for k in {0, 1, 2, n // 1000 + 1, n // 100, n // 2, n - 1, n} if 0 <= k <= n)


# --- the rule, on every backend ---------------------------------------------------------------------
SPECIAL = np.array([1.0, -3.0, 3.0, np.nan, -0.0, 0.0, np.inf, -np.nan, 2.0, -np.inf, 3.0, -3.0, 0.0])


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_numpy_reference_is_the_rule(dtype):
    for name, x in {"special": SPECIAL, **vectors(5_000, 1)}.items():
        x = x.astype(dtype)
        for k in ks(x.size):
            np.testing.assert_array_equal(NP.topk_abs_indices(x, k), tie_rule(x, k), err_msg=f"{name} k={k}")


def test_the_rule_on_a_small_example():
    # |x|: NaN NaN Inf Inf 3 3 3 3 2 1 0 0 0 -> the top 6 take the 3s at indices 1 and 2.
    assert NP.topk_abs_indices(SPECIAL, 6).tolist() == [1, 2, 3, 6, 7, 9]
    assert NP.topk_abs_indices(SPECIAL, 11).tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("mode", ["auto", "off"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_torch_backend_follows_the_rule(mode, dtype):
    for name, x in {"special": SPECIAL, **vectors(3_000, 2)}.items():
        t = torch.from_numpy(x).to(dtype)
        expected_input = t.float().numpy() if dtype == torch.bfloat16 else t.numpy()
        for k in ks(t.numel()):
            got = TB.topk_abs_indices(t, k) if mode == "auto" else reference(TB.topk_abs_indices, t, k)
            assert got.dtype == torch.int64
            np.testing.assert_array_equal(got.numpy(), tie_rule(expected_input, k), err_msg=f"{name} k={k}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_tensorflow_backend_follows_the_rule(dtype):
    tf = pytest.importorskip("tensorflow")
    tfb = get_backend("tensorflow")
    for name, x in {"special": SPECIAL, **vectors(2_000, 3)}.items():
        t = tf.cast(tf.constant(x), dtype)
        expected_input = tf.cast(t, tf.float64).numpy()
        for k in ks(x.size):
            got = tfb.topk_abs_indices(t, k).numpy()
            np.testing.assert_array_equal(got, tie_rule(expected_input, k), err_msg=f"{name} k={k}")


# --- the kernel against the reference ---------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("n", [1, 1_000, *MID, LARGE])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernel_matches_the_reference(n, dtype):
    ops = cpu_ops()
    for name, x in vectors(n, n).items():
        t = torch.from_numpy(x).to(dtype)
        for k in ks(n):
            want = reference(TB.topk_abs_indices, t, k)
            for index_dtype in (torch.int32, torch.int64):
                got = ops.topk_abs(t, k, index_dtype)
                assert got.dtype == index_dtype
                assert torch.equal(got.long(), want), f"{name} n={n} k={k} {dtype} {index_dtype}"


@needs_kernels
def test_kernel_takes_non_contiguous_and_multi_dimensional_inputs():
    ops = cpu_ops()
    x = torch.from_numpy(vectors(2 * LARGE, 4)["heavy"]).float()
    for t in (x[::2], x.view(600, 1000).t(), x.view(600, 1000)):
        for k in (1, 300, 3_000):
            assert torch.equal(ops.topk_abs(t, k, torch.int64), reference(TB.topk_abs_indices, t, k))


@needs_kernels
def test_kernel_declines_what_it_does_not_handle():
    ops = cpu_ops()
    assert ops.topk_abs(torch.ones(8, dtype=torch.float16), 2, torch.int64) is None
    assert ops.topk_abs(torch.ones(8, dtype=torch.bfloat16), 2, torch.int64) is None
    assert ops.topk_abs(torch.ones(8), 2, torch.int16) is None
    assert ops.topk_abs(torch.ones(8), 9, torch.int64) is None   # the reference op decides


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_abs_at_least_kernel_matches_the_reference_selection(dtype):
    """DGC's |a| >= λ without a |a| vector: the reference ``select_at_least`` without probes."""
    ops = cpu_ops()
    for name, x in vectors(20_000, 9).items():
        t = torch.from_numpy(x).to(dtype)
        finite = np.abs(x[np.isfinite(x)])
        median = float(np.median(finite)) if finite.size else 1.0
        for threshold in (median, 0.1 + median, 0.0, -1.0, float("inf"), float("nan"), 1e39):
            for lo, hi in ((0, 20_000), (0, 0), (777, 777), (3, 19_001)):
                with np.errstate(over="ignore"):   # NumPy warns as it rounds 1e39 to float32 inf
                    want = reference(TB.select_at_least, t, lo, hi, threshold)[0]
                for index_dtype in (torch.int32, torch.int64):
                    got = ops.abs_at_least(t, lo, hi, threshold, index_dtype)
                    assert got.dtype == index_dtype
                    assert torch.equal(got.long(), want), f"{name} {dtype} λ={threshold} [{lo}, {hi})"


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_kernel_matches_the_reference_bit_for_bit(dtype, nesterov):
    ops = cpu_ops()
    x = vectors(30_000, 12)
    residual = torch.from_numpy(x["heavy"]).to(dtype)
    momentum = torch.from_numpy(x["random"]).to(dtype)
    grads = [torch.from_numpy(x["nonfinite"][:10_000]).to(dtype),
             torch.from_numpy(x["zero"][:20_000]).to(dtype).view(100, 200).t()]   # -0, non-contiguous
    want = reference(TB.momentum_accumulate, residual.clone(), momentum.clone(), grads, 0.9, nesterov)
    got = residual.clone(), momentum.clone()
    assert ops.momentum_accumulate(*got, grads, 0.9, nesterov)
    assert same(got[0], want[0]) and same(got[1], want[1])
    assert ops.momentum_accumulate(residual, momentum, [g.half() for g in grads], 0.9, nesterov) is None


# --- segment norms --------------------------------------------------------------------------------
LENGTHS = [0, 1, 5, 2047, 2049, 0, 100_000]


def norm_inputs(seed: int) -> dict[str, np.ndarray]:
    n = sum(LENGTHS)
    out = {name: x[:n] for name, x in vectors(LARGE, seed).items() if name != "hidden"}
    out["huge"] = np.random.default_rng(seed).standard_normal(n) * 1e200   # squares beyond float64
    out["tiny"] = np.random.default_rng(seed).standard_normal(n) * 1e-310  # subnormal, squares underflow
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_segment_norms_are_float32_of_the_exact_norm_on_every_path(dtype):
    starts = np.cumsum([0, *LENGTHS])
    for name, x in norm_inputs(5).items():
        t = torch.from_numpy(x).to(dtype)
        exact = [numerics.exact_float32_norm(t[a:b].numpy()) for a, b in itertools.pairwise(starts)]
        paths = {"numpy": NP.segment_norms(t.numpy(), LENGTHS),
                 "torch": reference(TB.segment_norms, t, LENGTHS),
                 "torch, kernels on": TB.segment_norms(t, LENGTHS)}
        for path, got in paths.items():
            np.testing.assert_array_equal(got, exact, err_msg=f"{name} {dtype} {path}")
        assert all(np.float32(v) == v or not np.isfinite(v) for v in exact)


def test_segment_norms_that_a_sum_cannot_decide_come_from_the_exact_sum(monkeypatch):
    low = np.float32(1.5)
    high = np.nextafter(low, np.float32(2))
    midpoint = (float(low) + float(high)) / 2                 # sqrt(total) on a float32 tie
    assert numerics.certain_float32_norm(midpoint ** 2, 1000) is None
    assert numerics.certain_float32_norm(float(low) ** 2, 1000) == float(low)
    assert np.isnan(numerics.certain_float32_norm(float("nan"), 10))
    # Every norm through the exact sum: the same values as through the certain float64 sums.
    x = torch.from_numpy(norm_inputs(6)["heavy"]).float()
    fast = TB.segment_norms(x, LENGTHS), reference(TB.segment_norms, x, LENGTHS)
    monkeypatch.setattr(numerics, "certain_float32_norm", lambda total, depth: None)
    slow = TB.segment_norms(x, LENGTHS), reference(TB.segment_norms, x, LENGTHS)
    for a, b in zip(fast, slow, strict=True):
        np.testing.assert_array_equal(a, b)


@needs_kernels
def test_segment_norms_kernel_declines_what_it_does_not_handle():
    ops = cpu_ops()
    assert ops.segment_norms(torch.ones(8, dtype=torch.float16), [8]) is None
    assert ops.segment_norms(torch.ones(8), [3, 4]) is None
    np.testing.assert_array_equal(ops.segment_norms(torch.ones(8).view(2, 4).t(), [4, 4]), [2.0, 2.0])


# --- methods built on top-k: kernels on and off -----------------------------------------------------
def run_steps(algorithm, size, steps, grads_at, keys):
    """Every rank's returned tensors, residuals and statistics after each step, bucket by bucket
    as the algorithm plans them."""
    sizes = [t.numel() for t in grads_at(0, 0)]
    plan = plan_buckets(algorithm, keys, sizes)
    position = {key: i for i, key in enumerate(keys)}
    engines = [Engine(copy.deepcopy(algorithm), TB, r, size, write_into_inputs=True) for r in range(size)]
    group, history = LocalGroup(size, TB), []
    for step in range(steps):
        inputs = [[t.clone() for t in grads_at(step, r)] for r in range(size)]
        record = []
        for name, members in plan:
            outs = group.run([e.step(name, [inputs[r][position[m]] for m in members])
                              for r, e in enumerate(engines)])
            record.append([([o.clone() for o in out], e.buckets[name].residual.clone())
                           for out, e in zip(outs, engines, strict=True)])
        group.run([e.end_step() for e in engines])
        record.append([{key: repr(value) for key, value in e.stats().items()
                        if not key.endswith("seconds")} for e in engines])
        history.append(record)
    return history


def assert_identical(on, off):
    for step, (a, b) in enumerate(zip(on, off, strict=True)):
        for bucket, (ranks_a, ranks_b) in enumerate(zip(a[:-1], b[:-1], strict=True)):
            for rank, ((out_a, res_a), (out_b, res_b)) in enumerate(zip(ranks_a, ranks_b, strict=True)):
                where = f"step {step} bucket {bucket} rank {rank}"
                assert all(same(x, y) for x, y in zip(out_a, out_b, strict=True)), where
                assert same(res_a, res_b), where
        assert a[-1] == b[-1], f"step {step}: statistics differ"


CONFIGS = [
    ("topk-tensor-gather", TopK(0.01), 3),
    ("topk-tensor-union", TopK(0.01, pattern="union"), 2),
    ("topk-model-gather", TopK(0.005, scope="model"), 4),
    ("topk-model-union", TopK(0.005, pattern="union", scope="model"), 3),
    ("lags", LAGS(0.01, merge_threshold=5_000), 3),
    ("deft", DEFT(0.01), 4),
    ("deft-agreed", DEFT(0.005, agreed_k=True, packing="heap"), 3),
    ("dgc", DGC(0.01, scope="model"), 2),
    ("dgc-tensor", DGC(0.01), 3),
    ("gaussiank", GaussianK(0.01, scope="model"), 3),
    ("gaussiank-rescale", GaussianK(0.01, variant="rescale"), 2),
]


@needs_kernels
@pytest.mark.parametrize("name,algorithm,size", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_methods_identical_with_kernels_on_and_off(name, algorithm, size):
    sizes = [LARGE, 2_000, 777, 4_096]
    grads = gradients(11, sizes, [torch.float32, torch.float16, torch.bfloat16, torch.float32])
    keys = [f"layer{i}" for i in range(len(sizes))]
    steps = 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # the non-finite step warns
        on = run_steps(algorithm, size, steps, grads, keys)
        off = reference(run_steps, algorithm, size, steps, grads, keys)
    assert_identical(on, off)


@needs_kernels
@pytest.mark.parametrize("nesterov", [False, True])
def test_dgc_on_fp32_gradients_identical_with_kernels_on_and_off(nesterov):
    """fp32 gradients take the momentum kernel (the mixed-precision runs above do not)."""
    sizes = [LARGE, 2_000]
    grads = gradients(13, sizes, [torch.float32, torch.float32])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # the non-finite step warns
        on = run_steps(DGC(0.01, scope="model", nesterov=nesterov), 3, 8, grads, ["a", "b"])
        off = reference(run_steps, DGC(0.01, scope="model", nesterov=nesterov), 3, 8, grads, ["a", "b"])
    assert_identical(on, off)


@needs_kernels
def test_ties_select_the_same_entries_with_kernels_on_and_off():
    """All-equal and all-zero gradients: top-k picks the lowest indices on every path."""
    def tied(step, rank):
        value = 0.0 if step % 2 else 0.5 * (rank + 1)
        return [torch.full((LARGE,), value), torch.full((1_000,), -value)]
    for algorithm in (TopK(0.01, scope="model"), DEFT(0.01), LAGS(0.01)):
        on = run_steps(algorithm, 2, 4, tied, ["a", "b"])
        off = reference(run_steps, algorithm, 2, 4, tied, ["a", "b"])
        assert_identical(on, off)
