"""Gaussian-k's and DEFT's fused steps: accumulation with the moments or the unit norms taken in
the same pass, the selection with probe counts, the native exact sums and the memset clear, each
against the reference path bit for bit; Gaussian-k's and DEFT's decisions identical through the
fused ops and without them; Gaussian-k's rescale lookahead against the loop written out."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

import hvd_sparse
from hvd_sparse.algorithms import DEFT, GaussianK, gaussiank
from hvd_sparse.algorithms.base import Algorithm, StepContext
from hvd_sparse.algorithms.gaussiank import rescale_tree, strictly_above
from hvd_sparse.backends import exact as numerics
from hvd_sparse.backends import get_backend
from hvd_sparse.backends.base import Backend
from hvd_sparse.comm.local import LocalGroup
from hvd_sparse.engine import Engine
from tests.reference.gaussiank import gaussiank_original, gaussiank_rescale
from tests.unit.kernels.test_cpu import cpu_ops, gradients, kinds, needs_kernels, same
from tests.unit.kernels.test_topk import reference

NP, TB = get_backend("numpy"), get_backend("torch")
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def same_floats(a, b) -> bool:
    """Host floats (or None) equal bit for bit, NaN included."""
    return np.array(a, dtype=np.float64).tobytes() == np.array(b, dtype=np.float64).tobytes()


def bucket(x: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of every input dtype (3778 entries) from one vector of 3001: one non-contiguous
    (a transpose), one empty."""
    return [x[:1000].to(torch.float16), x[1000:2000].to(torch.bfloat16).view(25, 40).t(),
            torch.zeros(0), x[2000:].to(torch.float32), x[:777].to(torch.float64)]


def clones(tensors):
    return [t.clone(memory_format=torch.preserve_format) for t in tensors]


# --- accumulate_moments -------------------------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("clear", [False, True])
@pytest.mark.parametrize("check_finite", [False, True])
def test_accumulate_moments_is_accumulate_then_mean_std(residual_dtype, clear, check_finite):
    cpu_ops()
    for name, x in kinds(3001, 4).items():
        inputs = bucket(x)
        n = sum(t.numel() for t in inputs)
        start = (torch.randn(n, dtype=torch.float64) * 0.3).to(residual_dtype)
        want_inputs, got_inputs = clones(inputs), clones(inputs)
        want = reference(TB.accumulate_moments, start.clone(), want_inputs, clear, check_finite)
        got = TB.accumulate_moments(start.clone(), got_inputs, clear, check_finite)
        where = f"{name} {residual_dtype} clear={clear} check={check_finite}"
        assert same(got[0], want[0]) and got[2] is want[2], where
        assert same_floats(got[1], want[1]), (where, got[1], want[1])
        assert got[2] is (not check_finite or name != "nonfinite"), where
        for a, b in zip(got_inputs, want_inputs, strict=True):
            assert same(a, b), where   # cleared, or not, alike


@needs_kernels
@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("clear", [False, True])
@pytest.mark.parametrize("check_finite", [False, True])
def test_accumulate_segment_moments_is_accumulate_then_each_segments_mean_std(residual_dtype, clear,
                                                                             check_finite):
    """Segments that do not follow the inputs' boundaries, one of a single entry, one empty."""
    cpu_ops()
    lengths = [1, 999, 0, 1500, 1278]
    for name, x in kinds(3001, 6).items():
        inputs = bucket(x)
        start = (torch.randn(sum(lengths), dtype=torch.float64) * 0.3).to(residual_dtype)
        want_inputs, got_inputs = clones(inputs), clones(inputs)
        options = (lengths, clear, check_finite)
        want = reference(TB.accumulate_segment_moments, start.clone(), want_inputs, *options)
        got = TB.accumulate_segment_moments(start.clone(), got_inputs, *options)
        where = f"{name} {residual_dtype} clear={clear} check={check_finite}"
        assert same(got[0], want[0]) and got[2] is want[2], where
        assert same_floats(got[1], want[1]), (where, got[1], want[1])
        assert got[2] is (not check_finite or name != "nonfinite"), where
        if got[2]:   # the reference composition is accumulate, then each slice's mean_std
            ends = np.cumsum(lengths).tolist()
            each = [TB.mean_std(got[0][end - n:end]) for n, end in zip(lengths, ends, strict=True)]
            assert same_floats(got[1], each), where
        for a, b in zip(got_inputs, want_inputs, strict=True):
            assert same(a, b), where
    assert cpu_ops().accumulate_segment_moments(torch.zeros(5), [torch.ones(5)], [2, 2], False, False) is None


@needs_kernels
def test_accumulate_moments_kernel_runs_and_writes_nothing_on_a_non_finite_input():
    ops = cpu_ops()
    residual, inputs = torch.randn(10), [torch.randn(4), torch.randn(6).half()]
    done = ops.accumulate_moments(residual.clone(), clones(inputs), True, True)
    assert done is not None and done.finite is True
    assert same_floats(done.moments, TB.mean_std(reference(TB.accumulate, residual.clone(), inputs)))
    inputs[1][2] = float("nan")
    before, given = residual.clone(), clones(inputs)
    assert ops.accumulate_moments(residual, given, True, True) == (residual, None, False)
    assert same(residual, before) and all(same(a, b) for a, b in zip(given, inputs, strict=True))
    assert ops.accumulate_moments(torch.zeros(4, dtype=torch.float16), [torch.ones(4)], False, False) is None
    assert ops.accumulate_moments(torch.zeros(0), [], False, False) is None   # no entry: reference


@needs_kernels
def test_accumulate_moments_exact_fallback_gives_the_same(monkeypatch):
    """Forced onto the exact sums (the native ones with kernels, NumPy's without): the same."""
    x = kinds(3001, 5)["heavy"]
    start = torch.randn(sum(t.numel() for t in bucket(x)))
    fast = TB.accumulate_moments(start.clone(), bucket(x))[1]
    monkeypatch.setattr(numerics, "certain_mean_std", lambda *args: None)
    exact = TB.accumulate_moments(start.clone(), bucket(x))[1]
    slow = reference(TB.accumulate_moments, start.clone(), bucket(x))[1]
    assert same_floats(fast, exact) and same_floats(exact, slow)


@needs_kernels
def test_native_exact_sums_match_numpy_exact_sums(monkeypatch):
    from hvd_sparse.kernels.cpu import norms
    rng = np.random.default_rng(3)
    cases = {
        "random": rng.standard_normal(100_003).astype(np.float32),
        "subnormal": (rng.standard_normal(1000) * 1e-42).astype(np.float32),
        "huge": (rng.standard_normal(999) * 1e37).astype(np.float32),
        "mixed-scales": (rng.standard_normal(5000) * 10.0 ** rng.integers(-40, 38, 5000)).astype(np.float32),
        "one": np.array([-2.5], np.float32), "zeros": np.zeros(9, np.float32),
        "signed-zeros": np.array([-0.0, 0.0, -0.0], np.float32),
        "mean-on-a-tie": np.array([1.0, 1.0 + 2.0 ** -23], np.float32),
        "nan": np.array([1.0, np.nan], np.float32), "inf": np.array([-np.inf, 1.0], np.float32),
        "float64": rng.standard_normal(300), "empty": np.zeros(0, np.float32),
    }
    monkeypatch.setattr(norms, "EXACT_CHUNK", 1000)   # several calls, added as integers
    for name, x in cases.items():
        assert same_floats(norms.exact_mean_std(torch.from_numpy(x)), numerics.exact_mean_std(x)), name


# --- accumulate_norms ----------------------------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.float64])
def test_accumulate_norms_is_accumulate_then_segment_norms(residual_dtype):
    ops = cpu_ops()
    for name, x in kinds(3001, 6).items():
        inputs = bucket(x)
        n = sum(t.numel() for t in inputs)
        start = (torch.randn(n, dtype=torch.float64) * 0.3).to(residual_dtype)
        for lengths in ([n], [0, 1, 999, 0, 2048, n - 3048], [1] * 5 + [n - 5], [n - 1, 1, 0]):
            want = reference(TB.accumulate_norms, start.clone(), clones(inputs), lengths)
            got = TB.accumulate_norms(start.clone(), clones(inputs), lengths)
            where = f"{name} {residual_dtype} {lengths}"
            assert same(got[0], want[0]), where
            np.testing.assert_array_equal(got[1], want[1], err_msg=where)
            assert ops.accumulate_norms(start.clone(), clones(inputs), lengths) is not None
    assert ops.accumulate_norms(torch.zeros(4), [torch.ones(4)], [3]) is None          # lengths short
    assert ops.accumulate_norms(torch.zeros(4), [torch.ones(4)], [5, -1]) is None
    assert ops.accumulate_norms(torch.zeros(4), [torch.ones(4)], []) is None
    assert ops.accumulate_norms(torch.zeros(4, dtype=torch.float16), [torch.ones(4)], [4]) is None


# --- select_at_least with probes ------------------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_select_at_least_with_probes_matches_the_reference(dtype):
    ops = cpu_ops()
    n = 70_000
    for name, x in kinds(n, 7).items():
        t = x.to(dtype)
        for lo, hi in ((0, n), (7, n - 3), (n - 1, n), (5, 5)):
            for threshold in (0.1, 0.25, 0.0, 1.7, float("inf"), float("nan")):
                for probes, every in (([], 1), ([0.05, 0.3, -1.0, float("nan"), 0.25, 3.0, 0.0, 1e39], 1),
                                      ([0.05, 0.3], 8)):
                    if probes and hi == lo:
                        continue   # the reference divides by the empty range's length
                    where = f"{name} {dtype} [{lo}, {hi}) λ={threshold} probes {len(probes)}/{every}"
                    with np.errstate(over="ignore"):   # NumPy warns as it rounds 1e39 to float32
                        want = reference(TB.select_at_least, t, lo, hi, threshold, probes, every)
                    for index_dtype in (torch.int32, torch.int64):
                        idx, counts = ops.select_at_least(t, lo, hi, threshold, probes, every, index_dtype)
                        assert idx.dtype == index_dtype and torch.equal(idx.long(), want[0]), where
                        assert counts == want[1], where
    assert ops.select_at_least(torch.ones(4, dtype=torch.float16), 0, 4, 0.5, [], 1) is None
    assert ops.select_at_least(torch.ones(4), 0, 4, 0.5, [0.1] * 9, 1) is None   # more probes than it takes
    assert ops.select_at_least(torch.ones(4), 0, 5, 0.5, [], 1) is None


# --- clear ------------------------------------------------------------------------------------------------
@needs_kernels
def test_clear_zeroes_like_zero_():
    ops = cpu_ops()
    tensors = [torch.randn(1000, dtype=d) for d in FLOATS] + [torch.zeros(0), -torch.ones(3, 4),
                                                             torch.arange(5)]
    assert ops.clear(tensors) is True
    assert all(same(t, torch.zeros_like(t)) for t in tensors)   # +0.0, not -0.0
    strided = torch.randn(10)[::2]
    assert ops.clear([strided]) is None
    TB.clear([strided])                                         # the backend zeroes it itself
    assert same(strided, torch.zeros(5))


# --- Gaussian-k -------------------------------------------------------------------------------------------
def counting_reads(reads: list) -> Backend:
    """The torch backend, noting in ``reads`` the threshold of each read (``select_at_least``)."""
    original = TB.select_at_least

    class Counting(type(TB)):
        def select_at_least(self, *args, **kwargs):
            reads.append(args[3])
            return original(*args, **kwargs)

    return Counting()


def select_counting_reads(algorithm, x: torch.Tensor) -> tuple[np.ndarray, float, int]:
    """(indices, threshold, reads of the vector by select_at_least) of ``select_local``."""
    reads = []
    ctx = StepContext(rank=0, size=1, step=0, key="t", numel=x.numel(), backend=counting_reads(reads))
    control = algorithm.init_control(ctx)
    idx = algorithm.select_local(x, control, ctx)
    return np.sort(TB.to_numpy(idx).astype(np.int64)), control.threshold, len(reads)


def rescale_loop(x: torch.Tensor, density: float, loops: int) -> tuple[np.ndarray, float]:
    """The rescale loop as the module's docstring writes it, one read per loop."""
    k = max(1, int(density * x.numel()))
    mean, std = reference(TB.mean_std, x)
    threshold = GaussianK(density).initial_threshold(mean, std)
    magnitude = x.abs().numpy()
    dtype = TB.dtype_name(x)

    def above(t):
        return np.flatnonzero(magnitude >= strictly_above(t, dtype))
    for _ in range(loops):
        count = above(threshold).size
        if count < 2 * k / 3:
            threshold *= 0.5
        elif count > 4 * k / 3:
            threshold *= 1.5
        else:
            return above(threshold), threshold
    return above(threshold), threshold


def distributions(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(n)
    return {"gaussian": rng.standard_normal(n), "uniform": rng.uniform(-1, 1, n),
            "cauchy": rng.standard_cauchy(n), "student": rng.standard_t(2.0, n),
            "two-scales": np.where(rng.random(n) < 0.01, 1e3, 1e-3) * rng.standard_normal(n),
            "mostly-zero": np.where(rng.random(n) < 0.001, rng.standard_normal(n), 0.0),
            "staircase": rng.permutation(np.concatenate([np.full(50, 1.0), np.full(60, -0.03),
                                                         np.full(5000, 1e-4), np.zeros(n - 5110)])),
            "zero": np.zeros(n), "tied": np.full(n, 0.5),
            "negative-mean": -5.0 + 0.01 * rng.standard_normal(n),           # λ < 0
            "subnormal": 1e-41 * rng.standard_normal(n),                       # λ among subnormals
            "near-zero-lo": np.where(rng.random(n) < 0.3, 1e-39, 0.0) * rng.standard_normal(n)}


@pytest.mark.parametrize("max_loops", [0, 1, 2, 3, 4, 6, 7, 10])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rescale_lookahead_visits_the_loops_thresholds(max_loops, dtype):
    """Whatever the loop does, the lookahead reaches the same λ and index set, and reads the vector
    at most twice per three loops (plus once)."""
    algorithm = GaussianK(0.01, variant="rescale", max_loops=max_loops)
    for name, values in distributions(20_000).items():
        x = torch.from_numpy(values).to(dtype)
        want_idx, want_threshold = rescale_loop(x, 0.01, max_loops)
        for mode in ("auto", "off"):
            got_idx, threshold, reads = (select_counting_reads(algorithm, x) if mode == "auto"
                                         else reference(select_counting_reads, algorithm, x))
            where = f"{name} {dtype} loops={max_loops} kernels {mode}"
            assert np.array_equal(got_idx, want_idx), where
            assert same_floats(threshold, want_threshold), where
            assert reads <= 1 + 2 * -(-max_loops // 3), where


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_rounding_is_numpys(dtype):
    """The loop's fast rounding of λ (struct) is NumPy's, bit for bit: ties, subnormals, ±0, the
    largest finite values and beyond (±Inf), NaN."""
    rounded, kind = gaussiank.rounding(dtype), np.dtype(dtype).type
    rng = np.random.default_rng(8)
    edges = [0.0, -0.0, np.inf, -np.inf, np.nan, 3.4028235e38, 3.4028236e38, -3.5e38, 65504.0, 65519.9,
             65520.0, 1e-46, 7e-46, 3e-8, 2.9e-8]
    values = [*(rng.standard_normal(5000) * 10.0 ** rng.uniform(-50, 50, 5000)), *edges]
    with np.errstate(over="ignore"):
        for x in values:
            assert np.float64(rounded(x)).tobytes() == np.float64(kind(x)).tobytes(), (dtype, x)


def test_rescale_tree_is_the_loops_arithmetic():
    tree = rescale_tree(0.3, 3)
    assert tree == [0.3, 0.3 * 0.5, 0.3 * 1.5, 0.3 * 0.5 * 0.5, 0.3 * 0.5 * 1.5, 0.3 * 1.5 * 0.5,
                    0.3 * 1.5 * 1.5]
    assert rescale_tree(0.3, 0) == rescale_tree(0.3, 1) == [0.3]


def test_rescale_matches_the_mask_reference_with_more_loops():
    rng = np.random.default_rng(11)
    x = (rng.standard_t(3.0, 30_000) * np.exp(rng.standard_normal(30_000))).astype(np.float32)
    for loops in (3, 5, 9):
        algorithm = GaussianK(0.003, variant="rescale", max_loops=loops)
        got = select_counting_reads(algorithm, torch.from_numpy(x))[0]
        assert np.array_equal(got, gaussiank_rescale(x, 0.003, loops)), loops


@pytest.mark.parametrize("host_entries", [gaussiank.HOST_ENTRIES, 300, 0])
@pytest.mark.parametrize("max_loops", [1, 2, 3, 5, 12, 100])
def test_original_matches_the_mask_reference(max_loops, host_entries, monkeypatch):
    """Every path of the loop against the authors' mask form: counts from the host's sorted
    entries (the whole vector, or those above a floor), from the probes of reads that select or
    only count, and from two known counts that agree (``host_entries`` 0: no host entries)."""
    monkeypatch.setattr(gaussiank, "HOST_ENTRIES", host_entries)
    algorithm = GaussianK(0.01, max_loops=max_loops)
    for name, values in distributions(20_000).items():
        x = values.astype(np.float32)
        want = gaussiank_original(x, 0.01, max_loops)
        for mode in ("auto", "off"):
            got, _, reads = (select_counting_reads(algorithm, torch.from_numpy(x)) if mode == "auto"
                             else reference(select_counting_reads, algorithm, torch.from_numpy(x)))
            where = f"{name} loops={max_loops} host entries {host_entries} kernels {mode}"
            assert np.array_equal(got, want), where
            if host_entries >= x.size:   # one read of everything: the loop runs on the host
                assert reads == 1, f"{where}: {reads} reads"


@pytest.mark.parametrize("host_entries", [1000, 3000])
def test_original_decides_alike_whatever_the_last_steps_hint(host_entries, monkeypatch):
    """Each step's first read selects where the last step's reads settled (relative to λ): on
    vectors alike from step to step, and on every change of distribution between steps (the hint
    then misleads), the decisions are the mask form's, and alike vectors take one read a step."""
    monkeypatch.setattr(gaussiank, "HOST_ENTRIES", host_entries)
    algorithm, reads = GaussianK(0.01), []
    ctx = StepContext(rank=0, size=1, step=0, key="t", numel=20_000, backend=counting_reads(reads))
    control = algorithm.init_control(ctx)
    steps = [*distributions(20_000).items(), *distributions(20_001).items()]   # each hint misleads
    for name, values in list(distributions(20_002).items())[:4]:   # alike twice
        steps += [(name, values), (f"{name} again", values * 1.01 + 1e-3 * np.roll(values, 1))]
    for name, values in steps:
        x = torch.from_numpy(values[:20_000].astype(np.float32))
        reads.clear()
        got = np.sort(TB.to_numpy(algorithm.select_local(x, control, ctx)).astype(np.int64))
        assert np.array_equal(got, gaussiank_original(x.numpy(), 0.01)), f"{name}, hint {control.settled}"
        if name.endswith("again"):
            assert len(reads) == 1, f"{name}: {len(reads)} reads"


def test_original_reads_an_all_zero_vector_once():
    """λ = 0 stays where it rounds: after the first read the loop knows nothing is left, instead of
    reading the vector once per loop (100 times)."""
    x = torch.zeros(50_000)
    idx, threshold, reads = select_counting_reads(GaussianK(0.01), x)
    assert reads == 1 and idx.size == 0 and threshold == 0.0
    assert np.array_equal(idx, gaussiank_original(x.numpy(), 0.01))
    y = x.clone()
    y[::1000] = 1.0   # 50 entries of 1, k = 500: too few at λ, and at every λ·0.1^j after (46 loops)
    idx, _, reads = select_counting_reads(GaussianK(0.01), y)
    assert np.array_equal(idx, gaussiank_original(y.numpy(), 0.01)) and reads <= 8


class Unfused(Algorithm):
    """An algorithm with the fused hooks of Gaussian-k and DEFT taken away: the engine then
    accumulates with ``Backend.accumulate`` and selects from the accumulated vector."""

    def accumulate(self, residual, tensors, control, ctx):
        return ctx.backend.accumulate(residual, tensors)

    def accumulate_select(self, *args):
        return None


def unfused(algorithm):
    cls = type(f"Unfused{type(algorithm).__name__}", (Unfused, type(algorithm)), {})
    out = copy.copy(algorithm)
    out.__class__ = cls
    return out


def run_engine(algorithm, size, steps, grads):
    engines = [Engine(copy.deepcopy(algorithm), TB, r, size, write_into_inputs=True) for r in range(size)]
    group, history = LocalGroup(size, TB), []
    for step in range(steps):
        inputs = [[t.clone() for t in grads(step, r)] for r in range(size)]
        outs = group.run([e.step("model", inputs[r]) for r, e in enumerate(engines)])
        history.append([([o.clone() for o in out], e.buckets["model"].residual.clone(),
                         {k: repr(v) for k, v in e.stats().items() if not k.endswith("seconds")})
                        for out, e in zip(outs, engines, strict=True)])
    return history


@pytest.mark.parametrize("algorithm", [GaussianK(0.01, scope="model"), GaussianK(0.01, variant="rescale",
                                                                                  scope="model"),
                                       DEFT(0.01)], ids=["gaussiank", "gaussiank-rescale", "deft"])
@pytest.mark.parametrize("mode", ["auto", "off"])
def test_fused_hooks_make_the_decisions_of_the_plain_step(algorithm, mode):
    """Through accumulate_moments / accumulate_norms, and without them: identical averages,
    residuals and statistics, a non-finite step (rank 1, step 7) included."""
    grads = gradients(21, [30_000, 2_000, 777], [torch.float32, torch.float16, torch.bfloat16])
    previous = hvd_sparse.kernels_mode()
    hvd_sparse.set_kernels(mode)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # the non-finite step warns
            fused = run_engine(algorithm, 3, 9, grads)
            plain = run_engine(unfused(algorithm), 3, 9, grads)
    finally:
        hvd_sparse.set_kernels(previous)
    for step, (a, b) in enumerate(zip(fused, plain, strict=True)):
        for rank, ((out_a, res_a, st_a), (out_b, res_b, st_b)) in enumerate(zip(a, b, strict=True)):
            where = f"step {step} rank {rank}"
            assert all(same(x, y) for x, y in zip(out_a, out_b, strict=True)), where
            assert same(res_a, res_b) and st_a == st_b, where


def test_deft_uses_the_norms_of_the_vector_it_selects_from():
    """The norms accumulate took belong to that vector; a step whose gradient was not finite
    selects from zeros and takes their norms (zero), never the stale ones."""
    deft = DEFT(0.01)
    ctx = StepContext(rank=0, size=2, step=0, key="model", numel=6000, backend=TB, sizes=(4000, 2000))
    control = deft.init_control(ctx)
    acc = deft.accumulate(torch.zeros(6000), [torch.randn(4000), torch.randn(2000)], control, ctx)
    assert control.norms[0] is acc
    np.testing.assert_array_equal(control.norms[1], TB.segment_norms(acc, list(control.table.sizes)))
    assert control.table.sizes == (2000, 2000, 2000)
    seen = []
    original = TB.segment_norms

    class Watching(type(TB)):
        def segment_norms(self, x, lengths):
            seen.append(x)
            return original(x, lengths)

    ctx = StepContext(rank=0, size=2, step=0, key="model", numel=6000, backend=Watching(), sizes=(4000, 2000))
    zeros = torch.zeros(6000)
    phase = next(deft.select(zeros, control, ctx))   # another vector: its own norms
    assert control.norms is None and len(phase) == 1 and len(seen) == 1 and seen[0] is zeros
