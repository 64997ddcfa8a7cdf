"""CPU ops of the threshold methods' step: finite check, error-feedback accumulation, and the fused
accumulate-and-select (accumulate.cpp), with the semantics of the torch reference path.

Each op returns None for arguments it has no kernel for (a dtype outside fp16/bf16/fp32/fp64, a
residual that is not a contiguous fp32/fp64 CPU vector): the caller then runs the reference ops.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from ...backends.base import sample_shape
from ._library import bind

_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
_RESIDUAL_TYPES = {torch.float32: np.float32, torch.float64: np.float64}
_INDEX_BITS = {torch.int32: 32, torch.int64: 64}

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_all_finite = bind("hvd_sparse_all_finite", ctypes.c_int, [_ptr, _i64, ctypes.c_int])
_accumulate_select = bind(
    "hvd_sparse_accumulate_select", _i64,
    [_ptr, ctypes.c_int, ctypes.POINTER(_ptr), ctypes.POINTER(ctypes.c_int), ctypes.POINTER(_i64),
     ctypes.c_int, ctypes.c_int, _i64, _i64, ctypes.c_double, _ptr, ctypes.c_int,
     ctypes.POINTER(ctypes.c_double), ctypes.c_int, _i64, _i64, _i64, ctypes.POINTER(_i64)])
MAX_PROBES = 8


def _handled(tensors: list[torch.Tensor]) -> bool:
    return all(t.device.type == "cpu" and t.dtype in _CODES for t in tensors)


def all_finite(tensors: list[torch.Tensor]) -> bool | None:
    """Whether no tensor holds NaN or Inf (read-only, stops at the first chunk that does)."""
    if not _handled(tensors):
        return None
    for t in tensors:
        flat = t.contiguous()
        if not _all_finite(flat.data_ptr(), flat.numel(), _CODES[t.dtype]):
            return False
    return True


def accumulate(residual: torch.Tensor, tensors: list[torch.Tensor], clear_inputs: bool) -> bool | None:
    """residual += concat(flattened tensors) in one pass, zeroing the inputs with ``clear_inputs``."""
    done = _run(residual, tensors, clear_inputs, 0, 0, 0.0, [], 1, torch.int64)
    return None if done is None else True


def accumulate_select(residual: torch.Tensor, tensors: list[torch.Tensor], lo: int, hi: int,
                      threshold: float, probes: list[float], every: int, index_dtype: torch.dtype,
                      clear_inputs: bool) -> tuple[torch.Tensor, list[float]] | None:
    """``accumulate``, and in the same pass the ascending indices in [lo, hi) with |a| >= threshold
    (rounded to the residual's dtype) and the probe counts of ``count_at_least``."""
    return _run(residual, tensors, clear_inputs, lo, hi, threshold, probes, every, index_dtype)


def accumulate_select_if_finite(residual: torch.Tensor, tensors: list[torch.Tensor], lo: int, hi: int,
                                threshold: float, probes: list[float], every: int,
                                index_dtype: torch.dtype, clear_inputs: bool
                                ) -> tuple[bool, torch.Tensor, list[float]] | None:
    """(finite, idx, probe_counts): ``all_finite``, then ``accumulate_select``. When an input
    holds NaN/Inf nothing is written (residual and inputs keep their values), idx is empty and the
    counts are 0."""
    finite = all_finite(tensors)
    if finite is None:
        return None
    if not finite:
        return False, torch.zeros(0, dtype=index_dtype), [0.0] * len(probes)
    done = accumulate_select(residual, tensors, lo, hi, threshold, probes, every, index_dtype, clear_inputs)
    return None if done is None else (True, *done)


def _run(residual, tensors, clear_inputs, lo, hi, threshold, probes, every, index_dtype):
    if (residual.device.type != "cpu" or residual.dtype not in _RESIDUAL_TYPES or residual.dim() != 1
            or not residual.is_contiguous() or not _handled(tensors) or index_dtype not in _INDEX_BITS
            or len(probes) > MAX_PROBES or sum(t.numel() for t in tensors) != residual.numel()
            or not 0 <= lo <= hi <= residual.numel()):
        return None
    flats = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    count = len(flats)
    pointers = (_ptr * count)(*[t.data_ptr() for t in flats])
    dtypes = (ctypes.c_int * count)(*[_CODES[t.dtype] for t in flats])
    sizes = (_i64 * count)(*[t.numel() for t in flats])
    # Thresholds rounded to the residual's dtype, as NumPy and torch round a Python float they
    # compare an array with.
    kind = _RESIDUAL_TYPES[residual.dtype]
    length = hi - lo
    rounded = (ctypes.c_double * max(len(probes), 1))(*[float(kind(p)) for p in probes])
    counts = (_i64 * max(len(probes), 1))()
    shape = sample_shape(length, every)
    row_len, sample_end = (0, 0) if shape is None else (shape[1], shape[0] * shape[1])
    out = torch.empty(length, dtype=index_dtype)
    selected = _accumulate_select(
        residual.data_ptr(), _CODES[residual.dtype], pointers, dtypes, sizes, count,
        int(clear_inputs), lo, hi, float(kind(threshold)), out.data_ptr(), _INDEX_BITS[index_dtype],
        rounded, len(probes), row_len, every, sample_end, counts)
    if selected < 0:
        return None
    if clear_inputs:   # inputs read through a contiguous copy were cleared in the copy only
        for t, flat in zip(tensors, flats, strict=True):
            if flat is not t:
                t.zero_()
    sampled = length if shape is None else len(range(0, shape[0], every)) * shape[1]
    # The reference's scaling, operation for operation (count_at_least).
    scaled = [float(c) * length / sampled if sampled else 0.0 for c in counts[:len(probes)]]
    # A short selection is copied out so the buffer (room for the whole range) is freed.
    return (out[:selected] if 2 * selected > length else out[:selected].clone()), scaled
