"""CPU segment norms and moments (norms.cpp): DEFT's per-unit L2 norms and Gaussian-k's mean and
standard deviation, each in one read of the accumulated vector. The norms are
the result of the reference ``segment_norms`` bit for bit: the float64 sums come from the
kernel, whose rounding depth is known, and ``float32_norms`` (hvd_sparse/backends/exact.py) turns
them into float32 norms exactly as every backend does (an exact sum where a sum cannot decide);
``mean_std`` likewise goes through ``mean_std_from_sums``, whose exact fallback for fp32 is the
native ``exact_mean_std`` here (integer sums per exponent) rather than NumPy's.

Returns None for arguments it has no kernel for (not an fp32/fp64 CPU tensor, lengths that do not
add up to its size): the caller then runs the reference ops.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from ...backends.exact import exact_mean_std as base_exact_mean_std
from ...backends.exact import float32_norms, mean_std_from_integers, mean_std_from_sums
from ._library import bind

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_FUNCTIONS = {dtype: bind(f"hvd_sparse_segment_sumsq_{name}", ctypes.c_int, [_ptr, _ptr, _i64, _ptr])
              for dtype, name in ((torch.float32, "f32"), (torch.float64, "f64"))}
_depth = bind("hvd_sparse_segment_sumsq_depth", _i64, [_i64])


def segment_norms(x: torch.Tensor, lengths: list[int]) -> np.ndarray | None:
    """L2 norm of each consecutive segment of x (flattened), rounded to float32, as float64."""
    function = _FUNCTIONS.get(x.dtype)
    if (function is None or x.device.type != "cpu" or any(length < 0 for length in lengths)
            or sum(lengths) != x.numel()):
        return None
    flat = x.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    sizes = np.ascontiguousarray(lengths, dtype=np.int64)
    sums = np.zeros(len(lengths), dtype=np.float64)
    if function(flat.data_ptr(), sizes.ctypes.data, len(lengths), sums.ctypes.data) != 0:
        raise RuntimeError(f"segment norms kernel refused its arguments ({len(lengths)} segments)")
    starts = np.cumsum([0, *lengths]).tolist()
    return float32_norms(sums.tolist(), [_depth(length) for length in lengths],
                         lambda i: flat[starts[i]:starts[i + 1]].numpy())


_MOMENTS = {dtype: bind(f"hvd_sparse_moments_{name}", ctypes.c_int, [_ptr, _i64, _ptr])
            for dtype, name in ((torch.float32, "f32"), (torch.float64, "f64"))}
_moments_depth = bind("hvd_sparse_moments_depth", _i64, [_i64])


def mean_std(x: torch.Tensor) -> tuple[float, float] | None:
    """The reference ``mean_std`` (float32 mean and sample standard deviation, exactly rounded from
    the exact sums) from the kernel's shifted float64 sums, one read of x."""
    function = _MOMENTS.get(x.dtype)
    if function is None or x.device.type != "cpu" or x.numel() < 2:
        return None
    flat = x.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    sums = np.zeros(3, dtype=np.float64)
    if function(flat.data_ptr(), flat.numel(), sums.ctypes.data) != 0:
        raise RuntimeError(f"moments kernel refused its arguments ({flat.numel()} entries)")
    shift, t1, t2 = sums.tolist()
    return mean_std_from_sums(flat.numel(), shift, t1, t2, _moments_depth(flat.numel()), lambda: flat,
                              exact_mean_std)


_exact_sums = bind("hvd_sparse_exact_sums_f32", ctypes.c_int, [_ptr, _i64, _ptr])
EXACT_CHUNK = 1 << 25   # entries per call: no bin of the native exact sums can overflow


def exact_mean_std(x: torch.Tensor) -> tuple[float, float]:
    """``base.exact_mean_std`` of a CPU tensor, for fp32 from the native exact sums (a few
    nanoseconds an entry instead of NumPy's few hundred); other dtypes, and vectors holding
    NaN/Inf, through NumPy."""
    flat = x.reshape(-1).contiguous()
    n = flat.numel()
    if flat.dtype != torch.float32 or n == 0:
        return base_exact_mean_std(flat.numpy())
    bins = np.zeros((256, 4), dtype=np.int64)
    s1 = s2 = 0
    for start in range(0, n, EXACT_CHUNK):
        piece = flat[start:start + EXACT_CHUNK]
        status = _exact_sums(piece.data_ptr(), piece.numel(), bins.ctypes.data)
        if status == 1:   # NaN/Inf
            return base_exact_mean_std(flat.numpy())
        if status != 0:
            raise RuntimeError(f"exact sums kernel refused its arguments ({piece.numel()} entries)")
        for exponent, (m, high, cross, low) in enumerate(bins.tolist()):
            if exponent:   # entry = ±M·2^(E'-150) = (M << E'-1)·2^-149
                s1 += m << (exponent - 1)
                s2 += ((high << 24) + (cross << 12) + low) << (2 * (exponent - 1))
    return mean_std_from_integers(n, s1, s2, -149)
