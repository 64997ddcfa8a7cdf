"""The two builds of the native CPU library (baseline and x86-64-v3): which one loads, the switch
that forces the baseline, and the same results from both on the hot entry points, bit for bit.
(`make test` also runs every kernel test again with HVD_SPARSE_CPU_LEVEL=baseline.)"""

from __future__ import annotations

import ctypes
import subprocess
import sys

import numpy as np
import pytest

from hvd_sparse.kernels.cpu import _library

BASELINE = _library.library_path(_library.STEM)
V3 = _library.library_path(_library.STEM_V3)
CPU_LEVEL = ctypes.CDLL(str(BASELINE)).hvd_sparse_x86_64_level() if BASELINE else 0
needs_v3 = pytest.mark.skipif(CPU_LEVEL < 3 or V3 is None, reason="no x86-64-v3 CPU or build here")


def loaded_level(level: str | None) -> subprocess.CompletedProcess:
    env = {} if level is None else {_library.LEVEL_ENVIRONMENT: level}
    code = "from hvd_sparse.kernels.cpu import _library; print(_library.level())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_the_cpu_level_picks_the_build():
    out = loaded_level(None)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("x86-64-v3" if CPU_LEVEL >= 3 and V3 else "baseline")
    out = loaded_level("baseline")
    assert out.returncode == 0 and out.stdout.strip() == "baseline", out.stderr


def test_an_unknown_level_fails_naming_the_variable():
    out = loaded_level("avx9")
    assert out.returncode != 0 and "HVD_SPARSE_CPU_LEVEL" in out.stderr and "avx9" in out.stderr


def _pointer(array: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(array.ctypes.data)


def _accumulate_select(lib: ctypes.CDLL, residual: np.ndarray, grad: np.ndarray, clear: int,
                       threshold: float, probes: list[float]):
    """hvd_sparse_accumulate_select over [n/4, 3n/4) with probe counts on every 3rd row of 100."""
    residual, grad = residual.copy(), grad.copy()
    n = residual.size
    out = np.zeros(n, dtype=np.int32)
    counts = (ctypes.c_int64 * 8)()
    inputs = (ctypes.c_void_p * 1)(grad.ctypes.data)
    fn = lib.hvd_sparse_accumulate_select
    fn.restype = ctypes.c_int64
    selected = fn(_pointer(residual), 2, inputs, (ctypes.c_int * 1)(2), (ctypes.c_int64 * 1)(n), 1, clear,
                  ctypes.c_int64(n // 4), ctypes.c_int64(3 * n // 4), ctypes.c_double(threshold),
                  _pointer(out), 32, (ctypes.c_double * 8)(*probes), len(probes), ctypes.c_int64(100),
                  ctypes.c_int64(3), ctypes.c_int64(n // 2 // 100 * 100), counts)
    return selected, out[:max(selected, 0)], residual, grad, list(counts)


def _topk(lib: ctypes.CDLL, x: np.ndarray, k: int) -> np.ndarray:
    out = np.zeros(k, dtype=np.int32)
    fn = lib.hvd_sparse_topk_abs_f32_i32
    assert fn(_pointer(x), ctypes.c_int64(x.size), ctypes.c_int64(k), _pointer(out)) == 0
    return out


@needs_v3
@pytest.mark.parametrize("kind", ["heavy", "ties", "nonfinite"])
def test_both_builds_compute_the_same_bits(kind):
    baseline, v3 = ctypes.CDLL(str(BASELINE)), ctypes.CDLL(str(V3))
    rng = np.random.default_rng(7)
    n = 100_003
    grad = (rng.standard_t(3, n) * 1e-3).astype(np.float32)
    residual = (rng.standard_t(3, n) * 1e-3).astype(np.float32)
    if kind == "ties":
        grad[:] = np.float32(1e-3)
    if kind == "nonfinite":
        grad[n // 3], grad[2 * n // 3] = np.nan, -np.inf
    for clear in (0, 1):
        a = _accumulate_select(baseline, residual, grad, clear, 2e-3, [1e-3, 3e-3, 1e-2])
        b = _accumulate_select(v3, residual, grad, clear, 2e-3, [1e-3, 3e-3, 1e-2])
        assert a[0] == b[0] and a[4] == b[4]
        for x, y in zip(a[1:4], b[1:4], strict=True):
            assert x.tobytes() == y.tobytes()
    if kind != "nonfinite":
        for k in (0, 1, 999, n):
            assert _topk(baseline, grad, k).tobytes() == _topk(v3, grad, k).tobytes()
