"""DGC's selection in one call (sampled.cpp): the threshold from a strided sample, its adaptation
passes and the exact top-k of an over-full selection, with the decisions of the reference
``Backend.sampled_threshold_select`` (the same selection and top-k kernels, the threshold rounded
as NumPy rounds it). Returns None for arguments it has no kernel for (a dtype other than
fp32/fp64, a tensor not on the CPU or not a vector): the caller then runs the reference ops.
"""

from __future__ import annotations

import ctypes

import torch

from ...backends.contract import ThresholdBand
from ._library import bind

_i64, _ptr, _int, _double = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_double
_select = bind("hvd_sparse_sampled_threshold_select", _i64,
               [_ptr, _int, _i64, _i64, _i64, _i64, _i64, _double, _double, _i64, _int, _ptr, _int,
                ctypes.POINTER(_double)])
_CODES = {torch.float32: 2, torch.float64: 3}
_INDEX_BITS = {torch.int32: 32, torch.int64: 64}


def sampled_threshold_select(x: torch.Tensor, k: int, start: int, stride: int, top: int,
                             band: ThresholdBand, index_dtype: torch.dtype = torch.int64
                             ) -> tuple[torch.Tensor, float] | None:
    """(ascending indices, final threshold) of ``Backend.sampled_threshold_select``."""
    n = x.numel()
    if (x.device.type != "cpu" or x.dtype not in _CODES or x.dim() != 1 or index_dtype not in _INDEX_BITS
            or not 1 <= k <= n or stride < 1):
        return None
    flat = x if x.is_contiguous() else x.contiguous()
    room = torch.empty(n, dtype=index_dtype)
    threshold = _double()
    selected = _select(flat.data_ptr(), _CODES[x.dtype], n, k, start, stride, top, band.upper, band.lower,
                       band.iterations, int(band.resample), room.data_ptr(), _INDEX_BITS[index_dtype],
                       ctypes.byref(threshold))
    if selected == -2:
        raise MemoryError(f"sampled threshold kernel: out of memory selecting from {n} entries")
    if selected < 0:
        raise RuntimeError(f"sampled threshold kernel refused its arguments (n={n}, k={k}, start={start}, "
                           f"stride={stride}, top={top}, status {selected})")
    # A short selection is copied out so the buffer (room for all of x) is freed.
    return (room[:selected] if 2 * selected > n else room[:selected].clone()), threshold.value
