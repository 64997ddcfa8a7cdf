"""CPU kernel of the Adam path's dense steps (adam.cpp): Adam's moments of an averaged gradient and
the update they give in one pass, with the reference ``Backend.adam_update``'s result bit for bit.

Returns None for arguments it has no kernel for (anything but contiguous CPU vectors of one dtype,
fp32 or fp64, of one length): the caller then runs the reference ops.
"""

from __future__ import annotations

import ctypes

import torch

from ._library import bind

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_FUNCTIONS = {dtype: bind(f"hvd_sparse_adam_update_{name}", ctypes.c_int,
                          [_ptr, _ptr, _ptr, _ptr, _i64, ctypes.POINTER(ctypes.c_double)])
              for dtype, name in ((torch.float32, "f32"), (torch.float64, "f64"))}


def adam_update(average: torch.Tensor, first: torch.Tensor, second: torch.Tensor, beta1: float, beta2: float,
                first_scale: float, second_scale: float, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """m = m·b1 + a·(1 - b1), v = v·b2 + (a·a)·(1 - b2) in place, and the update
    (m·c1) / (sqrt(v·c2) + eps) written over ``average``: (update, m, v)."""
    function = _FUNCTIONS.get(average.dtype)
    vectors = (average, first, second)
    if function is None or any(v.device.type != "cpu" or v.dtype != average.dtype or v.dim() != 1
                               or not v.is_contiguous() or v.numel() != average.numel() for v in vectors):
        return None
    constants = (ctypes.c_double * 7)(beta1, 1.0 - beta1, beta2, 1.0 - beta2, first_scale, second_scale, eps)
    if function(average.data_ptr(), first.data_ptr(), second.data_ptr(), average.data_ptr(), average.numel(),
                constants):
        raise RuntimeError("adam_update kernel refused its arguments")
    return average, first, second
