"""The Adam path's kernels against the reference path bit for bit: the fused accumulate-and-select
(``adam_accumulate_select``, hvd_sparse/kernels/cpu/accumulate.cpp: residual, moments u and v, indices,
probe counts, finite verdict, inputs), the accumulation alone (``adam_accumulate``) and the dense steps'
update (``adam_update``, hvd_sparse/kernels/cpu/adam.cpp); and every method on the Adam path through the
engine with kernels on and off: identical outputs, residuals, moments, control state and
statistics. (The Triton versions: triton_cases.py.)"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

from hvd_sparse.algorithms import METHODS, AdamPath
from hvd_sparse.backends import get_backend
from hvd_sparse.backends.base import Momentum, SecondMoment
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine
from hvd_sparse.engine.planning import plan_buckets
from tests.unit.kernels.test_cpu import cpu_ops, gradients, kinds, needs_kernels, same
from tests.unit.kernels.test_momentum import clones, start
from tests.unit.kernels.test_topk import reference

TB = get_backend("torch")
B1, B2, C1, C2, EPS, BOUND = 0.9, 0.999, 1.0526315789473684, 3.7, 1e-8, 300.0


def second_moment(n, dtype, seed):
    """A v: positive, spread over magnitudes, with zeros (where eps alone divides)."""
    g = torch.Generator().manual_seed(seed)
    v = (torch.randn(n, generator=g, dtype=torch.float64) * 1e-3) ** 2
    v[::11] = 0.0
    return v.to(dtype)


def moment(v, frozen=False):
    """The sparse steps' second moment around ``v`` (updated in place by the ops, unless
    ``frozen``: shared by the ranks, only read)."""
    return SecondMoment(v, B2, C1, C2, EPS, BOUND, frozen=frozen)


def reference_op(residual, u, v, tensors, lo, hi, threshold, probes, every, clear, check, frozen=False):
    """(finite, residual, u, v, idx, counts) of ``Backend.accumulate_select`` on the Adam path,
    kernels off, on copies."""
    momentum = Momentum(u.clone(), B1, second=moment(v.clone(), frozen))
    acc, idx, counts, finite = reference(TB.accumulate_select, residual.clone(), tensors, lo, hi, threshold,
                                         probes, every, "int64", clear, check, momentum)
    return finite, acc, momentum.buffer, momentum.second.buffer, idx, counts


def check_op(ops, residual, u, v, inputs, lo, hi, threshold, probes, every, clear, check, index_dtype, where,
             frozen=False):
    want_inputs, got_inputs = clones(inputs), clones(inputs)
    finite, acc, velocity, second, idx, counts = reference_op(residual, u, v, want_inputs, lo, hi, threshold,
                                                              probes, every, clear, check, frozen)
    assert not frozen or same(second, v), where
    got_residual, got_u, got_v = residual.clone(), u.clone(), v.clone()
    done = ops.adam_accumulate_select(got_residual, got_u, got_inputs, B1, moment(got_v, frozen), lo, hi,
                                      threshold, probes, every, index_dtype, clear, check)
    assert done is not None, where
    _, got_idx, got_counts, got_finite = done
    assert got_finite is finite, where
    assert same(got_residual, acc) and same(got_u, velocity) and same(got_v, second), where
    if finite:
        assert got_idx.dtype == index_dtype and torch.equal(got_idx.long(), idx), where
        assert got_counts == counts, where
    else:
        assert got_idx is None and got_counts == [], where
        assert same(got_residual, residual) and same(got_u, u) and same(got_v, v), where
    for a, b in zip(got_inputs, want_inputs, strict=True):
        assert a.stride() == b.stride() and same(a, b), where


@needs_kernels
@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("inputs", ["same", "mixed"])
@pytest.mark.parametrize("check", [False, True], ids=["nocheck", "check"])
@pytest.mark.parametrize("frozen", [False, True], ids=["own-v", "shared-v"])
def test_fused_adam_accumulation_matches_the_reference(residual_dtype, inputs, check, frozen):
    ops = cpu_ops()
    n = 20_000
    v = second_moment(n, residual_dtype, 3)
    for name, x in kinds(n, 21).items():
        if inputs == "same":
            tensors = [x[:7000].to(residual_dtype), x[7000:17000].to(residual_dtype).view(100, 100).t(),
                       torch.zeros(0, dtype=residual_dtype), x[17000:].to(residual_dtype)]
        else:
            tensors = [x[:5000].half(), x[5000:9000].bfloat16().view(40, 100).t(), x[9000:15000].float(),
                       x[15000:].double()]
        residual, u = start(n, residual_dtype, 22, signed_zeros=name in ("tied", "zero"))
        cases = [((0, n), 30.0, [5.0, 100.0], 1, torch.int32, True),
                 ((7, n - 3), 250.0, [50.0, 300.0, 250.0], 8, torch.int64, False),
                 ((n // 4, n // 2), 0.0, [], 1, torch.int32, True),
                 ((5, 5), 1.7, [], 1, torch.int64, False)]
        for (lo, hi), threshold, probes, every, index_dtype, clear in cases:
            where = f"{name} {residual_dtype} {inputs} [{lo}, {hi}) T={threshold}"
            check_op(ops, residual, u, v, tensors, lo, hi, threshold, probes, every, clear, check,
                     index_dtype, where, frozen)


@needs_kernels
@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.float64])
def test_accumulation_alone_and_the_dense_update_match_the_reference(residual_dtype):
    ops = cpu_ops()
    n = 12_345
    v = second_moment(n, residual_dtype, 4)
    for name, x in kinds(n, 23).items():
        tensors = [x[:345].half(), x[345:].to(residual_dtype)]
        residual, u = start(n, residual_dtype, 24)
        momentum = Momentum(u.clone(), B1, second=moment(v.clone()))
        want = reference(TB.accumulate, residual.clone(), clones(tensors), False, momentum)
        got_residual, got_u, got_v = residual.clone(), u.clone(), v.clone()
        done = ops.adam_accumulate(got_residual, got_u, clones(tensors), B1, moment(got_v))
        assert done is not None and same(done.acc, want) and same(got_u, momentum.buffer), name
        assert same(got_v, momentum.second.buffer), name
        average = x.to(residual_dtype)
        first, second = u.clone(), v.clone()
        want = reference(TB.adam_update, average.clone(), first.clone(), second.clone(), B1, 0.999, C1, C2,
                         EPS)
        got = ops.adam_update(average.clone(), first, second, B1, 0.999, C1, C2, EPS)
        assert got is not None and all(same(a, b) for a, b in zip(got, want, strict=True)), name


@needs_kernels
@pytest.mark.parametrize("where", ["first entry", "last entry"])
def test_a_non_finite_input_leaves_everything_untouched(where):
    ops = cpu_ops()
    inputs = [torch.randn(3000, dtype=torch.float64).float(), torch.randn(70_000).half()]
    tensor, index = (0, 0) if where == "first entry" else (1, 69_999)
    inputs[tensor][index] = float("nan")
    residual, u = start(73_000, torch.float32, 25, signed_zeros=True)
    check_op(ops, residual, u, second_moment(73_000, torch.float32, 5), inputs, 1000, 60_000, 10.0,
             [5.0], 1, True, True, torch.int32, where)


@needs_kernels
def test_the_kernels_decline_what_they_do_not_handle():
    ops = cpu_ops()
    e, u, v, g = torch.zeros(8), torch.zeros(8), torch.ones(8), [torch.ones(8)]
    args = (0, 8, 0.5, [], 1, torch.int64, False, True)
    assert ops.adam_accumulate_select(e, u, g, B1, moment(v), *args).finite is True
    assert ops.adam_accumulate_select(e, u, g, B1, moment(v.double()), *args) is None     # another dtype
    assert ops.adam_accumulate_select(e, u, g, B1, moment(torch.ones(9)), *args) is None  # another size
    assert ops.adam_accumulate_select(e, u, g, B1, moment(torch.ones(16)[::2]), *args) is None
    assert ops.adam_accumulate_select(e.half(), u.half(), g, B1, moment(v.half()), *args) is None
    assert ops.adam_update(e, u, v.double(), B1, 0.999, C1, C2, EPS) is None
    assert ops.adam_update(e.half(), u.half(), v.half(), B1, 0.999, C1, C2, EPS) is None


# --- the engine, kernels on and off -----------------------------------------------------------------
def run_steps(algorithm, size, steps, grads_at, nonfinite="skip"):
    """Every rank's outputs and bucket states (residual, m, v, control, stats) after each step."""
    engines = [Engine(copy.deepcopy(algorithm), TB, r, size, nonfinite=nonfinite, write_into_inputs=True)
               for r in range(size)]
    group = LocalGroup(size, TB)
    plan = plan_buckets(algorithm, [f"p{i}" for i in range(3)], [300_000, 2_000, 777])
    history = []
    for step in range(steps):
        inputs = [[t.clone() for t in grads_at(step, r)] for r in range(size)]
        record = []
        for bucket, members in plan:
            positions = [int(m[1:]) for m in members]
            outs = group.run([e.step(bucket, [inputs[r][i] for i in positions])
                              for r, e in enumerate(engines)])
            for out, e in zip(outs, engines, strict=True):
                state = e.buckets[bucket]
                record.append(([o.clone() for o in out], state.residual.clone(),
                               None if state.momentum is None else state.momentum.clone(),
                               None if state.second_moment is None else state.second_moment.clone(),
                               repr(e.algorithm.control_state(state.control)) if state.control else None))
        group.run([e.end_step(None) for e in engines])
        history.append(record)
    return history


OPTIONS = {"exdyna": {"threshold_scaling": "tracking"}, "micro": {"threshold_scaling": "tracking"},
           "lags": {"merge_threshold": 0}}


@needs_kernels
@pytest.mark.parametrize("name", [cls.name for cls in METHODS])
@pytest.mark.parametrize("refresh", [0, 2], ids=["own-v", "shared-v"])
def test_every_method_on_the_adam_path_is_identical_with_kernels_on_and_off(name, refresh):
    cls = next(c for c in METHODS if c.name == name)
    algorithm = cls(0.01, adam=AdamPath(), dense_steps=3, second_moment_refresh=refresh,
                    **OPTIONS.get(name, {}))
    grads = gradients(9, [300_000, 2_000, 777], [torch.float32, torch.float16, torch.float32])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # the non-finite step warns
        on = run_steps(algorithm, 2, 9, grads)
        off = reference(run_steps, algorithm, 2, 9, grads)
    for step, (a, b) in enumerate(zip(on, off, strict=True)):
        for (out_a, *state_a), (out_b, *state_b) in zip(a, b, strict=True):
            assert all(same(x, y) for x, y in zip(out_a, out_b, strict=True)), (name, step)
            for x, y in zip(state_a, state_b, strict=True):
                assert (x == y) if isinstance(x, str) or x is None else same(x, y), (name, step)


def test_the_reference_path_computes_the_definition():
    """Kernels or not, what the ops return is what the definition says (NumPy, written out)."""
    rng = np.random.default_rng(26)
    e, u, g = (rng.standard_normal(1000).astype(np.float32) for _ in range(3))
    v = (rng.standard_normal(1000) ** 2 * 1e-4).astype(np.float32)
    f = np.float32
    u_new = u * f(B1) + g * f(1 - B1)
    v_new = v * f(B2) + (g * g) * f(1 - B2)
    update = (u_new * f(C1)) / (np.sqrt(v_new * f(C2)) + f(EPS))
    acc = e + np.clip(update, -f(BOUND), f(BOUND))
    assert np.any(np.abs(update) > BOUND)   # the bound bites
    momentum = Momentum(torch.from_numpy(u.copy()), B1, second=moment(torch.from_numpy(v.copy())))
    got, idx, _, finite = TB.accumulate_select(torch.from_numpy(e.copy()), [torch.from_numpy(g.copy())], 100,
                                               900, 1.0, momentum=momentum, check_finite=True)
    assert finite
    np.testing.assert_array_equal(got.numpy(), acc)
    np.testing.assert_array_equal(momentum.buffer.numpy(), u_new)
    np.testing.assert_array_equal(momentum.second.buffer.numpy(), v_new)
    np.testing.assert_array_equal(idx.numpy(), np.flatnonzero(np.abs(acc[100:900]) >= 1.0) + 100)
