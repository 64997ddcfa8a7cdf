"""CPU momentum correction (momentum.cpp): DGC's gradient accumulation into its momentum and
residual in one pass, instead of a gradient vector and four passes of torch ops, with the
reference ``Backend.momentum_accumulate``'s result bit for bit.

Returns None for arguments it has no kernel for (inputs of another dtype than the residual's,
anything not a contiguous fp32/fp64 CPU vector): the caller then runs the reference ops.
"""

from __future__ import annotations

import ctypes

import torch

from ...backends.contract import Velocity
from ._library import bind

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_FUNCTIONS = {dtype: bind(f"hvd_sparse_momentum_{name}", ctypes.c_int,
                          [_ptr, _ptr, ctypes.POINTER(_ptr), ctypes.POINTER(_i64), _i64, ctypes.c_double,
                           ctypes.c_int])
              for dtype, name in ((torch.float32, "f32"), (torch.float64, "f64"))}


def momentum_accumulate(residual: torch.Tensor, momentum: torch.Tensor, tensors: list[torch.Tensor],
                        factor: float, nesterov: bool) -> Velocity | None:
    """u = u·m + g, r = r + u (nesterov: u = (u + g)·m, r = r + u + g), in place: (r, u)."""
    function = _FUNCTIONS.get(residual.dtype)
    vectors = (residual, momentum)
    if (function is None or any(v.device.type != "cpu" or v.dtype != residual.dtype or v.dim() != 1
                                or not v.is_contiguous() for v in vectors)
            or momentum.numel() != residual.numel()
            or any(t.device.type != "cpu" or t.dtype != residual.dtype for t in tensors)
            or sum(t.numel() for t in tensors) != residual.numel()):
        return None
    flats = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    pointers = (_ptr * len(flats))(*[t.data_ptr() for t in flats])
    sizes = (_i64 * len(flats))(*[t.numel() for t in flats])
    if function(residual.data_ptr(), momentum.data_ptr(), pointers, sizes, len(flats), factor, int(nesterov)):
        raise RuntimeError("momentum kernel refused its arguments")
    return Velocity(residual, momentum)
