"""Gaussian-k's mean and standard deviation: float32(S1/n) and float32(sqrt((S2 - S1²/n)/(n-1)))
for the exact sums S1 = Σx, S2 = Σx², bit for bit on NumPy, torch (kernels on and off) and
TensorFlow, whether a path's float64 sums decide or the exact integer sum does."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

import hvd_sparse
from hvd_sparse import kernels
from hvd_sparse.backends import exact as numerics
from hvd_sparse.backends import get_backend

F32 = np.float32


def nearest_float32(q: Fraction, square: bool = False) -> float:
    """The float32 nearest to q (sqrt(q) with ``square``), ties to even, by a search over the
    float32 bit patterns (independent of numerics._round_float32)."""
    lo, hi = 0, 0x7F800000   # positive float32 bit patterns, +Inf last
    def value(bits: int) -> Fraction:
        return Fraction(float(np.uint32(bits).view(F32)))

    def key(m: Fraction) -> Fraction:
        return m * m if square else m
    while hi - lo > 1:   # largest pattern whose value is <= the target
        mid = (lo + hi) // 2
        if key(value(mid)) <= q:
            lo = mid
        else:
            hi = mid
    below = value(lo)
    above = value(lo + 1) if lo + 1 < 0x7F800000 else Fraction(2) ** 128
    midpoint = key((below + above) / 2)
    pick = lo + 1 if q > midpoint or (q == midpoint and lo & 1) else lo
    return math.inf if pick >= 0x7F800000 else float(np.uint32(pick).view(F32))


def exact_reference(x: np.ndarray) -> tuple[float, float]:
    values = [Fraction(float(v)) for v in x.astype(np.float64)]
    n = len(values)
    mean = sum(values) / n
    rounded = -nearest_float32(-mean) if mean < 0 else nearest_float32(mean)
    if n == 1:
        return rounded, 0.0
    return rounded, nearest_float32(sum((v - mean) ** 2 for v in values) / (n - 1), square=True)


def inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {
        "random": rng.standard_normal(3000).astype(F32),
        "heavy-tailed": (rng.standard_cauchy(5000) * 1e-3).astype(F32),
        "constant": np.full(700, 3.7, F32),
        "single": np.array([-2.5], F32),
        "all-zero": np.zeros(100, F32),
        "large-magnitude": (rng.standard_normal(999) * 1e30).astype(F32),
        "cancellation": (1e4 + rng.standard_normal(2000) * 1e-3).astype(F32),
        "subnormal": (rng.standard_normal(300) * 1e-42).astype(F32),
        "mean-on-a-tie": np.array([1.0, 1.0 + 2.0 ** -23], F32),   # mean 1 + 2^-24: ties to 1
        "mean-on-odd-tie": np.array([1.0 + 2.0 ** -23, 1.0 + 2.0 ** -22], F32),
        "float64": rng.standard_normal(1500),
        "float64-huge": rng.standard_normal(300) * 1e200,
    }


def paths(x: np.ndarray) -> dict[str, tuple[float, float]]:
    out = {"numpy": get_backend("numpy").mean_std(x.copy())}
    torch_backend = get_backend("torch")
    previous = hvd_sparse.kernels_mode()
    try:
        for mode in ("auto", "off"):
            hvd_sparse.set_kernels(mode)
            out[f"torch-{mode}"] = torch_backend.mean_std(torch.from_numpy(x.copy()))
    finally:
        hvd_sparse.set_kernels(previous)
    try:
        import tensorflow as tf
    except ImportError:
        return out
    out["tensorflow"] = get_backend("tensorflow").mean_std(tf.constant(x))
    return out


def same(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return all(np.array(u).tobytes() == np.array(v).tobytes() for u, v in zip(a, b, strict=True))


@pytest.mark.parametrize("name", list(inputs()))
def test_every_path_gives_the_exactly_rounded_mean_and_std(name):
    x = inputs()[name]
    expected = exact_reference(x)
    got = paths(x)
    assert all(same(v, expected) for v in got.values()), (expected, got)
    assert same(numerics.exact_mean_std(x), expected)


@pytest.mark.parametrize("name", ["random", "heavy-tailed", "cancellation", "float64"])
def test_exact_fallback_gives_the_same(name, monkeypatch):
    """Every path, forced onto the exact integer sum, agrees with its float64 sums."""
    x = inputs()[name]
    fast = paths(x)
    monkeypatch.setattr(numerics, "certain_mean_std", lambda *args: None)
    exact = paths(x)
    assert all(same(v, fast["numpy"]) for v in [*fast.values(), *exact.values()]), (fast, exact)


def test_ties_are_not_decided_by_the_float64_sums():
    """A mean exactly on a float32 midpoint: the sums' error bound straddles it, so the exact sum
    decides (ties to even)."""
    x = inputs()["mean-on-a-tie"]
    assert numerics.certain_mean_std(2, float(x[0]), float(x[1] - x[0]), float(x[1] - x[0]) ** 2, 10) is None
    assert paths(x)["numpy"][0] == 1.0
    assert paths(inputs()["mean-on-odd-tie"])["numpy"][0] == 1.0 + 2.0 ** -22


def test_non_finite_inputs():
    for x, mean in [(np.array([1.0, np.nan], F32), math.nan), (np.array([1.0, np.inf], F32), math.inf),
                    (np.array([-np.inf, 1.0], F32), -math.inf), (np.array([np.inf, -np.inf], F32), math.nan)]:
        for got in paths(x).values():
            assert np.array(got[0]).tobytes() == np.array(mean).tobytes() and math.isnan(got[1]), (x, got)


@pytest.mark.skipif(kernels.mode() == "off", reason="HVD_SPARSE_KERNELS=off run: no kernel to compare")
def test_kernel_on_a_large_vector_matches_numpy():
    """Several kernel blocks and fan-out levels (512 x 64 x 64 entries and a ragged tail)."""
    rng = np.random.default_rng(9)
    x = (rng.standard_normal(512 * 64 * 64 + 12_345) * 1e-3 + 1e-6).astype(F32)
    hvd_sparse.set_kernels("auto")
    assert same(get_backend("torch").mean_std(torch.from_numpy(x)), get_backend("numpy").mean_std(x))


def selections(algorithm, x: np.ndarray) -> dict[str, np.ndarray]:
    """Gaussian-k's local selection of x on every path."""
    from hvd_sparse.algorithms.base import StepContext

    def select(backend_name, array):
        backend = get_backend(backend_name)
        ctx = StepContext(rank=0, size=1, step=0, key="t", numel=x.size, backend=backend)
        idx = algorithm.select_local(array, algorithm.init_control(ctx), ctx)
        return np.sort(np.asarray(backend.to_numpy(idx), dtype=np.int64))

    out = {"numpy": select("numpy", x.copy())}
    previous = hvd_sparse.kernels_mode()
    try:
        for mode in ("auto", "off"):
            hvd_sparse.set_kernels(mode)
            out[f"torch-{mode}"] = select("torch", torch.from_numpy(x.copy()))
    finally:
        hvd_sparse.set_kernels(previous)
    try:
        import tensorflow as tf
    except ImportError:
        return out
    out["tensorflow"] = select("tensorflow", tf.constant(x))
    return out


@pytest.mark.parametrize("variant", ["original", "rescale"])
@pytest.mark.parametrize("data", ["cauchy", "student", "gaussian", "two-scales", "negative-mean", "outliers"])
def test_gaussiank_refinement_matches_the_mask_reference_on_every_path(variant, data):
    """The refinement (kept candidates implicit while they are the whole vector less those kept)
    against the mask form of the authors' loop, with μ and σ of the exact definition."""
    from hvd_sparse.algorithms import GaussianK
    from tests.reference.gaussiank import gaussiank_original, gaussiank_rescale

    rng = np.random.default_rng(len(data))
    n = 20_000
    x = {"cauchy": rng.standard_cauchy(n), "student": rng.standard_t(2.0, n),
         "gaussian": rng.standard_normal(n),
         "two-scales": np.where(rng.random(n) < 0.01, 1e3, 1e-3) * rng.standard_normal(n),
         "negative-mean": rng.standard_normal(n) - 30.0,
         "outliers": np.where(np.arange(n) % 2000 == 7, 1e6, 1e-3 * rng.standard_normal(n))}[data].astype(F32)
    reference = gaussiank_original if variant == "original" else gaussiank_rescale
    expected = reference(x, 0.01)
    for path, got in selections(GaussianK(0.01, variant=variant), x).items():
        assert np.array_equal(got, expected), (path, got.size, expected.size)


def fraction_mean_std(n: int, shift: float, t1: float, t2: float, depth: int):
    """``certain_mean_std`` with its float64 decision taken away: the Fractions alone."""
    original = numerics.float_mean_std
    numerics.float_mean_std = lambda *args: None
    try:
        return numerics.certain_mean_std(n, shift, t1, t2, depth)
    finally:
        numerics.float_mean_std = original


def test_float64_decision_is_the_fractions_decision(monkeypatch):
    """Where the float64 arithmetic decides, it decides as the exact Fractions do; near float32
    rounding boundaries (means and deviations a few float64 units from a float32 midpoint) it
    leaves them to the Fractions. Sums made up (not from data), so that every corner is reached."""
    rng = np.random.default_rng(5)
    decisions = []
    float_decision = numerics.float_mean_std
    monkeypatch.setattr(numerics, "float_mean_std", lambda *args: decisions.append(float_decision(*args))
                        or decisions[-1])
    for _ in range(3000):
        n = int(rng.integers(2, 10 ** 7))
        depth = int(rng.integers(1, 40))
        scale = 10.0 ** rng.uniform(-30, 20)
        mean = rng.standard_normal() * scale
        std = abs(rng.standard_normal()) * scale * 10.0 ** rng.uniform(-3, 3)
        if rng.random() < 0.5:   # put the mean next to a float32 midpoint
            m = F32(mean)
            midpoint = (float(m) + float(np.nextafter(m, F32(np.inf)))) / 2
            mean = midpoint * (1 + rng.integers(-4, 5) * 2.0 ** -53)
        shift = float(F32(mean + std * rng.standard_normal()))
        t1 = (mean - shift) * n
        t2 = std * std * (n - 1) + t1 * t1 / n
        got = numerics.certain_mean_std(n, shift, t1, t2, depth)
        if decisions[-1] is not None:   # the float64 arithmetic decided: as the Fractions do
            assert same(got, fraction_mean_std(n, shift, t1, t2, depth)), (n, shift, t1, t2, depth)
    assert sum(d is not None for d in decisions) > 1000
