"""Cases for the Triton kernels (hvd_sparse.kernels.triton): the reference path's results, bit
for bit. Collected by tests/unit/kernels/test_triton.py, which runs them on CUDA tensors where a
GPU is present and otherwise in Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) in a
child pytest, since Triton must be imported with that variable set and it must stay set while
interpreted kernels run. Blocks are shrunk so that a few thousand elements span many blocks,
loop iterations and tensor borders.
"""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not INTERPRETED and not torch.cuda.is_available():
    raise RuntimeError("the Triton kernel cases need a CUDA GPU or TRITON_INTERPRET=1 set before "
                       "Triton is imported (tests/unit/kernels/test_triton.py sets it)")

import hvd_sparse.kernels.triton as kt  # noqa: E402
from hvd_sparse import kernels  # noqa: E402
from hvd_sparse.backends.torch_backend import TorchBackend  # noqa: E402
from hvd_sparse.kernels.triton import _common as common  # noqa: E402

DEVICE = "cpu" if INTERPRETED else "cuda"
MODULE = "hvd_sparse.kernels.triton"
REF = TorchBackend()
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
KINDS = ["random", "heavy", "equal", "zero", "nonfinite"]


@pytest.fixture(autouse=True)
def reference_without_kernels():
    """The reference (the torch backend) runs its own ops, not these kernels or the CPU ones."""
    previous = kernels.mode()
    kernels.set_mode("off")
    yield
    kernels.set_mode(previous)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """128 elements per block and at most 3 histogram programs: many blocks, several loop
    iterations per program, blocks that straddle tensor borders."""
    monkeypatch.setattr(common, "BLOCK", 128)
    monkeypatch.setattr(common, "HISTOGRAM_PROGRAMS", 3)


def values(kind: str, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    if kind == "random":
        x = rng.standard_normal(n)
    elif kind == "heavy":   # Student-t tails over 8 "layers" of very different scale
        x = rng.standard_t(2, n) * np.exp(3 * rng.standard_normal(8)).repeat(-(-n // 8))[:n]
    elif kind == "equal":   # one magnitude, both signs: every entry ties
        x = np.where(rng.random(n) < 0.5, -0.75, 0.75)
    elif kind == "zero":
        x = np.where(rng.random(n) < 0.5, -0.0, 0.0)
    elif kind == "nonfinite":
        x = rng.standard_normal(n)
        bad = min(n, max(n // 20, 3))
        x[rng.choice(n, size=bad, replace=False)] = rng.choice([np.nan, np.inf, -np.inf], size=bad)
    else:
        raise ValueError(kind)
    return torch.from_numpy(x).to(dtype).to(DEVICE)


def bucket(kind: str, seed: int, dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64)
           ) -> list[torch.Tensor]:
    """Gradients of every input dtype, one non-contiguous (a transpose) and one empty."""
    d16, b16, f32, f64 = dtypes
    return [values(kind, 63, d16, seed).reshape(7, 9),
            values(kind, 600, b16, seed + 1).reshape(30, 20).t(),
            values(kind, 0, f32, seed + 2),
            values(kind, 901, f32, seed + 3),
            values(kind, 1400, f64, seed + 4).reshape(2, 700)]


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that NaN payloads and -0 count in comparisons."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return x.contiguous().view(ints[x.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def clones(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies with the same strides (a transpose stays non-contiguous)."""
    return [t.clone(memory_format=torch.preserve_format) for t in tensors]


def residual_for(tensors, dtype, seed):
    return values("random", sum(t.numel() for t in tensors), dtype, seed)


# --- all_finite ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_all_finite(kind):
    tensors = bucket(kind, 1)
    expected = all(REF.all_finite(t) for t in tensors)
    assert expected == (kind != "nonfinite")
    assert kt.all_finite(tensors) is expected
    assert int(kt.finite_flag(tensors).item()) == (0 if expected else 1)


@pytest.mark.parametrize("dtype", FLOATS)
def test_all_finite_finds_one_bad_entry_anywhere(dtype):
    # in the first block, a later one, the last entry
    for where, special in ((0, float("nan")), (129, float("inf")), (299, float("-inf"))):
        grid = values("random", 300, dtype, 1).reshape(20, 15)
        grid.view(-1)[where] = special
        tensors = [values("random", 40, dtype, 0), grid.t()]   # the second non-contiguous
        assert not REF.all_finite(grid)
        assert kt.all_finite(tensors) is False
        assert int(kt.finite_flag(tensors).item()) == 1
    assert kt.all_finite([values("random", 5, dtype, 2)]) is True
    assert kt.all_finite([]) is True


# --- accumulate ------------------------------------------------------------------------------------
@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["random", "heavy", "nonfinite"])
@pytest.mark.parametrize("clear_inputs", [False, True])
def test_accumulate(residual_dtype, kind, clear_inputs):
    tensors = bucket(kind, 3)
    residual = residual_for(tensors, residual_dtype, 4)
    expected = REF.accumulate(residual.clone(), clones(tensors))
    inputs = clones(tensors)
    assert kt.accumulate(residual, inputs, clear_inputs) is residual
    assert same_bits(residual, expected)
    for before, after in zip(tensors, inputs, strict=True):
        assert after.stride() == before.stride()
        assert same_bits(after, torch.zeros_like(before) if clear_inputs else before)


def test_accumulate_rounds_fp64_inputs_once_into_fp32():
    """fp64 gradient into an fp32 residual: torch adds in fp64 and rounds once."""
    g = torch.tensor([1.0, 2.0**-24 + 2.0**-50, -(2.0**-25)], dtype=torch.float64, device=DEVICE)
    residual = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float32, device=DEVICE)
    expected = REF.accumulate(residual.clone(), [g])
    kt.accumulate(residual, [g.clone()], False)
    assert same_bits(residual, expected)
    assert residual[1].item() == 1.0 + 2.0**-23   # a double rounding would give 1.0


@pytest.mark.parametrize("clear_inputs", [False, True])
def test_accumulate_if_finite(clear_inputs):
    for kind in ("random", "nonfinite"):
        tensors = bucket(kind, 5)
        residual = residual_for(tensors, torch.float32, 6)
        before = residual.clone()
        inputs = clones(tensors)
        flag = kt.accumulate_if_finite(residual, inputs, clear_inputs)
        if kind == "random":
            assert int(flag.item()) == 0
            assert same_bits(residual, REF.accumulate(before.clone(), clones(tensors)))
            for t, x in zip(tensors, inputs, strict=True):
                assert same_bits(x, torch.zeros_like(t) if clear_inputs else t)
        else:   # nothing written: residual and inputs as they were
            assert int(flag.item()) == 1
            assert same_bits(residual, before)
            for t, x in zip(tensors, inputs, strict=True):
                assert same_bits(x, t)


# --- accumulate_select -----------------------------------------------------------------------------
def reference_select(residual, tensors, lo, hi, threshold, probes, every, index_dtype):
    a = REF.accumulate(residual.clone(), clones(tensors))
    magnitude = REF.abs(a[lo:hi])
    idx = REF.indices_where_at_least(magnitude, threshold, offset=lo).to(index_dtype)
    # An empty range has no entry at any probe (the torch backend divides 0 by 0 there; the
    # NumPy backend says 0.0).
    counts = REF.count_at_least(magnitude, probes, every) if hi > lo else [0.0] * len(probes)
    return a, idx, counts


RANGES = {"full": (0, None), "empty": (700, 700), "inner": (131, 2300), "tail": (2000, None),
          "one": (1000, 1001)}


SELECT_CASES = (  # every kind on the full and an inner range, the edge ranges on a few
    [(kind, span) for kind in KINDS for span in ("full", "inner")]
    + [("random", "empty"), ("equal", "empty"), ("random", "tail"), ("nonfinite", "tail"),
       ("heavy", "one"), ("zero", "one")])


@pytest.mark.parametrize("kind, span", SELECT_CASES)
@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.float64])
def test_accumulate_select(kind, residual_dtype, span):
    tensors = bucket(kind, 7)
    residual = residual_for(tensors, residual_dtype, 8)
    if kind in ("equal", "zero"):   # keep the ties and the signed zeros in a = e + g
        residual.zero_()
    n = residual.numel()
    lo, hi = RANGES[span]
    hi = n if hi is None else hi
    index_dtype = torch.int32 if span in ("full", "empty", "one") else torch.int64
    clear_inputs = span != "inner"
    threshold = 0.75 if kind == "equal" else 1.3
    probes = [threshold / 2, threshold * 2]
    expected, expected_idx, expected_counts = reference_select(
        residual, tensors, lo, hi, threshold, probes, 1, index_dtype)
    inputs = clones(tensors)
    _, idx, counts, _ = kt.accumulate_select(residual, inputs, lo, hi, threshold, probes, 1,
                                       index_dtype, clear_inputs)
    assert same_bits(residual, expected)
    assert idx.dtype == index_dtype and torch.equal(idx, expected_idx)
    assert counts == expected_counts
    if kind == "equal" and hi > lo:
        assert idx.numel() == hi - lo   # every tie passes a threshold equal to the magnitude
    for t, x in zip(tensors, inputs, strict=True):
        assert same_bits(x, torch.zeros_like(t) if clear_inputs else t)


@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threshold", [0.0, -1.0, -0.0, float("inf"), float("nan"), 1e39,
                                       1.0 + 2.0**-24, 1.0 + 2.0**-23, 5e-324, 1e-45])
def test_select_thresholds_round_like_the_reference(residual_dtype, threshold):
    """Rounding to the residual's dtype (1 + 2**-24 is 1.0 in fp32), overflow to Inf (1e39 in
    fp32), thresholds <= 0 (everything but NaN), NaN (nothing), subnormals."""
    tensors = [values("nonfinite", 500, torch.float32, 9),
               torch.tensor([1.0, -1.0, 1.0 + 2.0**-23, 1e-45, 0.0, -0.0], device=DEVICE,
                            dtype=residual_dtype)]
    residual = torch.zeros(506, dtype=residual_dtype, device=DEVICE)
    probes = [threshold, 1.0 + 2.0**-24, 1e39]
    with np.errstate(over="ignore"):
        expected, expected_idx, expected_counts = reference_select(
            residual, tensors, 0, 506, threshold, probes, 1, torch.int64)
    _, idx, counts, _ = kt.accumulate_select(residual, clones(tensors), 0, 506, threshold, probes, 1,
                                       torch.int64, False)
    assert same_bits(residual, expected)
    assert torch.equal(idx, expected_idx)
    assert counts == expected_counts


@pytest.mark.parametrize("every", [2, 8])
@pytest.mark.parametrize("span", ["full", "inner"])
def test_probe_counts_on_the_sampled_sub_range(every, span, monkeypatch):
    """every > 1: count_at_least reads 64 evenly spaced runs (1/every of the range) and scales
    the count; the fused pass counts on exactly those positions. Five probes: one more than the
    fused pass takes, so the extra counting pass runs too."""
    monkeypatch.setattr(common, "BLOCK", 512)   # 12001 elements: fewer interpreted programs
    tensors = [values("heavy", 9000, torch.float32, 10), values("heavy", 3001, torch.float16, 11)]
    residual = residual_for(tensors, torch.float32, 12)
    lo, hi = (0, 12001) if span == "full" else (77, 9999)
    probes = [0.1, 0.5, 1.0, 2.0, 4.0]
    expected, expected_idx, expected_counts = reference_select(
        residual, tensors, lo, hi, 1.0, probes, every, torch.int32)
    _, idx, counts, _ = kt.accumulate_select(residual, clones(tensors), lo, hi, 1.0, probes, every,
                                       torch.int32, True)
    assert same_bits(residual, expected)
    assert torch.equal(idx, expected_idx)
    assert counts == expected_counts


def test_probe_counts_sampled_range_too_short_is_counted_whole():
    tensors = [values("random", 1500, torch.float32, 13)]
    residual = residual_for(tensors, torch.float64, 14)
    expected = reference_select(residual, tensors, 0, 1500, 1.0, [0.5, 3.0], 8, torch.int64)
    _, _, counts, _ = kt.accumulate_select(residual, clones(tensors), 0, 1500, 1.0, [0.5, 3.0], 8,
                                     torch.int64, False)
    assert counts == expected[2]


def test_select_without_probes():
    tensors = [values("random", 700, torch.float32, 15)]
    residual = residual_for(tensors, torch.float32, 16)
    expected = reference_select(residual, tensors, 5, 690, 0.5, [], 1, torch.int32)
    _, idx, counts, _ = kt.accumulate_select(residual, clones(tensors), 5, 690, 0.5, [], 1, torch.int32,
                                       False)
    assert counts == [] and torch.equal(idx, expected[1])


@pytest.mark.parametrize("kind", ["random", "nonfinite"])
def test_accumulate_select_if_finite(kind):
    tensors = bucket(kind, 17)
    residual = residual_for(tensors, torch.float32, 18)
    before = residual.clone()
    inputs = clones(tensors)
    _, idx, counts, finite = kt.accumulate_select_if_finite(residual, inputs, 100, 2500, 1.0,
                                                            [0.5, 2.0], 1, torch.int32, True)
    if kind == "random":
        expected, expected_idx, expected_counts = reference_select(
            before, tensors, 100, 2500, 1.0, [0.5, 2.0], 1, torch.int32)
        assert finite is True
        assert same_bits(residual, expected) and torch.equal(idx, expected_idx)
        assert counts == expected_counts
        assert all(same_bits(x, torch.zeros_like(t)) for t, x in zip(tensors, inputs, strict=True))
    else:
        assert finite is False
        assert same_bits(residual, before) and idx is None and counts == []
        assert all(same_bits(x, t) for t, x in zip(tensors, inputs, strict=True))


def test_select_at_default_block_size(monkeypatch):
    """The shipped launch sizes, not only the shrunk ones."""
    monkeypatch.setattr(common, "BLOCK", 1024)
    tensors = [values("heavy", 2500, torch.float32, 19), values("heavy", 3000, torch.bfloat16, 20)]
    residual = residual_for(tensors, torch.float32, 21)
    expected = reference_select(residual, tensors, 1000, 5400, 0.8, [0.4, 1.6], 1, torch.int32)
    _, idx, counts, _ = kt.accumulate_select(residual, clones(tensors), 1000, 5400, 0.8, [0.4, 1.6], 1,
                                       torch.int32, True)
    assert same_bits(residual, expected[0]) and torch.equal(idx, expected[1])
    assert counts == expected[2]


# --- the momentum correction in the accumulating pass -------------------------------------------------
def reference_momentum_select(residual, velocity, tensors, nesterov, lo, hi, threshold, probes, every,
                              index_dtype, clear_inputs, check_finite):
    """(finite, a, u, idx, counts) of the reference accumulate_select with the momentum correction
    (on copies; counts as reference_select takes them)."""
    from hvd_sparse.backends.base import Momentum
    momentum = Momentum(velocity.clone(), 0.9, nesterov)
    inputs = clones(tensors)
    a, idx, _, finite = REF.accumulate_select(residual.clone(), inputs, lo, hi, threshold, [], 1, "int64",
                                              clear_inputs, check_finite, momentum)
    if not finite:
        return False, a, momentum.buffer, None, None, inputs
    magnitude = REF.abs(a[lo:hi])
    counts = REF.count_at_least(magnitude, probes, every) if hi > lo else [0.0] * len(probes)
    return True, a, momentum.buffer, idx.to(index_dtype), counts, inputs


MOMENTUM_CASES = (  # (kind, span, check_finite): every kind checked, the unchecked pass on a few
    [(kind, span, True) for kind in KINDS for span in ("full", "inner")]
    + [("random", "tail", False), ("heavy", "one", False), ("nonfinite", "inner", False),
       ("zero", "empty", False), ("equal", "full", False)])


@pytest.mark.parametrize("kind, span, check_finite", MOMENTUM_CASES)
@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("nesterov", [False, True], ids=["standard", "nesterov"])
def test_momentum_accumulate_select(kind, span, check_finite, residual_dtype, nesterov):
    """Every input dtype, -0 among the gradients and the velocity, NaN/±Inf; the residual, the
    velocity u, the indices, the probe counts and the inputs bit for bit; nothing written when an
    input is not finite and the check is on."""
    tensors = bucket(kind, 40)
    residual = residual_for(tensors, residual_dtype, 41)
    velocity = residual_for(tensors, residual_dtype, 42)
    velocity[::3] = -0.0
    if kind in ("equal", "zero"):   # keep the ties and the signed zeros
        residual.zero_()
        velocity.fill_(-0.0)
    n = residual.numel()
    lo, hi = RANGES[span]
    hi = n if hi is None else hi
    index_dtype = torch.int32 if span in ("full", "one") else torch.int64
    clear_inputs = span != "inner"
    threshold = 0.75 if kind == "equal" else 1.3
    probes = [threshold / 2, threshold * 2]
    finite, expected, expected_u, expected_idx, expected_counts, expected_inputs = reference_momentum_select(
        residual, velocity, tensors, nesterov, lo, hi, threshold, probes, 1, index_dtype, clear_inputs,
        check_finite)
    inputs = clones(tensors)
    got_u = velocity.clone()
    _, idx, counts, got_finite = kt.momentum_accumulate_select(
        residual, got_u, inputs, 0.9, nesterov, lo, hi, threshold, probes, 1, index_dtype, clear_inputs,
        check_finite)
    assert got_finite is finite is (not check_finite or kind != "nonfinite")
    assert same_bits(residual, expected) and same_bits(got_u, expected_u)
    if finite:
        assert idx.dtype == index_dtype and torch.equal(idx, expected_idx)
        assert counts == expected_counts
    else:
        assert idx is None and counts == []
    for t, x, want in zip(tensors, inputs, expected_inputs, strict=True):
        assert x.stride() == t.stride() and same_bits(x, want)


@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("nesterov", [False, True], ids=["standard", "nesterov"])
def test_momentum_accumulate(residual_dtype, nesterov):
    """The velocity's own op (DGC, and the reference's two-pass path) in one pass, no selection."""
    tensors = bucket("heavy", 43)
    residual = residual_for(tensors, residual_dtype, 44)
    velocity = residual_for(tensors, residual_dtype, 45)
    expected = REF.momentum_accumulate(residual.clone(), velocity.clone(), clones(tensors), 0.9, nesterov)
    inputs = clones(tensors)
    assert kt.momentum_accumulate(residual, velocity, inputs, 0.9, nesterov) == (residual, velocity)
    assert same_bits(residual, expected[0]) and same_bits(velocity, expected[1])
    assert all(same_bits(x, t) for t, x in zip(tensors, inputs, strict=True))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")   # the interpreter's NumPy
@pytest.mark.parametrize("nesterov", [False, True], ids=["standard", "nesterov"])
def test_momentum_signed_zeros_and_single_roundings(nesterov):
    """g = 0 + input: -0 turns +0 before the velocity sees it, a tiny fp64 input still rounds to
    -0 in fp32; u·m + g rounds twice (no FMA: 1 + 2**-24 products); overflow to Inf from finite
    values; at the shipped block size."""
    values = [0.0, -0.0, -1e-50, 1e-50, 3e38, -3e38, 1.0 + 2.0**-23, -(2.0**-25), 2.0**-24 + 2.0**-50, 1.0]
    g = torch.tensor(values * 3, dtype=torch.float64, device=DEVICE)
    e = torch.tensor([-0.0, 0.0, -0.0, 1e-45, 3e38, 3e38, 1.0, 1.0, 1.0, -1.0] * 3, device=DEVICE)
    u = torch.tensor([-0.0] * 10 + [1.0 + 2.0**-23] * 10 + [-1e-45, 3e38, 1.0, -0.0, -3e38, 2.0, 0.5, 0.25,
                                                              -0.0, 1.0 - 2.0**-24], device=DEVICE)
    for inputs in ([g], [g.float()], [g[:4], g[4:].float()]):
        select = (0, 30, 1.0, [0.5], 1, torch.int64, True, False)
        want = reference_momentum_select(e, u, inputs, nesterov, *select)
        got_e, got_u = e.clone(), u.clone()
        _, idx, counts, finite = kt.momentum_accumulate_select(got_e, got_u, clones(inputs), 0.9,
                                                               nesterov, *select)
        assert finite and same_bits(got_e, want[1]) and same_bits(got_u, want[2])
        assert torch.equal(idx, want[3]) and counts == want[4]


def test_momentum_at_default_block_size(monkeypatch):
    monkeypatch.setattr(common, "BLOCK", 1024)
    tensors = [values("heavy", 2500, torch.float32, 46), values("heavy", 3000, torch.float16, 47)]
    residual = residual_for(tensors, torch.float32, 48)
    velocity = residual_for(tensors, torch.float32, 49)
    want = reference_momentum_select(residual, velocity, tensors, False, 1000, 5400, 0.8, [0.4, 1.6], 1,
                                     torch.int32, True, True)
    _, idx, counts, finite = kt.momentum_accumulate_select(residual, velocity, clones(tensors), 0.9, False,
                                                           1000, 5400, 0.8, [0.4, 1.6], 1, torch.int32, True,
                                                           True)
    assert finite and same_bits(residual, want[1]) and same_bits(velocity, want[2])
    assert torch.equal(idx, want[3]) and counts == want[4]


# --- the Adam path in the accumulating pass, and its dense update --------------------------------------
def adam_moment(v, frozen=False):
    """The sparse steps' second moment around ``v`` (updated in place by the ops, unless
    ``frozen``: shared by the ranks, only read)."""
    from hvd_sparse.backends.base import SecondMoment
    return SecondMoment(v, 0.999, 1.25, 3.0, 1e-8, 300.0, frozen=frozen)


def reference_adam_select(residual, velocity, second, tensors, lo, hi, threshold, probes, every, index_dtype,
                          clear_inputs, check_finite, frozen=False):
    """(finite, a, u, v, idx, counts, inputs) of the reference accumulate_select on the Adam path
    (copies)."""
    from hvd_sparse.backends.base import Momentum
    momentum = Momentum(velocity.clone(), 0.9, second=adam_moment(second.clone(), frozen))
    inputs = clones(tensors)
    a, idx, _, finite = REF.accumulate_select(residual.clone(), inputs, lo, hi, threshold, [], 1, "int64",
                                              clear_inputs, check_finite, momentum)
    if not finite:
        return False, a, momentum.buffer, momentum.second.buffer, None, None, inputs
    magnitude = REF.abs(a[lo:hi])
    counts = REF.count_at_least(magnitude, probes, every) if hi > lo else [0.0] * len(probes)
    return True, a, momentum.buffer, momentum.second.buffer, idx.to(index_dtype), counts, inputs


def second_moment_for(residual, seed):
    """A positive v with zeros (where eps alone divides)."""
    v = residual_for([residual], residual.dtype, seed) ** 2 * 1e-4
    v[::7] = 0.0
    return v


@pytest.mark.parametrize("kind, span, check_finite", MOMENTUM_CASES)
@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("frozen", [False, True], ids=["own-v", "shared-v"])
def test_adam_accumulate_select(kind, span, check_finite, residual_dtype, frozen):
    """The residual, Adam's moments u and v, the indices, the probe counts and the inputs bit for
    bit; nothing written when an input is not finite and the check is on; a frozen v unwritten."""
    tensors = bucket(kind, 60)
    residual = residual_for(tensors, residual_dtype, 61)
    velocity = residual_for(tensors, residual_dtype, 62)
    velocity[::3] = -0.0
    second = second_moment_for(residual, 63)
    n = residual.numel()
    lo, hi = RANGES[span]
    hi = n if hi is None else hi
    index_dtype = torch.int32 if span in ("full", "one") else torch.int64
    clear_inputs = span != "inner"
    threshold = 30.0
    probes = [threshold / 2, threshold * 2]
    finite, expected, expected_u, expected_v, expected_idx, expected_counts, expected_inputs = (
        reference_adam_select(residual, velocity, second, tensors, lo, hi, threshold, probes, 1, index_dtype,
                              clear_inputs, check_finite, frozen))
    if frozen:
        assert same_bits(expected_v, second)
    inputs = clones(tensors)
    got_u, got_v = velocity.clone(), second.clone()
    _, idx, counts, got_finite = kt.adam_accumulate_select(
        residual, got_u, inputs, 0.9, adam_moment(got_v, frozen), lo, hi, threshold, probes, 1, index_dtype,
        clear_inputs, check_finite)
    assert got_finite is finite is (not check_finite or kind != "nonfinite")
    assert same_bits(residual, expected) and same_bits(got_u, expected_u) and same_bits(got_v, expected_v)
    if finite:
        assert idx.dtype == index_dtype and torch.equal(idx, expected_idx)
        assert counts == expected_counts
    else:
        assert idx is None and counts == []
    for t, x, want in zip(tensors, inputs, expected_inputs, strict=True):
        assert x.stride() == t.stride() and same_bits(x, want)


@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.float64])
def test_adam_accumulate_and_the_dense_update(residual_dtype):
    """The accumulation alone, and the dense steps' update whose square root and division are
    the correctly rounded ones (``sqrt_rn``, ``div_rn``), bit for bit."""
    from hvd_sparse.backends.base import Momentum
    tensors = bucket("heavy", 64)
    residual = residual_for(tensors, residual_dtype, 65)
    velocity = residual_for(tensors, residual_dtype, 66)
    second = second_moment_for(residual, 67)
    momentum = Momentum(velocity.clone(), 0.9, second=adam_moment(second.clone()))
    expected = REF.accumulate(residual.clone(), clones(tensors), False, momentum)
    assert kt.adam_accumulate(residual, velocity, clones(tensors), 0.9, adam_moment(second)) == (residual,
                                                                                                 velocity)
    assert same_bits(residual, expected) and same_bits(velocity, momentum.buffer)
    assert same_bits(second, momentum.second.buffer)
    for kind in ("random", "heavy", "zero"):
        average = residual_for(bucket(kind, 68), residual_dtype, 69) * 1e-2
        first = residual_for([average], residual_dtype, 70) * 1e-3
        second = residual_for([average], residual_dtype, 71) ** 2 * 1e-6
        want = REF.adam_update(average.clone(), first.clone(), second.clone(), 0.9, 0.999, 3.5, 7.25, 1e-8)
        got = kt.adam_update(average.clone(), first.clone(), second.clone(), 0.9, 0.999, 3.5, 7.25, 1e-8)
        assert all(same_bits(a, b) for a, b in zip(got, want, strict=True)), kind


def test_adam_declines_what_it_does_not_handle():
    g = [values("random", 10, torch.float32, 72)]
    e, u, v = (torch.zeros(10, device=DEVICE) for _ in range(3))
    args = (0, 10, 1.0, [], 1, torch.int64, False, True)
    assert kt.adam_accumulate_select(e, u, g, 0.9, adam_moment(v.double()), *args) is None
    assert kt.adam_accumulate_select(e, u, g, 0.9, adam_moment(torch.zeros(11, device=DEVICE)), *args) is None
    assert kt.adam_update(e, u, v.half(), 0.9, 0.999, 1.0, 1.0, 1e-8) is None


def test_momentum_declines_what_it_does_not_handle():
    g = [values("random", 10, torch.float32, 50)]
    e, u = torch.zeros(10, device=DEVICE), torch.zeros(10, device=DEVICE)
    args = (0.9, False, 0, 10, 1.0, [], 1, torch.int64, False, True)
    assert kt.momentum_accumulate_select(e, u.double(), g, *args) is None
    assert kt.momentum_accumulate_select(e, torch.zeros(11, device=DEVICE), g, *args) is None
    assert kt.momentum_accumulate_select(e, torch.zeros(20, device=DEVICE)[::2], g, *args) is None
    assert kt.momentum_accumulate_select(e.half(), u.half(), g, *args) is None
    assert kt.momentum_accumulate(e, u.double(), g, 0.9, False) is None
    integers = [torch.ones(10, dtype=torch.int32, device=DEVICE)]
    assert kt.momentum_accumulate(e, u, integers, 0.9, False) is None


# --- topk_abs ----------------------------------------------------------------------------------------
def reference_topk(x, k, index_dtype):
    return REF.topk_abs_indices(x, k).to(index_dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_topk_abs(kind, dtype):
    x = values(kind, 900, dtype, 22)
    n = x.numel()
    for k, index_dtype in [(0, torch.int32), (1, torch.int64), (131, torch.int32),
                           (n - 1, torch.int64), (n, torch.int32)]:
        idx = kt.topk_abs(x, k, index_dtype)
        assert idx.dtype == index_dtype and idx.numel() == k
        assert torch.equal(idx, reference_topk(x, k, index_dtype)), (kind, dtype, k)


@pytest.mark.parametrize("dtype", FLOATS)
def test_topk_abs_order_and_ties(dtype):
    """NaN above +Inf above everything; -0 == +0; ties at the k-th magnitude to the lowest
    indices; a non-contiguous input is read in its logical (flattened) order."""
    x = torch.tensor([0.5, -0.0, float("nan"), -0.5, 0.0, float("-inf"), 0.5, -float("nan"), 0.25,
                      0.0], dtype=dtype, device=DEVICE)
    assert kt.topk_abs(x, 1, torch.int64).tolist() == [2]
    assert kt.topk_abs(x, 2, torch.int64).tolist() == [2, 7]
    assert kt.topk_abs(x, 3, torch.int64).tolist() == [2, 5, 7]
    assert kt.topk_abs(x, 5, torch.int64).tolist() == [0, 2, 3, 5, 7]
    assert kt.topk_abs(x, 7, torch.int64).tolist() == [0, 2, 3, 5, 6, 7, 8]
    assert kt.topk_abs(x, 8, torch.int64).tolist() == [0, 1, 2, 3, 5, 6, 7, 8]   # -0 first
    grid = values("equal", 800, dtype, 23).reshape(40, 20).t()   # non-contiguous, all tied
    for k in (1, 129, 799):
        assert torch.equal(kt.topk_abs(grid, k, torch.int64), torch.arange(k, device=DEVICE))
    heavy = values("heavy", 1200, dtype, 24).reshape(30, 40)[:, ::2]   # a strided view
    assert torch.equal(kt.topk_abs(heavy, 100, torch.int32), reference_topk(heavy, 100, torch.int32))


def test_topk_abs_tiny_and_empty():
    empty = torch.zeros(0, device=DEVICE)
    assert kt.topk_abs(empty, 0, torch.int64).numel() == 0
    one = torch.tensor([-3.0], device=DEVICE)
    assert kt.topk_abs(one, 1, torch.int32).tolist() == [0]
    pair = torch.tensor([1.0, -2.0], device=DEVICE, dtype=torch.float64)
    assert kt.topk_abs(pair, 1, torch.int32).tolist() == [1]


# --- moments and norms (sums.py) ------------------------------------------------------------------------
@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 2 blocks of 4 x 4 entries, tile sums in chunks of 16: a few thousand entries span
    many tiles, several chunks per segment, tiles that end inside a block."""
    from hvd_sparse.kernels.triton import sums
    monkeypatch.setattr(sums, "ROWS", 4)
    monkeypatch.setattr(sums, "COLS", 4)
    monkeypatch.setattr(sums, "TILE_BLOCKS", 2)


def same_floats(a, b) -> bool:
    return np.array(a, dtype=np.float64).tobytes() == np.array(b, dtype=np.float64).tobytes()


LENGTHS = [0, 1, 31, 0, 33, 1000]   # 1065 entries; then the rest of the vector


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mean_std_and_segment_norms(kind, dtype, small_tiles):
    x = values(kind, 1601, dtype, 30)
    assert same_floats(kt.mean_std(x), REF.mean_std(x)), kind
    lengths = [*LENGTHS, x.numel() - sum(LENGTHS)]
    np.testing.assert_array_equal(kt.segment_norms(x, lengths), REF.segment_norms(x, lengths))
    np.testing.assert_array_equal(kt.segment_norms(x.reshape(1601, 1).t(), [1601]),
                                  REF.segment_norms(x, [1601]))


def test_moments_that_the_sums_cannot_decide_come_from_the_exact_sums(small_tiles, monkeypatch):
    from hvd_sparse.backends import exact
    x = values("heavy", 2000, torch.float32, 31)
    fast = kt.mean_std(x)
    monkeypatch.setattr(exact, "certain_mean_std", lambda *args: None)
    assert same_floats(kt.mean_std(x), fast) and same_floats(fast, REF.mean_std(x))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("check_finite", [False, True])
def test_accumulate_moments(kind, residual_dtype, check_finite, small_tiles):
    tensors = bucket(kind, 32)
    residual = residual_for(tensors, residual_dtype, 33)
    before = residual.clone()
    expected = REF.accumulate_moments(before.clone(), clones(tensors), True, check_finite)
    inputs = clones(tensors)
    _, moments, finite = kt.accumulate_moments(residual, inputs, True, check_finite)
    assert finite is expected[2] is (not check_finite or kind != "nonfinite")
    assert same_bits(residual, expected[0]) and same_floats(moments, expected[1])
    for t, x in zip(tensors, inputs, strict=True):
        assert same_bits(x, torch.zeros_like(t) if finite else t)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.float64])
def test_accumulate_norms(kind, residual_dtype, small_tiles):
    tensors = bucket(kind, 34)
    residual = residual_for(tensors, residual_dtype, 35)
    lengths = [*LENGTHS, residual.numel() - sum(LENGTHS)]
    expected = REF.accumulate_norms(residual.clone(), clones(tensors), lengths)
    inputs = clones(tensors)
    _, norms = kt.accumulate_norms(residual, inputs, lengths)
    assert same_bits(residual, expected[0])
    np.testing.assert_array_equal(norms, expected[1])
    assert all(same_bits(x, t) for t, x in zip(tensors, inputs, strict=True))


def test_sums_at_default_tile_size():
    """The shipped tile sizes, not only the shrunk ones."""
    tensors = [values("heavy", 2500, torch.float32, 36), values("random", 3000, torch.bfloat16, 37)]
    residual = residual_for(tensors, torch.float32, 38)
    expected = REF.accumulate_moments(residual.clone(), clones(tensors))
    assert same_floats(kt.accumulate_moments(residual, clones(tensors), False, False)[1], expected[1])
    np.testing.assert_array_equal(kt.segment_norms(residual, [2500, 3000]),
                                  REF.segment_norms(residual, [2500, 3000]))


def test_sums_decline_what_they_do_not_handle():
    x = values("random", 10, torch.float32, 39)
    assert kt.mean_std(x.half()) is None and kt.mean_std(x[:1]) is None
    assert kt.segment_norms(x, [3, 4]) is None and kt.segment_norms(x, []) is None
    assert kt.segment_norms(x, [11, -1]) is None
    half = torch.zeros(10, dtype=torch.float16, device=DEVICE)
    assert kt.accumulate_moments(half, [x], False, False) is None
    assert kt.accumulate_norms(torch.zeros(10, device=DEVICE), [x], [9]) is None


# --- what the kernels leave to the reference path --------------------------------------------------
def test_unsupported_arguments_return_none():
    g = [values("random", 10, torch.float32, 25)]
    assert kt.accumulate(torch.zeros(10, dtype=torch.float16, device=DEVICE), g, False) is None
    assert kt.accumulate(torch.zeros(20, device=DEVICE)[::2], g, False) is None   # strided
    assert kt.accumulate(torch.zeros(11, device=DEVICE), g, False) is None          # size mismatch
    assert kt.accumulate(torch.zeros(10, device=DEVICE),
                         [torch.ones(10, dtype=torch.int32, device=DEVICE)], False) is None
    assert kt.accumulate_select(torch.zeros(10, device=DEVICE), g, 0, 10, 1.0, [], 1,
                                torch.int16, False) is None
    assert kt.accumulate_select(torch.zeros(10, device=DEVICE), g, 5, 11, 1.0, [], 1,
                                torch.int32, False) is None
    assert kt.topk_abs(torch.ones(4, dtype=torch.int32, device=DEVICE), 2, torch.int64) is None
    assert kt.topk_abs(torch.ones(4, device=DEVICE), 5, torch.int64) is None
    assert kt.topk_abs(torch.ones(4, device=DEVICE), 2, torch.float32) is None


def test_missing_triton_raises_kernel_unavailable(monkeypatch):
    """Without Triton the module refuses to import with the loader's KernelUnavailable, naming
    the fix; the loader turns that into one warning and the reference path."""
    from hvd_sparse.kernels import KernelUnavailable
    for name in [name for name in sys.modules if name.startswith(MODULE)]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(KernelUnavailable, match="Triton is not installed"):
        importlib.import_module(MODULE)
