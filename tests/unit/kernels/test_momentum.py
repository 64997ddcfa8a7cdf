"""The fused accumulate-and-select with the momentum correction (``momentum_accumulate_select``,
hvd_sparse/kernels/cpu/accumulate.cpp) against the reference path bit for bit -- the residual, the velocity
u, the indices, the probe counts, the finite verdict and the inputs -- standard and Nesterov, fp32
and fp64 residuals, every input dtype; and ExDyna, MiCRO and the hard threshold with
``momentum=0.9`` through the engine with kernels on and off: identical outputs, residuals, u,
control state and statistics. (The Triton version: triton_cases.py.)"""

from __future__ import annotations

import copy
import sys
import warnings

import numpy as np
import pytest
import torch

from hvd_sparse.algorithms import ExDyna, MiCRO, Threshold
from hvd_sparse.backends import get_backend
from hvd_sparse.backends.base import Momentum
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine
from tests.unit.kernels.test_cpu import cpu_ops, gradients, kinds, needs_kernels, same
from tests.unit.kernels.test_topk import reference

TB = get_backend("torch")
FACTOR = 0.9


def reference_op(residual, u, tensors, nesterov, lo, hi, threshold, probes, every, clear, check):
    """(finite, residual, u, idx, counts) of ``Backend.accumulate_select`` with the momentum
    correction, kernels off; the arguments are left as they were (the op runs on copies)."""
    momentum = Momentum(u.clone(), FACTOR, nesterov)
    acc, idx, counts, finite = reference(TB.accumulate_select, residual.clone(), tensors, lo, hi, threshold,
                                         probes, every, "int64", clear, check, momentum)
    return finite, acc, momentum.buffer, idx, counts


def clones(tensors):
    return [t.clone(memory_format=torch.preserve_format) for t in tensors]


def check_op(ops, residual, u, inputs, nesterov, lo, hi, threshold, probes, every, clear, check,
             index_dtype, where):
    want_inputs, got_inputs = clones(inputs), clones(inputs)
    finite, acc, velocity, idx, counts = reference_op(residual, u, want_inputs, nesterov, lo, hi,
                                                      threshold, probes, every, clear, check)
    got_residual, got_u = residual.clone(), u.clone()
    done = ops.momentum_accumulate_select(got_residual, got_u, got_inputs, FACTOR, nesterov, lo, hi,
                                          threshold, probes, every, index_dtype, clear, check)
    assert done is not None, where
    _, got_idx, got_counts, got_finite = done
    assert got_finite is finite, where
    assert same(got_residual, acc) and same(got_u, velocity), where
    if finite:
        assert got_idx.dtype == index_dtype and torch.equal(got_idx.long(), idx), where
        assert got_counts == counts, where
    else:   # nothing written, inputs included
        assert got_idx is None and got_counts == [], where
        assert same(got_residual, residual) and same(got_u, u), where
    for a, b in zip(got_inputs, want_inputs, strict=True):
        assert a.stride() == b.stride() and same(a, b), where   # cleared, or not, alike


def start(n, dtype, seed, signed_zeros=False):
    """A residual and a velocity of n entries (with -0 and +0 among them when asked)."""
    g = torch.Generator().manual_seed(seed)
    e = (torch.randn(n, generator=g, dtype=torch.float64) * 0.3).to(dtype)
    u = (torch.randn(n, generator=g, dtype=torch.float64) * 0.2).to(dtype)
    if signed_zeros:
        e[::3], u[1::3] = -0.0, -0.0
        e[1::5], u[::5] = 0.0, 0.0
    return e, u


@needs_kernels
@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("inputs", ["same", "mixed"])
@pytest.mark.parametrize("nesterov", [False, True], ids=["standard", "nesterov"])
@pytest.mark.parametrize("check", [False, True], ids=["nocheck", "check"])
def test_fused_momentum_matches_the_reference(residual_dtype, inputs, nesterov, check):
    """Random, heavy-tailed, tied, zero and non-finite gradients; the full range, inner ranges and
    edges; thresholds that tie, round, or pass everything; probes on the whole range and on the
    sampled rows; inputs cleared or kept; int32 and int64 indices."""
    ops = cpu_ops()
    n = 20_000
    for name, x in kinds(n, 11).items():
        if inputs == "same":   # several tensors of the residual's dtype, one non-contiguous, one empty
            tensors = [x[:7000].to(residual_dtype), x[7000:17000].to(residual_dtype).view(100, 100).t(),
                       torch.zeros(0, dtype=residual_dtype), x[17000:].to(residual_dtype)]
        else:                  # every float dtype into the residual
            tensors = [x[:5000].half(), x[5000:9000].bfloat16().view(40, 100).t(), x[9000:15000].float(),
                       x[15000:].double()]
        residual, u = start(n, residual_dtype, 12, signed_zeros=name in ("tied", "zero"))
        if name == "tied":   # keep the ties in the accumulated vector
            residual.zero_()
            u.zero_()
        cases = [((0, n), 0.1, [0.05, 0.3], 1, torch.int32, True),
                 ((7, n - 3), 0.25, [0.05, 0.3, 0.25], 8, torch.int64, False),
                 ((n // 4, n // 2), 0.0, [], 1, torch.int32, True),
                 ((n - 1, n), float("inf"), [1.0], 1, torch.int64, True),
                 ((5, 5), 1.7, [], 1, torch.int64, False)]
        for (lo, hi), threshold, probes, every, index_dtype, clear in cases:
            where = f"{name} {residual_dtype} {inputs} nesterov={nesterov} [{lo}, {hi}) T={threshold}"
            check_op(ops, residual, u, tensors, nesterov, lo, hi, threshold, probes, every, clear,
                     check, index_dtype, where)


@needs_kernels
@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("input_dtype", ["same", torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nesterov", [False, True], ids=["standard", "nesterov"])
@pytest.mark.parametrize("clear", [False, True], ids=["keep", "clear"])
@pytest.mark.parametrize("where", ["first entry", "small tensor", "mid-chunk", "last entry"])
def test_a_non_finite_input_leaves_residual_and_velocity_untouched(residual_dtype, input_dtype, nesterov,
                                                                     clear, where):
    """A NaN or ±Inf anywhere -- the first entry, inside a tensor smaller than a chunk, in the middle
    of a chunk, the last entry: residual, u and inputs keep their bits; finite is False."""
    ops = cpu_ops()
    dtype = residual_dtype if input_dtype == "same" else input_dtype
    sizes = [3000, 5, 70_000]          # several chunks, and a tensor inside one chunk
    g = torch.Generator().manual_seed(13)
    inputs = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in sizes]
    spots = {"first entry": (0, 0, float("nan")), "small tensor": (1, 3, float("inf")),
             "mid-chunk": (2, 40_000, float("-inf")), "last entry": (2, 69_999, float("nan"))}
    tensor, index, value = spots[where]
    inputs[tensor][index] = value
    residual, u = start(sum(sizes), residual_dtype, 14, signed_zeros=True)
    check_op(ops, residual, u, inputs, nesterov, 1000, 60_000, 1.0, [0.5, 2.0], 1, clear, True,
             torch.int32, f"{where} {dtype}")


@needs_kernels
@pytest.mark.parametrize("nesterov", [False, True], ids=["standard", "nesterov"])
def test_signed_zeros_and_rounding_follow_the_reference(nesterov):
    """g = 0 + input turns -0 into +0 before the velocity sees it; an fp64 input rounds once into
    an fp32 residual; tiny and huge values (underflow, overflow to Inf from finite inputs)."""
    ops = cpu_ops()
    values = [0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38, 1.0 + 2.0**-24, -(2.0**-25), 2.0**-24 + 2.0**-50]
    g64 = torch.tensor(values * 3, dtype=torch.float64)
    e = torch.tensor([-0.0, 0.0, -0.0, 1e-45, 3e38, 3e38, 1.0, 1.0, 1.0] * 3, dtype=torch.float32)
    u = torch.tensor([-0.0] * 9 + [0.0] * 9 + [-1e-45, 3e38, 1.0, -0.0, -3e38, 2.0, 0.5, 0.25, -0.0])
    for inputs in ([g64], [g64.float()], [g64.half()], [g64[:4], g64[4:].float()]):
        for check in (False, True):
            check_op(ops, e, u, inputs, nesterov, 0, 27, 1.0, [0.5, 3e38], 1, True, check,
                     torch.int64, f"{[t.dtype for t in inputs]} check={check}")


@needs_kernels
def test_fused_momentum_declines_what_it_does_not_handle():
    ops = cpu_ops()
    e, u, g = torch.zeros(8), torch.zeros(8), [torch.ones(8)]
    args = (0.9, False, 0, 8, 0.5, [], 1, torch.int64, False, True)
    assert ops.momentum_accumulate_select(e, u, g, *args).finite is True
    assert ops.momentum_accumulate_select(e, u.double(), g, *args) is None          # u of another dtype
    assert ops.momentum_accumulate_select(e, torch.zeros(9), g, *args) is None      # u of another size
    assert ops.momentum_accumulate_select(e, torch.zeros(16)[::2], g, *args) is None  # u not contiguous
    assert ops.momentum_accumulate_select(e.half(), u.half(), g, *args) is None      # an fp16 residual
    assert ops.momentum_accumulate_select(e, u, [torch.ones(8, dtype=torch.int32)], *args) is None
    assert ops.momentum_accumulate_select(e, u, g, 0.9, False, 0, 9, 0.5, [], 1, torch.int64, False,
                                          True) is None                              # range beyond
    assert ops.momentum_accumulate_select(e, u, g, 0.9, False, 0, 8, 0.5, [0.1] * 9, 1, torch.int64, False,
                                          True) is None                              # too many probes


@needs_kernels
def test_the_backend_runs_the_fused_op_when_momentum_is_given(monkeypatch):
    """TorchBackend.accumulate_select hands the momentum to the kernel, whose velocity it updates
    in place; the momentum_accumulate pass of the reference path does not run."""
    ops = cpu_ops()
    accumulate = sys.modules["hvd_sparse.kernels.cpu.accumulate"]
    calls = []
    kernel = accumulate.momentum_accumulate_select
    monkeypatch.setattr(ops, "momentum_accumulate_select", lambda *a: calls.append(a) or kernel(*a))
    monkeypatch.setattr(ops, "momentum_accumulate", lambda *a: pytest.fail("the two-pass path ran"))
    e, u = start(5000, torch.float32, 15)
    buffer = u.clone()
    momentum = Momentum(buffer, FACTOR, True)
    acc, idx, counts, finite = TB.accumulate_select(e.clone(), [torch.randn(5000)], 0, 5000, 0.5, [0.25], 1,
                                                    "int32", True, True, momentum)
    assert len(calls) == 1 and finite and momentum.buffer is buffer and not same(buffer, u)
    assert idx.dtype == torch.int32 and len(counts) == 1
    bad = torch.randn(5000)
    bad[4999] = float("nan")
    kept = buffer.clone()
    acc, idx, counts, finite = TB.accumulate_select(acc, [bad], 0, 5000, 0.5, [0.25], 1, "int32", True, True,
                                                    momentum)
    assert not finite and idx is None and counts == [] and same(momentum.buffer, kept)


# --- the engine, kernels on and off -----------------------------------------------------------------
def run_steps(algorithm, size, steps, grads_at, write_into_inputs, nonfinite="skip"):
    """Every rank's returned tensors, residual, velocity and control state after each step."""
    engines = [Engine(copy.deepcopy(algorithm), TB, r, size, nonfinite=nonfinite,
                      write_into_inputs=write_into_inputs) for r in range(size)]
    group, history = LocalGroup(size, TB), []
    for step in range(steps):
        inputs = [[t.clone() for t in grads_at(step, r)] for r in range(size)]
        outs = group.run([e.step("model", inputs[r]) for r, e in enumerate(engines)])
        history.append([([o.clone() for o in out], e.buckets["model"].residual.clone(),
                          e.buckets["model"].momentum.clone(),
                          copy.deepcopy(e.algorithm.control_state(e.buckets["model"].control)),
                          e.stats()) for out, e in zip(outs, engines, strict=True)])
    return history


CONFIGS = [
    ("exdyna-tracking", ExDyna(0.01, threshold_scaling="tracking", momentum=0.9), 4),
    ("exdyna-local-start",
     ExDyna(0.01, threshold_scaling="tracking", threshold_start="local", momentum=0.9), 3),
    ("exdyna-paper-nesterov", ExDyna(0.01, momentum=0.9, nesterov=True), 4),
    ("micro", MiCRO(0.01, momentum=0.9), 4),
    ("micro-tracking-nesterov", MiCRO(0.002, threshold_scaling="tracking", momentum=0.9, nesterov=True), 2),
    ("micro-local-start", MiCRO(0.01, threshold_start="local", momentum=0.9), 2),
    ("threshold-union", Threshold(0.01, pattern="union", momentum=0.9), 2),
]


@needs_kernels
@pytest.mark.parametrize("name,algorithm,size", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("write_into_inputs", [True, False])
@pytest.mark.parametrize("dtypes", ["mixed", "fp32"])
def test_engine_with_momentum_identical_with_kernels_on_and_off(name, algorithm, size, write_into_inputs,
                                                                dtypes, monkeypatch):
    sizes = [300_000, 2_000, 777] if "tracking" in name or "local" in name else [20_000, 2_000, 777]
    grads = gradients(7, sizes, [torch.float32, torch.float16, torch.bfloat16] if dtypes == "mixed"
                      else [torch.float32] * 3)
    steps = 12
    ops, fused = cpu_ops(), []
    kernel = ops.momentum_accumulate_select
    monkeypatch.setattr(ops, "momentum_accumulate_select", lambda *a: fused.append(kernel(*a)) or fused[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # the non-finite step warns
        on = run_steps(algorithm, size, steps, grads, write_into_inputs)
        ran = len(fused)
        off = reference(run_steps, algorithm, size, steps, grads, write_into_inputs)
    # every rank-step ran the fused kernel (the local start's first step, which accumulates, then
    # selects by magnitude, too: its accumulation is the fused op over an empty range), none with
    # kernels off; one rank's step 7 was not finite
    assert ran == len(fused) == steps * size and all(f is not None for f in fused)
    assert [f.finite for f in fused].count(False) == 1
    for step, (ranks_on, ranks_off) in enumerate(zip(on, off, strict=True)):
        for rank, (a, b) in enumerate(zip(ranks_on, ranks_off, strict=True)):
            where = f"step {step} rank {rank}"
            (out_a, res_a, u_a, ctl_a, st_a), (out_b, res_b, u_b, ctl_b, st_b) = a, b
            assert all(same(x, y) for x, y in zip(out_a, out_b, strict=True)), where
            assert same(res_a, res_b) and same(u_a, u_b), where
            assert repr(ctl_a) == repr(ctl_b), where
            for key in ("threshold", "partition", "own_partition", "counts", "selected", "density_actual"):
                assert repr(st_a.get(key)) == repr(st_b.get(key)), (where, key)


@needs_kernels
@pytest.mark.parametrize("nonfinite", ["raise", "ignore"])
def test_engine_with_momentum_identical_under_the_other_nonfinite_policies(nonfinite):
    """``raise`` (every rank raises at the non-finite step and takes it back, u included) and
    ``ignore`` (no check: NaN enters the residual and u), fp64 bucket with an fp32 tensor."""
    grads = gradients(8, [30_000, 3_000], [torch.float64, torch.float32])
    algorithm = ExDyna(0.02, threshold_scaling="tracking", momentum=0.9, nesterov=True)

    def run(steps):
        engines = [Engine(copy.deepcopy(algorithm), TB, r, 2, nonfinite=nonfinite, write_into_inputs=True)
                   for r in range(2)]
        group, history = LocalGroup(2, TB), []
        for step in range(steps):
            inputs = [[t.clone() for t in grads(step, r)] for r in range(2)]
            try:
                group.run([e.step("model", inputs[r]) for r, e in enumerate(engines)])
                raised = False
            except FloatingPointError:
                raised = True
            history.append((raised, [(e.buckets["model"].residual.clone(),
                                      e.buckets["model"].momentum.clone()) for e in engines]))
        return history

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        on, off = run(9), reference(run, 9)
    assert [raised for raised, _ in on] == [raised for raised, _ in off]
    assert any(raised for raised, _ in on) is (nonfinite == "raise")
    for (_, a), (_, b) in zip(on, off, strict=True):
        for (res_a, u_a), (res_b, u_b) in zip(a, b, strict=True):
            for x, y in ((res_a, res_b), (u_a, u_b)):
                assert torch.equal(x.isnan(), y.isnan())
                assert same(torch.nan_to_num(x), torch.nan_to_num(y))


def test_reference_path_selects_from_the_momentum_corrected_vector():
    """Kernels or not, what the op returns is what the definition says (NumPy, written out)."""
    rng = np.random.default_rng(16)
    e, u = rng.standard_normal(1000).astype(np.float32), rng.standard_normal(1000).astype(np.float32)
    g = rng.standard_normal(1000).astype(np.float32)
    for nesterov in (False, True):
        m = np.float32(FACTOR)
        u_new = m * (u + g) if nesterov else m * u + g
        acc = (e + u_new) + g if nesterov else e + u_new
        momentum = Momentum(torch.from_numpy(u.copy()), FACTOR, nesterov)
        got, idx, _, finite = TB.accumulate_select(torch.from_numpy(e.copy()), [torch.from_numpy(g.copy())],
                                                   100, 900, 1.0, momentum=momentum, check_finite=True)
        assert finite
        np.testing.assert_array_equal(got.numpy(), acc)
        np.testing.assert_array_equal(momentum.buffer.numpy(), u_new)
        np.testing.assert_array_equal(idx.numpy(), np.flatnonzero(np.abs(acc[100:900]) >= 1.0) + 100)
