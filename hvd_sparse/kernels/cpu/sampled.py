"""DGC's selection in one call (sampled.cpp), every segment of a vector at once: the threshold from
a strided sample, its adaptation passes and the exact top-k of an over-full selection, with the
decisions of the reference ``Backend.sampled_threshold_select`` (the same selection and top-k
kernels, the threshold rounded as NumPy rounds it). Returns None for arguments it has no kernel
for (a dtype other than fp32/fp64, a tensor not on the CPU or not a vector, a plan the kernel
does not take): the caller then runs the reference ops.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from ...backends.contract import SampledSegment, ThresholdBand, sampled_plan_fits
from ._library import bind

_i64, _ptr, _int, _double = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_double
_select = bind("hvd_sparse_sampled_threshold_select", _i64,
               [_ptr, _int, _i64, _ptr, _i64, _double, _double, _int, _ptr, _int, _ptr])
_CODES = {torch.float32: 2, torch.float64: 3}
_INDEX_BITS = {torch.int32: 32, torch.int64: 64}


def sampled_threshold_select(x: torch.Tensor, segments: list[SampledSegment], band: ThresholdBand,
                             index_dtype: torch.dtype = torch.int64
                             ) -> tuple[torch.Tensor, list[float]] | None:
    """(indices, a threshold per segment) of ``Backend.sampled_threshold_select``."""
    n = x.numel()
    if (x.device.type != "cpu" or x.dtype not in _CODES or x.dim() != 1 or index_dtype not in _INDEX_BITS
            or not segments or not sampled_plan_fits(segments, n)):
        return None
    flat = x if x.is_contiguous() else x.contiguous()
    plan = np.ascontiguousarray(np.asarray(segments, np.int64).reshape(-1))
    room = torch.empty(n, dtype=index_dtype)
    thresholds = np.empty(len(segments), np.float64)
    selected = _select(flat.data_ptr(), _CODES[x.dtype], n, plan.ctypes.data, len(segments), band.upper,
                       band.lower, int(band.resample), room.data_ptr(), _INDEX_BITS[index_dtype],
                       thresholds.ctypes.data)
    if selected == -2:
        raise MemoryError(f"sampled threshold kernel: out of memory selecting from {n} entries")
    if selected < 0:
        raise RuntimeError(f"sampled threshold kernel refused its arguments (n={n}, segments={segments}, "
                           f"status {selected})")
    # A short selection is copied out so the buffer (room for all of x) is freed.
    return (room[:selected] if 2 * selected > n else room[:selected].clone()), thresholds.tolist()
