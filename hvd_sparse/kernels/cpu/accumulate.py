"""CPU ops of the threshold methods' step: finite check, error-feedback accumulation, the fused
accumulate-and-select (with the momentum correction or the Adam path too), the same selection on
an accumulated vector, and accumulation with Gaussian-k's moments or DEFT's segment norms taken
in the same pass (accumulate.cpp), with the semantics of the torch reference path.

Each op returns None for arguments it has no kernel for (a dtype outside fp16/bf16/fp32/fp64, a
residual that is not a contiguous fp32/fp64 CPU vector): the caller then runs the reference ops.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from ...backends.contract import Moments, Norms, Selected, Velocity, adam_constants
from ...backends.exact import KernelSelection, float32_norms, mean_std_from_sums
from ._library import bind
from .norms import exact_mean_std

_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
_RESIDUAL_TYPES = {torch.float32: np.float32, torch.float64: np.float64}
_INDEX_BITS = {torch.int32: 32, torch.int64: 64}

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_all_finite = bind("hvd_sparse_all_finite", ctypes.c_int, [_ptr, _i64, ctypes.c_int])
_INPUTS = [_ptr, ctypes.c_int, ctypes.POINTER(_ptr), ctypes.POINTER(ctypes.c_int), ctypes.POINTER(_i64),
           ctypes.c_int, ctypes.c_int]   # residual, its dtype, the inputs, their dtypes and sizes, clear
# threshold, out, index bits, probes, their number, row_len, every, sample_end, counts
_SELECTION = [ctypes.c_double, _ptr, ctypes.c_int, ctypes.POINTER(ctypes.c_double), ctypes.c_int, _i64, _i64,
              _i64, ctypes.POINTER(_i64)]
_accumulate_select = bind("hvd_sparse_accumulate_select", _i64, [*_INPUTS, _i64, _i64, *_SELECTION])
_accumulate_moments = bind("hvd_sparse_accumulate_moments", ctypes.c_int,
                           [*_INPUTS, ctypes.POINTER(ctypes.c_double), ctypes.POINTER(_i64)])
_accumulate_norms = bind("hvd_sparse_accumulate_norms", ctypes.c_int,
                         [*_INPUTS, _ptr, _i64, _ptr, _ptr])
_accumulate_segment_moments = bind("hvd_sparse_accumulate_segment_moments", ctypes.c_int,
                                   [*_INPUTS, _ptr, _i64, _ptr, _ptr])
_momentum_accumulate_select = bind(
    "hvd_sparse_momentum_accumulate_select", _i64,
    [*_INPUTS, _ptr, ctypes.c_double, ctypes.c_int, ctypes.c_int, _i64, _i64, *_SELECTION])
_adam_accumulate_select = bind(
    "hvd_sparse_adam_accumulate_select", _i64,
    [*_INPUTS, _ptr, _ptr, ctypes.POINTER(ctypes.c_double), ctypes.c_int, _i64, _i64, *_SELECTION])
_select_at_least = bind("hvd_sparse_select_at_least", _i64, [_ptr, ctypes.c_int, _i64, _i64, *_SELECTION])
_clear = bind("hvd_sparse_clear", None, [_ptr, _i64])
MAX_PROBES = 8
CHECK_AND_CLEAR = 2      # the kernel's ``clear``: check the inputs in the pass, then zero them
_NOT_FINITE_CODE = -2    # ... and what it returns when one holds NaN/Inf
NOT_FINITE = object()


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


def clear(tensors: list[torch.Tensor]) -> bool | None:
    """Every tensor set to zero (+0.0, as ``zero_``) in place, large ones faster than ``zero_``."""
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return None
    for t in tensors:
        _clear(t.data_ptr(), t.numel() * t.element_size())
    return True


def accumulate(residual: torch.Tensor, tensors: list[torch.Tensor], clear_inputs: bool
               ) -> torch.Tensor | None:
    """residual += concat(flattened tensors) in one pass, zeroing the inputs with ``clear_inputs``;
    the residual."""
    done = _run(residual, tensors, clear_inputs, 0, 0, 0.0, [], 1, torch.int64)
    return None if done is None else residual


def accumulate_select(residual: torch.Tensor, tensors: list[torch.Tensor], lo: int, hi: int,
                      threshold: float, probes: list[float], every: int, index_dtype: torch.dtype,
                      clear_inputs: bool) -> Selected | None:
    """``accumulate``, and in the same pass the ascending indices in [lo, hi) with |a| >= threshold
    (rounded to the residual's dtype) and the probe counts of ``count_at_least``."""
    done = _run(residual, tensors, clear_inputs, lo, hi, threshold, probes, every, index_dtype)
    if done is None:
        return None
    idx, counts = done
    return Selected(residual, idx, counts, True)


def accumulate_select_if_finite(residual: torch.Tensor, tensors: list[torch.Tensor], lo: int, hi: int,
                                threshold: float, probes: list[float], every: int,
                                index_dtype: torch.dtype, clear_inputs: bool) -> Selected | None:
    """``all_finite``, then ``accumulate_select``. When an input holds NaN/Inf the residual keeps
    its values and the result is not finite (idx None, no counts); the inputs
    keep theirs too, except with ``clear_inputs``, when their contents are unspecified (the caller
    overwrites them).

    With ``clear_inputs`` and every input a contiguous vector of the residual's dtype, the check
    is made in the accumulating pass itself: the pass keeps the residual's old values in the
    inputs it reads (a write that zeroing them cost anyway), restores the residual from them at
    the first NaN/Inf, and zeroes the inputs after a finite pass with streaming stores. That
    replaces a whole read of the gradient before the pass by a cheaper write after it."""
    if clear_inputs and _supported(residual, tensors) and all(
            t.dtype == residual.dtype and t.is_contiguous() for t in tensors):
        done = _run(residual, tensors, CHECK_AND_CLEAR, lo, hi, threshold, probes, every, index_dtype)
        if done is not None:
            if done is NOT_FINITE:
                return Selected(residual, None, [], False)
            idx, counts = done
            return Selected(residual, idx, counts, True)
    finite = all_finite(tensors)
    if finite is None:
        return None
    if not finite:
        return Selected(residual, None, [], False)
    return accumulate_select(residual, tensors, lo, hi, threshold, probes, every, index_dtype, clear_inputs)


def momentum_accumulate_select(residual: torch.Tensor, momentum: torch.Tensor, tensors: list[torch.Tensor],
                               factor: float, nesterov: bool, lo: int, hi: int, threshold: float,
                               probes: list[float], every: int, index_dtype: torch.dtype, clear_inputs: bool,
                               check_finite: bool) -> Selected | None:
    """``accumulate_select`` with the momentum correction, in one pass
    that reads u, the gradient and the residual and writes u and the residual: g = concat(tensors)
    in the residual's dtype, u = factor·u + g and residual += u (Nesterov: u = factor·(u + g) and
    residual = (residual + u) + g), each operation rounded as the reference
    ``Backend.momentum_accumulate`` rounds it, ``momentum`` (a contiguous vector of the residual's
    dtype and length) updated in place. With ``check_finite`` the inputs are read first: when one
    holds NaN/Inf nothing is written (residual, u and inputs keep their values) and the result is
    not finite (idx None, no counts)."""
    if (not _supported(residual, tensors) or index_dtype not in _INDEX_BITS or len(probes) > MAX_PROBES
            or not 0 <= lo <= hi <= residual.numel() or not _parallel(residual, momentum)):
        return None
    selection = _Selected(residual.dtype, lo, hi, threshold, probes, every, index_dtype)
    selected = _accumulating(residual, tensors, clear_inputs, _momentum_accumulate_select,
                             momentum.data_ptr(), float(factor), int(bool(nesterov)), int(bool(check_finite)),
                             lo, hi, *selection.arguments())
    if selected == _NOT_FINITE_CODE:
        return Selected(residual, None, [], False)
    return None if selected < 0 else Selected(residual, *selection.result(selected), True)


def adam_accumulate_select(residual: torch.Tensor, momentum: torch.Tensor, tensors: list[torch.Tensor],
                           factor: float, second: Any, lo: int, hi: int, threshold: float,
                           probes: list[float], every: int, index_dtype: torch.dtype, clear_inputs: bool,
                           check_finite: bool) -> Selected | None:
    """``accumulate_select`` on the Adam path, in one pass that reads u and v (Adam's moments,
    ``momentum`` and ``second.buffer``), the gradient and the residual and writes all but the
    gradient: g = concat(tensors) in the residual's dtype, u = factor·u + (1 - factor)·g,
    v = b2·v + (1 - b2)·g² (unless ``second.frozen``), residual += clamp((u·c1) / (sqrt(v·c2) +
    eps), bound), rounded as the reference ``Backend.adam_step`` rounds them (``second``: a
    ``SecondMoment``); u and v contiguous
    vectors of the residual's dtype and length. With ``check_finite`` the inputs are read first:
    when one holds NaN/Inf nothing is written and the result is not finite. lo == hi: the
    accumulation alone (no indices)."""
    if (not _supported(residual, tensors) or index_dtype not in _INDEX_BITS or len(probes) > MAX_PROBES
            or not 0 <= lo <= hi <= residual.numel()
            or not all(_parallel(residual, vector) for vector in (momentum, second.buffer))):
        return None
    selection = _Selected(residual.dtype, lo, hi, threshold, probes, every, index_dtype)
    constants = (ctypes.c_double * 9)(*adam_constants(factor, second))
    selected = _accumulating(residual, tensors, clear_inputs, _adam_accumulate_select, momentum.data_ptr(),
                             second.buffer.data_ptr(), constants, int(bool(check_finite)), lo, hi,
                             *selection.arguments())
    if selected == _NOT_FINITE_CODE:
        return Selected(residual, None, [], False)
    return None if selected < 0 else Selected(residual, *selection.result(selected), True)


def adam_accumulate(residual: torch.Tensor, momentum: torch.Tensor, tensors: list[torch.Tensor],
                    factor: float, second: Any) -> Velocity | None:
    """The reference ``Backend.adam_accumulate`` in one pass (``adam_accumulate_select`` without
    a selection): (residual, u), both moments updated in place."""
    done = adam_accumulate_select(residual, momentum, tensors, factor, second, 0, 0, 0.0, [], 1, torch.int64,
                                  False, False)
    return None if done is None else Velocity(residual, momentum)


def _parallel(residual: torch.Tensor, vector: torch.Tensor) -> bool:
    """A vector the kernels read beside the residual: on the CPU, its dtype, length and layout."""
    return (vector.device.type == "cpu" and vector.dtype == residual.dtype and vector.dim() == 1
            and vector.is_contiguous() and vector.numel() == residual.numel())


def _supported(residual: torch.Tensor, tensors: list[torch.Tensor]) -> bool:
    return (residual.device.type == "cpu" and residual.dtype in _RESIDUAL_TYPES and residual.dim() == 1
            and residual.is_contiguous() and _handled(tensors)
            and sum(t.numel() for t in tensors) == residual.numel())


def _accumulating(residual, tensors, clear_inputs, kernel, *rest):
    """``kernel(residual, its dtype, the inputs, their dtypes and sizes, clear, *rest)``, the inputs
    read through contiguous copies where they are not contiguous (and cleared afterwards)."""
    flats = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    count = len(flats)
    pointers = (_ptr * count)(*[t.data_ptr() for t in flats])
    dtypes = (ctypes.c_int * count)(*[_CODES[t.dtype] for t in flats])
    sizes = (_i64 * count)(*[t.numel() for t in flats])
    result = kernel(residual.data_ptr(), _CODES[residual.dtype], pointers, dtypes, sizes, count,
                    int(clear_inputs), *rest)
    if result >= 0 and clear_inputs:   # inputs read through a contiguous copy were cleared in the copy only
        for t, flat in zip(tensors, flats, strict=True):
            if flat is not t:
                t.zero_()
    return result


class _Selected:
    """The arguments and output buffer of a selection in [lo, hi) with probe counts
    (``exact.KernelSelection``), and its result."""

    def __init__(self, dtype: torch.dtype, lo: int, hi: int, threshold: float, probes: list[float],
                 every: int, index_dtype: torch.dtype):
        self.plan = plan = KernelSelection.of(_RESIDUAL_TYPES[dtype], lo, hi, threshold, probes, every)
        self.probes = len(probes)
        self.rounded = (ctypes.c_double * max(len(probes), 1))(*plan.probes)
        self.counts = (_i64 * max(len(probes), 1))()
        self.every = every
        self.out = torch.empty(plan.length, dtype=index_dtype)

    def arguments(self) -> tuple:
        """threshold, out, index bits, probes, num_probes, row_len, every, sample_end, counts."""
        plan = self.plan
        return (plan.threshold, self.out.data_ptr(), _INDEX_BITS[self.out.dtype], self.rounded, self.probes,
                plan.row_len, self.every, plan.sample_end, self.counts)

    def result(self, selected: int) -> tuple[torch.Tensor, list[float]]:
        scaled = self.plan.scale(self.counts[:self.probes])
        # A short selection is copied out so the buffer (room for the whole range) is freed.
        out = self.out
        return (out[:selected] if 2 * selected > self.plan.length else out[:selected].clone()), scaled


def _run(residual, tensors, clear, lo, hi, threshold, probes, every, index_dtype):
    """The fused op (clear: False/True, or CHECK_AND_CLEAR, which may return NOT_FINITE)."""
    if (not _supported(residual, tensors) or index_dtype not in _INDEX_BITS or len(probes) > MAX_PROBES
            or not 0 <= lo <= hi <= residual.numel()):
        return None
    selection = _Selected(residual.dtype, lo, hi, threshold, probes, every, index_dtype)
    threshold, out, bits, *rest = selection.arguments()
    selected = _accumulating(residual, tensors, clear, _accumulate_select, lo, hi, threshold, out,
                             bits, *rest)
    if selected == _NOT_FINITE_CODE:
        return NOT_FINITE
    return None if selected < 0 else selection.result(selected)


def select_at_least(x: torch.Tensor, lo: int, hi: int, threshold: float, probes: list[float], every: int,
                    index_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, list[float]] | None:
    """The reference ``select_at_least`` on an accumulated fp32/fp64 vector, in one read and no
    temporary of its size: the ascending indices i in [lo, hi) with |x_i| >= threshold (rounded to
    x's dtype; NaN never passes, Inf does) and the probe counts of ``count_at_least``."""
    if (x.device.type != "cpu" or x.dtype not in _RESIDUAL_TYPES or x.dim() != 1
            or index_dtype not in _INDEX_BITS or len(probes) > MAX_PROBES or not 0 <= lo <= hi <= x.numel()):
        return None
    flat = x if x.is_contiguous() else x.contiguous()
    selection = _Selected(x.dtype, lo, hi, threshold, probes, every, index_dtype)
    selected = _select_at_least(flat.data_ptr(), _CODES[x.dtype], lo, hi, *selection.arguments())
    return None if selected < 0 else selection.result(selected)


def abs_at_least(x: torch.Tensor, lo: int, hi: int, threshold: float,
                 index_dtype: torch.dtype = torch.int64) -> torch.Tensor | None:
    """``select_at_least`` without probes: the indices alone."""
    done = select_at_least(x, lo, hi, threshold, [], 1, index_dtype)
    return None if done is None else done[0]


def accumulate_moments(residual: torch.Tensor, tensors: list[torch.Tensor], clear_inputs: bool,
                       check_finite: bool) -> Moments | None:
    """``all_finite`` when asked, then ``accumulate`` and in the same pass the shifted float64 sums
    of the result, from which ``mean_std_from_sums`` gives the reference ``mean_std`` exactly. When
    an input holds NaN/Inf nothing is written: not finite, moments None."""
    if not _supported(residual, tensors) or residual.numel() == 0:
        return None
    if check_finite and not all_finite(tensors):
        return Moments(residual, None, False)
    sums = (ctypes.c_double * 3)()
    depth = _i64()
    if _accumulating(residual, tensors, clear_inputs, _accumulate_moments, sums, ctypes.byref(depth)) < 0:
        return None
    shift, t1, t2 = sums
    return Moments(residual, mean_std_from_sums(residual.numel(), shift, t1, t2, depth.value,
                                                lambda: residual, exact_mean_std), True)


def accumulate_segment_moments(residual: torch.Tensor, tensors: list[torch.Tensor], lengths: list[int],
                               clear_inputs: bool, check_finite: bool) -> Moments | None:
    """``accumulate_moments`` for each consecutive segment of the result (``lengths``): one pass,
    each segment's (mean, std) as ``mean_std`` of its slice gives it (Gaussian-k's packed
    per-tensor steps)."""
    if (not _supported(residual, tensors) or not lengths or any(length < 0 for length in lengths)
            or sum(lengths) != residual.numel()):
        return None
    if check_finite and not all_finite(tensors):
        return Moments(residual, None, False)
    sizes = np.ascontiguousarray(lengths, dtype=np.int64)
    sums = np.zeros((len(lengths), 3), dtype=np.float64)
    depths = np.zeros(len(lengths), dtype=np.int64)
    if _accumulating(residual, tensors, clear_inputs, _accumulate_segment_moments, sizes.ctypes.data,
                     len(lengths), sums.ctypes.data, depths.ctypes.data) < 0:
        return None
    starts = np.cumsum([0, *lengths[:-1]]).tolist()
    moments = [mean_std_from_sums(n, shift, t1, t2, depth, lambda lo=lo, n=n: residual[lo:lo + n],
                                  exact_mean_std)
               for n, lo, (shift, t1, t2), depth in zip(lengths, starts, sums.tolist(), depths.tolist(),
                                                        strict=True)]
    return Moments(residual, moments, True)


def accumulate_norms(residual: torch.Tensor, tensors: list[torch.Tensor], lengths: list[int]
                     ) -> Norms | None:
    """``accumulate``, and in the same pass the reference ``segment_norms`` of the result: the
    float64 sums of squares of each segment, turned into float32 norms by ``float32_norms``."""
    if (not _supported(residual, tensors) or not lengths or any(length < 0 for length in lengths)
            or sum(lengths) != residual.numel()):
        return None
    sizes = np.ascontiguousarray(lengths, dtype=np.int64)
    sums = np.zeros(len(lengths), dtype=np.float64)
    depths = np.zeros(len(lengths), dtype=np.int64)
    if _accumulating(residual, tensors, False, _accumulate_norms, sizes.ctypes.data, len(lengths),
                     sums.ctypes.data, depths.ctypes.data) < 0:
        return None
    starts = np.cumsum([0, *lengths]).tolist()
    return Norms(residual, float32_norms(sums.tolist(), depths.tolist(),
                                         lambda i: residual[starts[i]:starts[i + 1]].numpy()))
