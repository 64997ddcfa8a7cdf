"""The CPU kernels (hvd_sparse.kernels.cpu) against the reference path, op by op and through the
engine: identical indices, thresholds, partition tables and residuals, bit for bit, with kernels
on and off; the switch; the fallback when the native library cannot load."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import hvd_sparse
from hvd_sparse import ConfigurationError, kernels
from hvd_sparse.algorithms import DGC, LAGS, ExDyna, MiCRO, Threshold, TopK
from hvd_sparse.backends import get_backend
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine

TB = get_backend("torch")
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def cpu_ops():
    """The CPU op module; the test fails (not skips) when it cannot load: it must be built."""
    kernels._forget()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops = kernels.ops_for(torch.zeros(1))
    assert ops is not None, "kernels off in this run"
    return ops


needs_kernels = pytest.mark.skipif(kernels.mode() == "off", reason="HVD_SPARSE_KERNELS=off run: "
                                   "the reference path alone (the kernel comparisons run by default)")


@pytest.fixture
def reference():
    """Run the body with kernels off (the reference path), then restore the mode."""
    def run(function, *args, **kwargs):
        previous = kernels.mode()
        kernels.set_mode("off")
        try:
            return function(*args, **kwargs)
        finally:
            kernels.set_mode(previous)
    return run


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included) of two tensors of one dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view)) if a.is_floating_point() \
        else torch.equal(a, b)


def kinds(n: int, seed: int) -> dict[str, torch.Tensor]:
    """fp64 vectors of the shapes the issue names: random, heavy-tailed, tied, zero, non-finite."""
    g = torch.Generator().manual_seed(seed)
    heavy = torch.distributions.StudentT(2.0).sample((n,)).double() * 1e-2
    special = torch.randn(n, generator=g, dtype=torch.float64)
    special[:: max(1, n // 7)] = float("nan")
    special[3:: max(1, n // 5)] = float("inf")
    special[5:: max(1, n // 5)] = -float("inf")
    return {"random": torch.randn(n, generator=g, dtype=torch.float64), "heavy": heavy,
            "tied": torch.full((n,), 0.25, dtype=torch.float64), "zero": torch.zeros(n, dtype=torch.float64),
            "nonfinite": special}


# --- ops ------------------------------------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("dtype", FLOATS)
def test_all_finite_matches_isfinite(dtype):
    ops = cpu_ops()
    for name, x in kinds(5000, 1).items():
        x = x.to(dtype)
        assert ops.all_finite([x]) == bool(torch.isfinite(x).all()), name
        assert ops.all_finite([torch.ones(3, dtype=dtype), x[::3]]) == bool(torch.isfinite(x[::3]).all())
    big = torch.full((10,), 3e38, dtype=torch.float32)   # a finite sum would overflow fp32
    assert ops.all_finite([big]) and TB.tensors_finite([big])
    assert ops.all_finite([torch.tensor([1e300], dtype=torch.float64)])
    assert ops.all_finite([torch.zeros(0)])
    assert ops.all_finite([torch.zeros(3, dtype=torch.int32)]) is None   # not handled: reference


@pytest.mark.parametrize("backend", ["numpy", "torch", "tensorflow"])
def test_finite_check_is_exact_on_every_backend(backend):
    """A sum of finite values that overflows fp32 is still finite; NaN and Inf are not."""
    b = get_backend(backend)
    cases = [([np.full(10, 3e38, np.float32)], True), ([np.array([1e300])], True),
             ([np.ones(3, np.float32), np.array([np.nan], np.float32)], False),
             ([np.array([-np.inf], np.float16)], False), ([np.ones(4, np.float16)], True)]
    for arrays, finite in cases:
        assert b.tensors_finite([b.from_numpy(a) for a in arrays]) is finite, (backend, arrays)


def reference_accumulate(residual, tensors):
    offset = 0
    for t in tensors:
        residual[offset:offset + t.numel()].add_(t.reshape(-1))
        offset += t.numel()
    return residual


@needs_kernels
@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("clear", [False, True])
def test_accumulate_is_torch_add_bit_for_bit(residual_dtype, clear):
    ops = cpu_ops()
    for name, x in kinds(3001, 2).items():
        start = (torch.randn(4 * 3001, dtype=torch.float64) * 3).to(residual_dtype)
        inputs = [x.to(d) for d in FLOATS]
        expected = reference_accumulate(start.clone(), inputs)
        given = [t.clone() for t in inputs]
        residual = start.clone()
        assert ops.accumulate(residual, given, clear) is residual
        assert same(residual, expected), name
        for t, original in zip(given, inputs, strict=True):
            assert same(t, torch.zeros_like(t) if clear else original)


@needs_kernels
def test_accumulate_takes_non_contiguous_inputs_and_clears_them():
    ops = cpu_ops()
    base = torch.randn(40, 30, dtype=torch.float64)

    def make():
        return [base.t().to(torch.float16), base.float().clone()[:, ::2]]

    inputs, given = make(), make()
    assert not any(t.is_contiguous() for t in given)
    start = torch.randn(sum(t.numel() for t in inputs))
    expected = reference_accumulate(start.clone(), inputs)
    residual = start.clone()
    assert ops.accumulate(residual, given, True) is residual
    assert same(residual, expected)
    assert all(bool((t == 0).all()) for t in given)


@needs_kernels
def test_accumulate_select_if_finite_writes_nothing_when_an_input_is_not_finite():
    ops = cpu_ops()
    residual, inputs = torch.randn(10), [torch.randn(4), torch.randn(6).half()]
    inputs[1][2] = float("inf")
    before, given = residual.clone(), [t.clone() for t in inputs]
    assert ops.accumulate_select_if_finite(residual, given, 0, 10, 0.1, [0.2], 1, torch.int32,
                                           True) == (residual, None, [], False)
    assert same(residual, before) and all(same(a, b) for a, b in zip(given, inputs, strict=True))
    inputs[1][2] = 0.5
    expected = before + torch.cat([t.float() for t in inputs])
    acc, idx, _, finite = ops.accumulate_select_if_finite(residual, inputs, 0, 10, 0.1, [], 1, torch.int64,
                                                          True)
    assert finite and acc is residual and same(residual, expected)
    assert torch.equal(idx, torch.nonzero(expected.abs() >= 0.1).reshape(-1))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("where", ["none", "first entry", "small tensor", "mid-chunk", "last entry"])
def test_the_finite_check_in_the_accumulating_pass_restores_the_residual(dtype, where, monkeypatch):
    """Inputs of the residual's dtype, cleared: the check is made in the pass (no read before it,
    so all_finite must not run), and a NaN/Inf anywhere leaves the residual's bits as they were."""
    ops = cpu_ops()
    accumulate = sys.modules["hvd_sparse.kernels.cpu.accumulate"]
    monkeypatch.setattr(accumulate, "all_finite", lambda tensors: pytest.fail("read before the pass"))
    sizes = [3000, 5, 70_000]                     # several chunks, and a tensor inside one chunk
    residual = torch.randn(sum(sizes), dtype=dtype)
    residual[7] = -0.0
    inputs = [torch.randn(n, dtype=dtype) for n in sizes]
    spots = {"first entry": (0, 0, float("nan")), "small tensor": (1, 3, float("inf")),
             "mid-chunk": (2, 40_000, float("-inf")), "last entry": (2, 69_999, float("nan"))}
    if where != "none":
        tensor, index, value = spots[where]
        inputs[tensor][index] = value
    before, given = residual.clone(), [t.clone() for t in inputs]
    lo, hi, probes = 1000, 60_000, [0.5, 2.0]
    _, idx, counts, finite = ops.accumulate_select_if_finite(residual, given, lo, hi, 1.0, probes, 1,
                                                             torch.int32, True)
    if where != "none":
        assert not finite and idx is None and counts == []
        assert same(residual, before)
        return
    expected = before + torch.cat(inputs)
    assert finite and same(residual, expected)
    assert all(bool((t == 0).all()) and not bool(torch.signbit(t).any()) for t in given)
    part = expected[lo:hi].abs()
    assert torch.equal(idx.long(), torch.nonzero(part >= 1.0).reshape(-1) + lo)
    assert counts == [float((part >= p).sum()) for p in probes]


def reference_select(residual, tensors, lo, hi, threshold, probes, every):
    acc = reference_accumulate(residual, tensors)
    magnitude = acc[lo:hi].abs()
    counts = TB.count_at_least(magnitude, probes, every) if probes else []
    idx = torch.from_numpy(np.flatnonzero(magnitude.numpy() >= threshold)) + lo
    return acc, idx, counts


@needs_kernels
@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_accumulate_select_matches_the_reference(residual_dtype, index_dtype):
    ops = cpu_ops()
    n = 3 * 20_000
    for name, x in kinds(n // 3, 3).items():
        inputs = [x.to(torch.float16), x.to(residual_dtype), x.to(torch.bfloat16)]
        start = (torch.randn(n, dtype=torch.float64) * 0.1).to(residual_dtype)
        for lo, hi in [(0, n), (0, 0), (n, n), (7, n - 3), (n // 3 - 5, 2 * n // 3 + 9), (n - 1, n)]:
            # 0.1 is not a float: it is compared after rounding to the residual's dtype; 0.25 ties
            for threshold in [0.1, 0.25, 0.0, 1.7, float("inf")]:
                for probes, every in [([], 1), ([0.05, 0.3], 1), ([0.05, 0.3, 0.25], 8)]:
                    if probes and hi - lo == 0:
                        continue   # the reference divides by the empty range's length
                    acc, idx, counts = reference_select(start.clone(), inputs, lo, hi, threshold, probes,
                                                        every)
                    given = [t.clone() for t in inputs]
                    residual = start.clone()
                    _, got_idx, got_counts, _ = ops.accumulate_select(
                        residual, given, lo, hi, threshold, probes, every, index_dtype, True)
                    where = f"{name} [{lo}, {hi}) T={threshold} probes={probes}/{every}"
                    assert same(residual, acc), where
                    assert got_idx.dtype == index_dtype, where
                    assert torch.equal(got_idx.long(), idx), where
                    assert got_counts == counts, where
                    assert all(bool((t == 0).all()) for t in given), where


@needs_kernels
def test_threshold_is_rounded_to_the_residual_dtype_as_numpy_and_torch_do():
    ops = cpu_ops()
    t = 0.1                                   # float32(0.1) > 0.1
    f = float(np.float32(t))
    below = float(np.nextafter(np.float32(f), np.float32(0)))
    residual = torch.tensor([f, below, -f, t], dtype=torch.float32)
    idx = ops.accumulate_select(residual, [torch.zeros(4)], 0, 4, t, [], 1, torch.int64, False).idx
    assert idx.tolist() == np.flatnonzero(np.abs(residual.numpy()) >= t).tolist() == [0, 2, 3]
    assert idx.tolist() == torch.nonzero(residual.abs() >= t).reshape(-1).tolist()


@needs_kernels
def test_ops_decline_what_they_do_not_handle():
    ops = cpu_ops()
    residual = torch.zeros(4, dtype=torch.float16)
    assert ops.accumulate(residual, [torch.ones(4)], False) is None
    assert ops.accumulate(torch.zeros(6)[::2], [torch.ones(3)], False) is None
    assert ops.accumulate(torch.zeros(4), [torch.ones(3)], False) is None       # sizes disagree
    assert ops.accumulate(torch.zeros(4), [torch.ones(4, dtype=torch.int32)], False) is None
    # ... and the backend then runs the reference ops
    assert same(TB.accumulate(torch.zeros(4, dtype=torch.float64), [torch.ones(4, dtype=torch.int32)]),
                torch.ones(4, dtype=torch.float64))


# --- the engine, kernels on and off -----------------------------------------------------------------
def run_steps(algorithm, size, steps, grads_at, write_into_inputs, nonfinite="skip"):
    """Every rank's returned tensors, residual and control state after each step."""
    engines = [Engine(copy.deepcopy(algorithm), TB, r, size, nonfinite=nonfinite,
                      write_into_inputs=write_into_inputs) for r in range(size)]
    group, history = LocalGroup(size, TB), []
    for step in range(steps):
        inputs = [[t.clone() for t in grads_at(step, r)] for r in range(size)]
        outs = group.run([e.step("model", inputs[r]) for r, e in enumerate(engines)])
        history.append([([o.clone() for o in out], e.buckets["model"].residual.clone(),
                         copy.deepcopy(e.algorithm.control_state(e.buckets["model"].control)),
                         e.stats()) for out, e in zip(outs, engines, strict=True)])
    return history


def gradients(seed, sizes, dtypes, scale=1e-2):
    def at(step, rank):
        g = torch.manual_seed(seed * 1000 + step * 16 + rank)   # StudentT draws from the global one
        out = []
        for i, (n, dtype) in enumerate(zip(sizes, dtypes, strict=True)):
            layer = torch.distributions.StudentT(3.0).sample((n,)) * scale * (1 + i) * (1 + (step % 5 == 0))
            x = (layer + 1e-3 * torch.randn(n, generator=g)).to(dtype)
            if step == 7 and rank == 1:      # a non-finite gradient on one rank
                x.view(-1)[n // 2] = float("nan")
            out.append(x)
        return out
    return at


def assert_identical(on, off):
    for step, (ranks_on, ranks_off) in enumerate(zip(on, off, strict=True)):
        for rank, ((out_a, res_a, ctl_a, st_a), (out_b, res_b, ctl_b, st_b)) in enumerate(
                zip(ranks_on, ranks_off, strict=True)):
            where = f"step {step} rank {rank}"
            assert all(same(a, b) for a, b in zip(out_a, out_b, strict=True)), where
            assert same(res_a, res_b), where
            assert repr(ctl_a) == repr(ctl_b), where
            for key in ("threshold", "partition", "own_partition", "counts", "selected", "density_actual"):
                assert repr(st_a.get(key)) == repr(st_b.get(key)), (where, key)


CONFIGS = [
    ("exdyna-paper", ExDyna(0.01), 4),
    ("exdyna-tracking", ExDyna(0.01, threshold_scaling="tracking"), 4),
    ("exdyna-histogram", ExDyna(0.01, threshold_scaling="tracking", rebalance="histogram"), 3),
    ("exdyna-neighbour", ExDyna(0.01, rebalance="neighbour"), 4),
    ("micro", MiCRO(0.01), 4),
    ("micro-tracking", MiCRO(0.002, threshold_scaling="tracking"), 2),
    ("exdyna-local-start", ExDyna(0.01, threshold_scaling="tracking", threshold_start="local"), 3),
    ("micro-local-start", MiCRO(0.01, threshold_start="local"), 2),
    ("threshold-gather", Threshold(0.01), 3),
    ("threshold-union", Threshold(0.01, pattern="union"), 2),
]


@needs_kernels
@pytest.mark.parametrize("name,algorithm,size", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("write_into_inputs", [True, False])
@pytest.mark.parametrize("dtypes", ["mixed", "fp32"])   # fp32 + writing into inputs: the check in the pass
def test_engine_decisions_identical_with_kernels_on_and_off(name, algorithm, size, write_into_inputs, dtypes,
                                                            reference, monkeypatch):
    # Tracking's probes sample 1/8 of the partition once k >= 1024 N: one bucket large enough.
    sizes = [300_000, 2_000, 777] if "tracking" in name or "local" in name else [20_000, 2_000, 777]
    grads = gradients(5, sizes, [torch.float32, torch.float16, torch.bfloat16] if dtypes == "mixed"
                      else [torch.float32] * 3)
    steps = 14
    ops, fused = cpu_ops(), []
    kernel = ops.accumulate_select_if_finite
    monkeypatch.setattr(ops, "accumulate_select_if_finite", lambda *a: fused.append(kernel(*a)) or fused[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # the non-finite step warns
        on = run_steps(algorithm, size, steps, grads, write_into_inputs)
        ran = len(fused)
        off = reference(run_steps, algorithm, size, steps, grads, write_into_inputs)
    # every rank-step ran the fused kernel (the local start, which accumulates, then selects by
    # magnitude, too: its accumulation is the fused op over an empty range), none with kernels
    # off; one rank's step 7 was not finite
    assert ran == len(fused) == steps * size and all(f is not None for f in fused)
    assert [f.finite for f in fused].count(False) == 1
    assert_identical(on, off)


PLAIN = [
    ("topk", TopK(0.01), 3),
    ("topk-momentum", TopK(0.01, momentum=0.9), 2),
    ("lags", LAGS(0.01), 2),
    ("dgc", DGC(0.01), 2),
    ("topk-dense-steps", TopK(0.01, dense_steps=3), 2),
]


@pytest.mark.parametrize("name,algorithm,size", PLAIN, ids=[c[0] for c in PLAIN])
def test_plain_accumulation_into_inputs_is_the_same_step(name, algorithm, size, reference):
    # Writing into the inputs, a method that accumulates plainly runs a = g + e, the finite check and
    # the clearing of the inputs as one op (engine._accumulate), and the reconstruction then writes
    # only the average's entries: the same tensors, residuals and decisions as without, the
    # non-finite step of rank 1 included, kernels on and off.
    grads = gradients(7, [20_000, 2_000, 777], [torch.float32, torch.float16, torch.float32])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # the non-finite step warns
        into = run_steps(algorithm, size, 10, grads, True)
        fresh = run_steps(algorithm, size, 10, grads, False)
        off = reference(run_steps, algorithm, size, 10, grads, True)
    assert_identical(into, fresh)
    assert_identical(into, off)
    engine = Engine(copy.deepcopy(algorithm), TB, 0, 1, write_into_inputs=True)
    inputs = grads(0, 0)
    LocalGroup(1, TB).run([engine.step("model", inputs)])
    assert engine.stats()["accumulate_seconds"] > 0


@needs_kernels
def test_engine_fp64_bucket_and_raise_policy_identical(reference):
    grads = gradients(6, [5_000, 3_000], [torch.float64, torch.float32])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        tracking = ExDyna(0.02, threshold_scaling="tracking")
        on = run_steps(tracking, 2, 6, grads, True, nonfinite="ignore")
        off = reference(run_steps, ExDyna(0.02, threshold_scaling="tracking"), 2, 6, grads, True,
                        nonfinite="ignore")
    for a, b in zip(on, off, strict=True):
        for (_, res_a, ctl_a, _), (_, res_b, ctl_b, _) in zip(a, b, strict=True):
            assert torch.equal(res_a.isnan(), res_b.isnan())
            assert torch.equal(torch.nan_to_num(res_a), torch.nan_to_num(res_b))
            assert repr(ctl_a) == repr(ctl_b)


def test_nonfinite_rank_keeps_its_residual_and_returns_zeroed_inputs_before_the_scatter():
    size = 2
    engines = [Engine(ExDyna(0.05), TB, r, size, write_into_inputs=True) for r in range(size)]
    group = LocalGroup(size, TB)
    grads = gradients(8, [4_000], [torch.float32])
    group.run([e.step("model", [g.clone() for g in grads(0, r)]) for r, e in enumerate(engines)])
    before = engines[1].buckets["model"].residual.clone()
    inputs = [[g.clone() for g in grads(7, r)] for r in range(size)]   # rank 1: a NaN at step 7
    with pytest.warns(RuntimeWarning, match="non-finite"):
        outs = group.run([e.step("model", inputs[r]) for r, e in enumerate(engines)])
    assert same(engines[1].buckets["model"].residual, before)
    assert bool(torch.isfinite(outs[1][0]).all())    # the NaN input was overwritten by the average


# --- the switch and the fallback ---------------------------------------------------------------------
def test_switch_from_python_and_invalid_values():
    previous = kernels.mode()
    try:
        hvd_sparse.set_kernels("off")
        assert hvd_sparse.kernels_mode() == "off" and kernels.ops_for(torch.zeros(1)) is None
        hvd_sparse.set_kernels("auto")
        assert kernels.mode() == "auto"
        with pytest.raises(ConfigurationError, match="auto"):
            hvd_sparse.set_kernels("on")
        assert kernels.ops_for(np.zeros(1)) is None          # no op module for NumPy arrays
    finally:
        kernels.set_mode(previous)


@pytest.mark.parametrize("value,expected", [("off", "off"), ("auto", "auto"), ("", "auto"), ("OFF", "off")])
def test_environment_variable_sets_the_initial_mode(value, expected):
    code = "import hvd_sparse.kernels as k; print(k.mode())"
    out = subprocess.run([sys.executable, "-c", code], env={"HVD_SPARSE_KERNELS": value, "PATH": ""},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected


def test_environment_variable_with_an_unknown_value_fails_naming_it():
    out = subprocess.run([sys.executable, "-c", "import hvd_sparse.kernels"],
                         env={"HVD_SPARSE_KERNELS": "fast"}, capture_output=True, text=True)
    assert out.returncode != 0 and "HVD_SPARSE_KERNELS" in out.stderr and "fast" in out.stderr


def test_a_library_that_cannot_load_warns_once_and_the_reference_path_runs(monkeypatch, tmp_path):
    from hvd_sparse.kernels.cpu import _library
    previous = kernels.mode()
    kernels.set_mode("auto")
    broken = tmp_path / "_native.so"
    broken.write_text("not a shared library")
    monkeypatch.setattr(_library, "_library", None)
    monkeypatch.setattr(_library, "library_path", lambda stem=_library.STEM: broken)
    monkeypatch.setattr(_library, "HERE", tmp_path)          # no sources newer than it here
    for module in [m for m in sys.modules if m.startswith("hvd_sparse.kernels.cpu.")
                   and m != "hvd_sparse.kernels.cpu._library"] + ["hvd_sparse.kernels.cpu"]:
        monkeypatch.delitem(sys.modules, module, raising=False)
    kernels._forget()
    try:
        with pytest.warns(RuntimeWarning, match=r"cpu kernels cannot be used \(cannot load .*_native.so"):
            assert kernels.ops_for(torch.zeros(1)) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")                    # once per cause: no second warning
            assert kernels.ops_for(torch.zeros(1)) is None
            residual = TB.accumulate(torch.zeros(3), [torch.ones(3)])
        assert residual.tolist() == [1.0, 1.0, 1.0]
    finally:
        kernels.set_mode(previous)
        kernels._forget()


def test_a_missing_or_stale_library_names_the_fix(monkeypatch, tmp_path):
    from hvd_sparse.kernels import KernelUnavailable
    from hvd_sparse.kernels.cpu import _library
    monkeypatch.setattr(_library, "_library", None)
    monkeypatch.setattr(_library, "library_path", lambda stem=_library.STEM: None)
    with pytest.raises(KernelUnavailable, match="was not built: rebuild it with `make install`"):
        _library.library()
    built = tmp_path / "_native.so"
    built.write_text("")
    (tmp_path / "new.cpp").write_text("")
    os.utime(built, (1, 1))
    monkeypatch.setattr(_library, "library_path", lambda stem=_library.STEM: built)
    monkeypatch.setattr(_library, "HERE", tmp_path)
    with pytest.raises(KernelUnavailable, match=r"older than new\.cpp"):
        _library.library()
