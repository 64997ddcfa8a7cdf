"""CPU segment norms and moments (norms.cpp): DEFT's per-unit L2 norms and Gaussian-k's mean and
standard deviation, each in one read of the accumulated vector. The norms are
the result of the reference ``segment_norms`` bit for bit: the float64 sums come from the
kernel, whose rounding depth is known, and ``float32_norms`` (hvd_sparse/backends/base.py) turns
them into float32 norms exactly as every backend does (an exact sum where a sum cannot decide);
``mean_std`` likewise goes through ``mean_std_from_sums``.

Returns None for arguments it has no kernel for (not an fp32/fp64 CPU tensor, lengths that do not
add up to its size): the caller then runs the reference ops.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from ...backends.base import float32_norms, mean_std_from_sums
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
    return mean_std_from_sums(flat.numel(), shift, t1, t2, _moments_depth(flat.numel()), flat.numpy)
