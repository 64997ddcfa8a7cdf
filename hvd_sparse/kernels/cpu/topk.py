"""CPU exact top-k by magnitude (topk.cpp): the k entries of largest |x| as ascending indices, with
the tie rule of the reference op ``topk_abs_indices`` (backends/base.py; its keys: backends/exact.py),
in about one read of x and no full-size temporary.

Returns None for arguments it has no kernel for (a dtype other than fp32/fp64, a tensor not on the
CPU, k outside [0, numel]): the caller then runs the reference ops. fp16/bf16 gradients reach
selection through the fp32 residual, so they take the kernel there.
"""

from __future__ import annotations

import ctypes

import torch

from ._library import bind, value_index_types

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_FUNCTIONS = {(value, index): bind(f"hvd_sparse_topk_abs_{v}_{i}", ctypes.c_int, [_ptr, _i64, _i64, _ptr])
              for value, v, index, i in value_index_types()}


def topk_abs(x: torch.Tensor, k: int, index_dtype: torch.dtype = torch.int64) -> torch.Tensor | None:
    """Ascending indices (``index_dtype``: int32 or int64) of the k entries of largest magnitude
    of x (flattened); 0 <= k <= numel. Ties at the k-th magnitude: the lowest indices."""
    function = _FUNCTIONS.get((x.dtype, index_dtype))
    n = x.numel()
    if function is None or x.device.type != "cpu" or not 0 <= k <= n:
        return None
    if index_dtype == torch.int32 and n > 2**31:
        raise ValueError(f"int32 indices cannot address {n} entries: use int64")
    flat = x.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.empty(k, dtype=index_dtype)
    status = function(flat.data_ptr(), n, k, out.data_ptr())
    if status == -2:
        raise MemoryError(f"top-k kernel: out of memory selecting {k} of {n} entries")
    if status != 0:
        raise RuntimeError(f"top-k kernel refused its arguments (n={n}, k={k}, status {status})")
    return out
