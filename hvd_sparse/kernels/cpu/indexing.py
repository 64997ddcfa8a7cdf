"""CPU index writes (indexing.cpp): zeroing a residual at the sent indices and writing averaged
values into the gradients, with int32 or int64 indices as they come -- the reference ops copy int32
indices to int64 first, the step's largest temporary when a selection is large.

Returns None for arguments it has no kernel for (a tensor not a contiguous fp32/fp64 CPU vector,
values not fp32, indices not int32/int64): the caller then runs the reference ops.
"""

from __future__ import annotations

import ctypes

import torch

from ._library import bind, value_index_types

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_TYPES = value_index_types()
_ZERO = {(value, index): bind(f"hvd_sparse_zero_at_{v}_{i}", ctypes.c_int, [_ptr, _i64, _ptr, _i64])
         for value, v, index, i in _TYPES}
_PUT = {(value, index): bind(f"hvd_sparse_put_at_{v}_{i}", ctypes.c_int, [_ptr, _i64, _ptr, _i64, _i64, _ptr])
        for value, v, index, i in _TYPES}


def _vector(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dim() == 1 and x.is_contiguous()


def zero_at(x: torch.Tensor, idx: torch.Tensor) -> bool | None:
    """x[idx] = 0 in place."""
    function = _ZERO.get((x.dtype, idx.dtype))
    if function is None or not (_vector(x) and _vector(idx)):
        return None
    if function(x.data_ptr(), x.numel(), idx.data_ptr(), idx.numel()):
        raise IndexError(f"zero_at: an index falls outside a vector of {x.numel()} entries")
    return True


def put_at(x: torch.Tensor, idx: torch.Tensor, values: torch.Tensor, offset: int = 0) -> bool | None:
    """x[idx - offset] = values (fp32, converted exactly to x's dtype) in place."""
    function = _PUT.get((x.dtype, idx.dtype))
    if (function is None or values.dtype != torch.float32 or values.numel() != idx.numel()
            or not (_vector(x) and _vector(idx) and _vector(values))):
        return None
    if function(x.data_ptr(), x.numel(), idx.data_ptr(), idx.numel(), offset, values.data_ptr()):
        raise IndexError(f"put_at: an index falls outside a vector of {x.numel()} entries")
    return True
