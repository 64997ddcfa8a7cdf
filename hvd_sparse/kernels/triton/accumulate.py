"""Error feedback and threshold selection in one pass: all_finite, accumulate, accumulate_select,
and the same with the momentum correction (momentum_accumulate, momentum_accumulate_select) or the
Adam path (adam_accumulate, adam_accumulate_select), and the Adam path's dense update (adam_update).

``a = e + g`` is computed per input tensor (one launch each, as the reference adds slice by
slice), into the residual, optionally zeroing the input in the same pass. With the momentum
correction the same pass reads and writes the velocity u too: ``u = m·u + g, a = e + u``
(Nesterov: ``u = m·(u + g), a = (e + u) + g``), every operation rounded on its own as the
reference's separate torch ops round it (the launches disable the compiler's fusion of a multiply
and an add into an FMA). On the Adam path it reads and writes the second moment v too:
``u = b1·u + (1 - b1)·g, v = b2·v + (1 - b2)·g², a = e + clamp((u·c1) / (sqrt(v·c2) + eps), bound)``,
as its dense update (``adam_update``) does, with a correctly rounded square root and division
(``sqrt_rn``, ``div_rn`` in fp32; fp64's own are). With selection, the
same pass counts, per block of the rank's range [lo, hi), the entries with |a| >= T, and the
probe counts on the sampled sub-range; an exclusive scan of the block counts (torch.cumsum, on
the device) then lets a second, range-only pass write the indices of every block at its offset:
ascending, with no sort and no atomics on positions, so the result never depends on scheduling.
The total, the finite flag and the probe counts come back to the host in one copy.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from hvd_sparse.backends.contract import Selected, Velocity, adam_constants
from hvd_sparse.backends.exact import sample_shape

from . import _common
from ._common import (
    FLOATS,
    INDICES,
    RESIDUALS,
    blocks,
    capped_key,
    float_bits,
    nan_key,
    on_device,
    same_device,
    threshold_key,
)

# The fused pass counts this many probes; more are counted by extra passes over the range.
FUSED_PROBES = 4


@triton.jit
def _nonfinite_kernel(x_ptr, numel, flag_ptr, NAN_KEY: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    x = tl.load(x_ptr + offsets, mask=inside, other=0)
    bad = tl.max((inside & (capped_key(x, NAN_KEY) >= NAN_KEY - 1)).to(tl.int32), 0)
    tl.store(flag_ptr, bad.to(tl.int64), mask=bad > 0)


@triton.jit
def _count_probes(key, position, inside, lo, hi, sample_len, row_len, every, probe_ptr,
                  p0, p1, p2, p3, NUM_PROBES: tl.constexpr, NAN_KEY: tl.constexpr):
    """Adds to probe_ptr[j] how many keys pass probe key p_j (j < NUM_PROBES), over the positions
    of [lo, hi) that count_at_least reads (see base.sample_shape)."""
    relative = position - lo
    counted = (inside & (position >= lo) & (position < hi) & (relative < sample_len)
               & ((relative // row_len) % every == 0) & (key < NAN_KEY))
    tl.atomic_add(probe_ptr, tl.sum((counted & (key >= p0)).to(tl.int64), 0))
    if NUM_PROBES > 1:
        tl.atomic_add(probe_ptr + 1, tl.sum((counted & (key >= p1)).to(tl.int64), 0))
    if NUM_PROBES > 2:
        tl.atomic_add(probe_ptr + 2, tl.sum((counted & (key >= p2)).to(tl.int64), 0))
    if NUM_PROBES > 3:
        tl.atomic_add(probe_ptr + 3, tl.sum((counted & (key >= p3)).to(tl.int64), 0))


@triton.jit
def _accumulate_kernel(residual_ptr, input_ptr, offset, numel, lo, hi, first_block, range_block,
                       num_blocks, skip_ptr, counts_ptr, probe_ptr, key_min, p0, p1, p2, p3,
                       sample_len, row_len, every, momentum_ptr, factor_bits, second_ptr, gain_bits,
                       b2_bits, g2_bits, c1_bits, c2_bits, eps_bits, bound_bits,
                       SELECT: tl.constexpr, NUM_PROBES: tl.constexpr, GATED: tl.constexpr,
                       CLEAR: tl.constexpr, WIDE: tl.constexpr, NAN_KEY: tl.constexpr,
                       BLOCK: tl.constexpr, MOMENTUM: tl.constexpr = False,
                       NESTEROV: tl.constexpr = False, ADAM: tl.constexpr = False,
                       FROZEN: tl.constexpr = False):
    # Block b covers [b * BLOCK, (b + 1) * BLOCK) of the residual, whichever tensor it reads: the
    # residual's accesses stay aligned (vector loads), and count j belongs to block range_block + j
    # for every launch (a block on a tensor border is counted by two).
    block = first_block + tl.program_id(0).to(tl.int64)
    position = block * BLOCK + tl.arange(0, BLOCK)
    inside = (position >= offset) & (position < offset + numel)
    if GATED:  # a device flag says the step is skipped: write nothing
        inside = inside & (tl.load(skip_ptr) == 0)
    g = tl.load(input_ptr + (position - offset), mask=inside, other=0)
    e = tl.load(residual_ptr + position, mask=inside, other=0)
    if MOMENTUM:
        # The reference's gradient vector: the inputs accumulated into zeros, 0 + g rounded to
        # the residual's dtype, which turns -0 into +0 (before the rounding: a tiny fp64 value
        # still rounds to -0 in fp32, as there).
        g = tl.where(g == 0, tl.zeros_like(g), g).to(e.dtype)
        m = _factor(factor_bits, e)
        u = tl.load(momentum_ptr + position, mask=inside, other=0)
        if ADAM:
            v = tl.load(second_ptr + position, mask=inside, other=0)
            u = u * m + g * _factor(gain_bits, e)
            if not FROZEN:   # a v shared by the ranks is only read
                v = v * _factor(b2_bits, e) + (g * g) * _factor(g2_bits, e)
                tl.store(second_ptr + position, v, mask=inside)
            step = _preconditioned(u, v, _factor(c1_bits, e), _factor(c2_bits, e), _factor(eps_bits, e))
            bound = _factor(bound_bits, e)
            step = tl.where(step > bound, bound, tl.where(step < -bound, -bound, step))   # NaN stays
            a = e + step
        elif NESTEROV:
            u = (u + g) * m
            a = (e + u) + g
        else:
            u = u * m + g
            a = e + u
        tl.store(momentum_ptr + position, u, mask=inside)
    else:
        # Exactly torch's residual.add_(g): both converted to their common dtype, one add, one
        # rounding to the residual's dtype (a no-op unless g is fp64 and the residual fp32).
        a = (e.to(tl.float64) + g.to(tl.float64)).to(e.dtype) if WIDE else e + g.to(e.dtype)
    tl.store(residual_ptr + position, a, mask=inside)
    if CLEAR:
        tl.store(input_ptr + (position - offset), tl.zeros_like(g), mask=inside)
    if SELECT:
        key = capped_key(a, NAN_KEY)
        in_range = inside & (position >= lo) & (position < hi)
        hits = tl.sum((in_range & (key >= key_min) & (key < NAN_KEY)).to(tl.int32), 0)
        j = block - range_block
        tl.atomic_add(counts_ptr + j, hits, mask=(j >= 0) & (j < num_blocks))
        if NUM_PROBES > 0:
            _count_probes(key, position, inside, lo, hi, sample_len, row_len, every, probe_ptr,
                          p0, p1, p2, p3, NUM_PROBES, NAN_KEY)


@triton.jit
def _factor(bits, like):
    """The momentum factor, passed as the bits of its value in the residual's dtype (``like``'s)."""
    if like.dtype.primitive_bitwidth == 64:
        return bits.to(tl.int64).to(tl.float64, bitcast=True)
    else:
        return bits.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _preconditioned(u, v, c1, c2, eps):
    """(u·c1) / (sqrt(v·c2) + eps), each operation correctly rounded (torch's are): Triton's fp32
    square root and division are approximations unless asked for the IEEE ones."""
    if u.dtype.primitive_bitwidth == 64:
        return (u * c1) / (tl.sqrt(v * c2) + eps)
    else:
        return tl.math.div_rn(u * c1, tl.math.sqrt_rn(v * c2) + eps)


@triton.jit
def _adam_update_kernel(average_ptr, m_ptr, v_ptr, numel, b1_bits, g1_bits, b2_bits, g2_bits, c1_bits,
                        c2_bits, eps_bits, BLOCK: tl.constexpr):
    """The Adam path's dense update (Backend.adam_update), in place: m, v and the update over the
    average."""
    position = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = position < numel
    a = tl.load(average_ptr + position, mask=inside, other=0)
    m = tl.load(m_ptr + position, mask=inside, other=0) * _factor(b1_bits, a) + a * _factor(g1_bits, a)
    v = tl.load(v_ptr + position, mask=inside, other=0) * _factor(b2_bits, a) + (a * a) * _factor(g2_bits, a)
    tl.store(m_ptr + position, m, mask=inside)
    tl.store(v_ptr + position, v, mask=inside)
    out = _preconditioned(m, v, _factor(c1_bits, a), _factor(c2_bits, a), _factor(eps_bits, a))
    tl.store(average_ptr + position, out, mask=inside)


@triton.jit
def _count_kernel(residual_ptr, lo, hi, range_block, probe_ptr, p0, p1, p2, p3, sample_len,
                  row_len, every, NUM_PROBES: tl.constexpr, NAN_KEY: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Probe counts beyond the fused ones: reads the range of the (already updated) residual."""
    position = (range_block + tl.program_id(0).to(tl.int64)) * BLOCK + tl.arange(0, BLOCK)
    relative = position - lo   # read only the sampled rows (1/every of the range)
    inside = ((position >= lo) & (position < hi) & (relative < sample_len)
              & ((relative // row_len) % every == 0))
    a = tl.load(residual_ptr + position, mask=inside, other=0)
    _count_probes(capped_key(a, NAN_KEY), position, inside, lo, hi, sample_len, row_len, every,
                  probe_ptr, p0, p1, p2, p3, NUM_PROBES, NAN_KEY)


@triton.jit
def _compact_kernel(residual_ptr, lo, hi, range_block, ends_ptr, index_ptr, key_min,
                    NAN_KEY: tl.constexpr, BLOCK: tl.constexpr):
    """Writes the in-range indices of range block j at its offset: ends[j] - (its count)."""
    j = tl.program_id(0).to(tl.int64)
    position = (range_block + j) * BLOCK + tl.arange(0, BLOCK)
    inside = (position >= lo) & (position < hi)
    key = capped_key(tl.load(residual_ptr + position, mask=inside, other=0), NAN_KEY)
    hit = (inside & (key >= key_min) & (key < NAN_KEY)).to(tl.int64)
    start = tl.load(ends_ptr + j) - tl.sum(hit, 0)
    slot = start + tl.cumsum(hit, 0) - hit
    tl.store(index_ptr + slot, position.to(index_ptr.dtype.element_ty), mask=hit > 0)


# --- argument checks: None means "no kernel for this; run the reference ops" ----------------------
def _inputs_supported(tensors: list[torch.Tensor], device: torch.device) -> bool:
    return all(t.dtype in FLOATS for t in tensors) and same_device(tensors, device)


def _residual_supported(residual: torch.Tensor, tensors: list[torch.Tensor]) -> bool:
    return (residual.dtype in RESIDUALS and residual.dim() == 1 and residual.is_contiguous()
            and _inputs_supported(tensors, residual.device)
            and sum(t.numel() for t in tensors) == residual.numel())


# --- launches -----------------------------------------------------------------------------------------
def _nonfinite_into(flag: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    block = _common.BLOCK
    for t in tensors:
        if t.numel() == 0 or not t.dtype.is_floating_point:
            continue
        flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
        with on_device(flat.device):
            _nonfinite_kernel[(blocks(flat.numel(), block),)](
                flat, flat.numel(), flag, NAN_KEY=nan_key(flat.dtype), BLOCK=block)


class _Selection:
    """Device buffers and launch arguments of one accumulate_select."""

    def __init__(self, residual: torch.Tensor, lo: int, hi: int, threshold: float,
                 probes: list[float], every: int):
        self.lo, self.hi, self.length = lo, hi, hi - lo
        # The residual's blocks that [lo, hi) touches: range_block, range_block + 1, ...
        self.range_block = lo // _common.BLOCK
        self.num_blocks = blocks(hi, _common.BLOCK) - self.range_block if hi > lo else 0
        self.key = threshold_key(threshold, residual.dtype)
        self.probe_keys = [threshold_key(p, residual.dtype) for p in probes]
        shape = sample_shape(self.length, every)
        if shape is None:
            self.sample = (self.length, max(self.length, 1), 1)
            self.sample_numel = self.length
        else:
            rows, row_len = shape
            self.sample = (rows * row_len, row_len, every)
            self.sample_numel = -(-rows // every) * row_len
        # [skip flag, probe counts...] in one buffer: one host copy reads them with the total.
        self.scalars = torch.zeros(1 + len(probes), dtype=torch.int64, device=residual.device)
        self.counts = torch.zeros(self.num_blocks, dtype=torch.int32, device=residual.device)

    def probe_args(self, first: int) -> tuple[list[int], int]:
        """The four probe-key arguments from probe ``first`` on, and how many are real."""
        keys = self.probe_keys[first:first + FUSED_PROBES]
        return keys + [0] * (FUSED_PROBES - len(keys)), len(keys)

    def probe_counts(self, counts: list[int]) -> list[float]:
        """Scaled exactly as the reference count_at_least scales its sample."""
        return [float(c) * self.length / self.sample_numel if self.sample_numel else 0.0
                for c in counts]


class _Adam:
    """The Adam path's second stream (v, written) and constants for the accumulating launches."""

    def __init__(self, factor: float, second: Any):
        self.second = second.buffer
        self.constants = adam_constants(factor, second)[1:8]   # b1 itself is the momentum's factor
        self.frozen = bool(second.frozen)

    def arguments(self, residual: torch.Tensor) -> tuple:
        """second_ptr, then 1 - b1, b2, 1 - b2, c1, c2, eps and the bound as bits of the residual's
        dtype."""
        return (self.second, *(float_bits(c, residual.dtype) for c in self.constants))


def _accumulate_into(residual: torch.Tensor, tensors: list[torch.Tensor], clear_inputs: bool,
                     skip: torch.Tensor | None, selection: _Selection | None,
                     momentum: tuple[torch.Tensor, float, bool] | None = None,
                     adam: _Adam | None = None) -> None:
    """The accumulating launches; ``momentum``: (velocity, factor, nesterov) of the momentum
    correction, the velocity updated in the same pass; with ``adam`` the velocity is the Adam
    path's first moment, and its second moment is updated too."""
    block = _common.BLOCK
    nan = nan_key(residual.dtype)
    lo = selection.lo if selection is not None else 0
    hi = selection.hi if selection is not None else 0
    range_block = selection.range_block if selection is not None else 0
    num_blocks = selection.num_blocks if selection is not None else 0
    if selection is not None:
        probe_keys, fused = selection.probe_args(0)
        counts, probe_counts = selection.counts, selection.scalars[1:]
        key, sample = selection.key, selection.sample
    else:
        probe_keys, fused, key, sample = [0] * FUSED_PROBES, 0, 0, (0, 1, 1)
        counts = probe_counts = residual   # not read (SELECT is off)
    gate = skip if skip is not None else residual
    velocity, factor, nesterov = momentum if momentum is not None else (residual, 0.0, False)
    factor_bits = float_bits(factor, residual.dtype) if momentum is not None else 0
    adam_args = adam.arguments(residual) if adam is not None else (residual, *[0] * 7)
    offset = 0
    for t in tensors:
        n = t.numel()
        if n == 0:
            continue
        contiguous = t.is_contiguous()
        source = t.reshape(-1) if contiguous else t.contiguous().reshape(-1)
        first = offset // block
        last = (offset + n - 1) // block
        with on_device(residual.device):
            _accumulate_kernel[(last - first + 1,)](
                residual, source, offset, n, lo, hi, first, range_block, num_blocks, gate, counts,
                probe_counts, key, *probe_keys, *sample, velocity, factor_bits, *adam_args,
                SELECT=selection is not None, NUM_PROBES=fused, GATED=skip is not None,
                CLEAR=clear_inputs and contiguous,
                WIDE=torch.float64 in (t.dtype, residual.dtype) and t.dtype != residual.dtype,
                NAN_KEY=nan, BLOCK=block, MOMENTUM=momentum is not None, NESTEROV=bool(nesterov),
                ADAM=adam is not None, FROZEN=adam is not None and adam.frozen,
                enable_fp_fusion=False)   # u·m + g: two roundings, as the reference's two ops
        if clear_inputs and not contiguous:  # the kernel zeroed a copy: zero the tensor itself
            if skip is None:
                t.zero_()
            else:
                t.masked_fill_(skip == 0, 0)
        offset += n
    if selection is not None:
        for first in range(FUSED_PROBES, len(selection.probe_keys), FUSED_PROBES):
            probe_keys, count = selection.probe_args(first)
            with on_device(residual.device):
                _count_kernel[(selection.num_blocks,)](
                    residual, lo, hi, range_block, selection.scalars[1 + first:], *probe_keys,
                    *sample,
                    NUM_PROBES=count, NAN_KEY=nan, BLOCK=block)


def _select(residual: torch.Tensor, tensors: list[torch.Tensor], lo: int, hi: int,
            threshold: float, probes: list[float], every: int, index_dtype: torch.dtype,
            clear_inputs: bool, check_finite: bool,
            momentum: tuple[torch.Tensor, float, bool] | None = None, adam: _Adam | None = None
            ) -> Selected | None:
    if not (_residual_supported(residual, tensors) and index_dtype in INDICES
            and 0 <= lo <= hi <= residual.numel()
            and (index_dtype == torch.int64 or hi <= torch.iinfo(torch.int32).max)):
        return None
    selection = _Selection(residual, lo, hi, threshold, list(probes), every)
    skip = None
    if check_finite:
        skip = selection.scalars[:1]
        _nonfinite_into(skip, tensors)
    _accumulate_into(residual, tensors, clear_inputs, skip, selection, momentum, adam)
    ends = torch.cumsum(selection.counts, 0)
    head = torch.cat([selection.scalars, ends[-1:]]) if selection.num_blocks else selection.scalars
    values = head.tolist()   # the one host synchronization
    finite = values[0] == 0
    total = values[-1] if selection.num_blocks and finite else 0
    probe_counts = selection.probe_counts(values[1:1 + len(probes)] if finite else [0] * len(probes))
    index = torch.empty(total, dtype=index_dtype, device=residual.device)
    if total:
        with on_device(residual.device):
            _compact_kernel[(selection.num_blocks,)](
                residual, lo, hi, selection.range_block, ends, index, selection.key,
                NAN_KEY=nan_key(residual.dtype), BLOCK=_common.BLOCK)
    return Selected(residual, index, probe_counts, True) if finite else Selected(residual, None, [], False)


# --- the ops ---------------------------------------------------------------------------------------
def finite_flag(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """Device int64 [1]: 0 when no tensor holds NaN/Inf, else 1. No host synchronization."""
    if not tensors or not same_device(tensors, tensors[0].device):
        return None
    flag = torch.zeros(1, dtype=torch.int64, device=tensors[0].device)
    _nonfinite_into(flag, tensors)
    return flag


def all_finite(tensors: list[torch.Tensor]) -> bool | None:
    """Whether no tensor holds NaN or Inf (one host synchronization)."""
    if not tensors:
        return True
    flag = finite_flag(tensors)
    return None if flag is None else int(flag.item()) == 0


def accumulate(residual: torch.Tensor, tensors: list[torch.Tensor], clear_inputs: bool,
               skip_if: torch.Tensor | None = None) -> torch.Tensor | None:
    """residual += concat(flattened tensors), as the reference adds slice by slice (the residual); with
    ``clear_inputs`` the inputs are zeroed in the same pass. With ``skip_if`` (a device flag such
    as ``finite_flag``'s), nothing is written when the flag is nonzero. No host synchronization."""
    if not _residual_supported(residual, tensors):
        return None
    _accumulate_into(residual, tensors, clear_inputs, skip_if, None)
    return residual


def accumulate_if_finite(residual: torch.Tensor, tensors: list[torch.Tensor],
                         clear_inputs: bool) -> torch.Tensor | None:
    """``accumulate`` only when every input is finite, decided on the device: returns the
    device flag (nonzero: not finite, nothing was written) for the caller to read together with
    its step's one synchronization. No host synchronization here."""
    if not _residual_supported(residual, tensors):
        return None
    flag = torch.zeros(1, dtype=torch.int64, device=residual.device)
    _nonfinite_into(flag, tensors)
    _accumulate_into(residual, tensors, clear_inputs, flag, None)
    return flag


def accumulate_select(residual: torch.Tensor, tensors: list[torch.Tensor], lo: int, hi: int,
                      threshold: float, probes: list[float], every: int,
                      index_dtype: torch.dtype, clear_inputs: bool) -> Selected | None:
    """``accumulate``, then the ascending indices i in [lo, hi) with |a_i| >= threshold and the
    probe counts of count_at_least(|a[lo:hi]|, probes, every). One host synchronization."""
    return _select(residual, tensors, lo, hi, threshold, probes, every, index_dtype,
                   clear_inputs, check_finite=False)


def accumulate_select_if_finite(residual: torch.Tensor, tensors: list[torch.Tensor], lo: int,
                                hi: int, threshold: float, probes: list[float], every: int,
                                index_dtype: torch.dtype, clear_inputs: bool) -> Selected | None:
    """The finite check, ``accumulate_select`` and the read of both in ONE host synchronization.
    When an input holds NaN/Inf nothing is written (residual and inputs keep their values) and
    the result is not finite (idx None, no counts)."""
    return _select(residual, tensors, lo, hi, threshold, probes, every, index_dtype,
                   clear_inputs, check_finite=True)


def _velocity_supported(residual: torch.Tensor, momentum: torch.Tensor) -> bool:
    return (momentum.device == residual.device and momentum.dtype == residual.dtype and momentum.dim() == 1
            and momentum.is_contiguous() and momentum.numel() == residual.numel())


def momentum_accumulate(residual: torch.Tensor, momentum: torch.Tensor, tensors: list[torch.Tensor],
                        factor: float, nesterov: bool) -> Velocity | None:
    """The reference ``Backend.momentum_accumulate`` in one pass: g = concat(tensors) in the
    residual's dtype, u = factor·u + g and residual += u (Nesterov: u = factor·(u + g) and
    residual = (residual + u) + g), residual and ``momentum`` (the velocity u) in place. No host
    synchronization."""
    if not (_residual_supported(residual, tensors) and _velocity_supported(residual, momentum)):
        return None
    _accumulate_into(residual, tensors, False, None, None, (momentum, factor, nesterov))
    return Velocity(residual, momentum)


def momentum_accumulate_select(residual: torch.Tensor, momentum: torch.Tensor, tensors: list[torch.Tensor],
                               factor: float, nesterov: bool, lo: int, hi: int, threshold: float,
                               probes: list[float], every: int, index_dtype: torch.dtype, clear_inputs: bool,
                               check_finite: bool) -> Selected | None:
    """``accumulate_select`` (``accumulate_select_if_finite`` with
    ``check_finite``) with the momentum correction of ``momentum_accumulate`` in the same pass,
    the velocity updated in place. ONE host synchronization. When an input holds NaN/Inf (with
    ``check_finite``) nothing is written: residual, velocity and inputs keep their values."""
    if not _velocity_supported(residual, momentum):
        return None
    return _select(residual, tensors, lo, hi, threshold, probes, every, index_dtype, clear_inputs,
                   check_finite, (momentum, factor, nesterov))


def adam_accumulate(residual: torch.Tensor, momentum: torch.Tensor, tensors: list[torch.Tensor],
                    factor: float, second: Any) -> Velocity | None:
    """The reference ``Backend.adam_accumulate`` in one pass: u = factor·u + (1 - factor)·g,
    v = b2·v + (1 - b2)·g² and residual += clamp((u·c1) / (sqrt(v·c2) + eps), bound), the residual
    and both moments (``momentum``, ``second.buffer`` of a ``SecondMoment``) in place. No host
    synchronization."""
    if not (_residual_supported(residual, tensors) and _velocity_supported(residual, momentum)
            and _velocity_supported(residual, second.buffer)):
        return None
    _accumulate_into(residual, tensors, False, None, None, (momentum, factor, False), _Adam(factor, second))
    return Velocity(residual, momentum)


def adam_accumulate_select(residual: torch.Tensor, momentum: torch.Tensor, tensors: list[torch.Tensor],
                           factor: float, second: Any, lo: int, hi: int, threshold: float,
                           probes: list[float], every: int, index_dtype: torch.dtype, clear_inputs: bool,
                           check_finite: bool) -> Selected | None:
    """``accumulate_select`` (with the finite check when asked) on the Adam path of
    ``adam_accumulate``, in the same pass. ONE host synchronization; not finite: nothing written."""
    if not (_velocity_supported(residual, momentum) and _velocity_supported(residual, second.buffer)):
        return None
    return _select(residual, tensors, lo, hi, threshold, probes, every, index_dtype, clear_inputs,
                   check_finite, (momentum, factor, False), _Adam(factor, second))


def adam_update(average: torch.Tensor, first: torch.Tensor, second: torch.Tensor, beta1: float, beta2: float,
                first_scale: float, second_scale: float, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The reference ``Backend.adam_update`` in one pass, m and v in place and the update written
    over ``average``: (update, m, v). No host synchronization."""
    if not (average.dtype in RESIDUALS and average.dim() == 1 and average.is_contiguous()
            and _velocity_supported(average, first) and _velocity_supported(average, second)):
        return None
    if average.numel():
        bits = [float_bits(c, average.dtype) for c in (beta1, 1.0 - beta1, beta2, 1.0 - beta2, first_scale,
                                                        second_scale, eps)]
        with on_device(average.device):
            _adam_update_kernel[(blocks(average.numel(), _common.BLOCK),)](
                average, first, second, average.numel(), *bits, BLOCK=_common.BLOCK, enable_fp_fusion=False)
    return average, first, second
