"""Exact top-k by magnitude: radix select on the magnitude keys, then a block-wise compaction.

The k-th largest key K is found digit by digit, 8 bits at a time from the top: a histogram of
the digit over the entries whose higher digits match the prefix found so far, then a one-program
kernel that picks the digit holding the k-th entry and keeps the prefix and the remaining rank on
the device. Then per block: how many keys are > K and == K, an exclusive scan of both
(torch.cumsum), and a pass that writes, at its ascending position, every entry > K and the first
``need`` entries == K in index order (ties broken by the lowest index, as the contract asks).

No host synchronization: the output has k entries, known in advance, and every intermediate
(prefix, rank, histograms, counts) stays on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common
from ._common import FLOATS, INDICES, blocks, capped_key, nan_key, on_device

DIGIT_BITS = 8
BINS = 1 << DIGIT_BITS
# Key bits below the sign bit, per float width: 31 -> digits at 24, 16, 8, 0.
_SIGNIFICANT = {16: 15, 32: 31, 64: 63}


@triton.jit
def _histogram_kernel(x_ptr, n, state_ptr, hist_ptr, high_mask, iterations,
                      SHIFT: tl.constexpr, NAN_KEY: tl.constexpr, BLOCK: tl.constexpr,
                      BINS: tl.constexpr):
    """hist[d] += how many keys whose bits above SHIFT + 8 equal the prefix's have digit d."""
    prefix = tl.load(state_ptr)
    counts = tl.zeros([BINS], dtype=tl.int32)
    first = tl.program_id(0).to(tl.int64) * iterations
    for step in range(0, iterations):
        offsets = (first + step) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        key = capped_key(tl.load(x_ptr + offsets, mask=inside, other=0), NAN_KEY).to(tl.int64)
        candidate = inside & ((key & high_mask) == (prefix & high_mask))
        digit = ((key >> SHIFT) & (BINS - 1)).to(tl.int32)
        counts += tl.histogram(digit, BINS, mask=candidate)
    tl.atomic_add(hist_ptr + tl.arange(0, BINS), counts.to(tl.int64))   # n may exceed 2**31


@triton.jit
def _choose_digit_kernel(state_ptr, hist_ptr, SHIFT: tl.constexpr, BINS: tl.constexpr):
    """Appends to the prefix the digit holding the rem-th largest candidate (1 <= rem <= count)."""
    bins = tl.arange(0, BINS)
    hist = tl.load(hist_ptr + bins)
    prefix = tl.load(state_ptr)
    rank = tl.load(state_ptr + 1)
    above = tl.sum(hist, 0) - tl.cumsum(hist, 0)   # candidates with a larger digit
    chosen = (above < rank) & (above + hist >= rank)
    digit = tl.sum(tl.where(chosen, bins, 0), 0).to(tl.int64)
    tl.store(state_ptr, prefix | (digit << SHIFT))
    tl.store(state_ptr + 1, rank - tl.sum(tl.where(chosen, above, 0), 0))


@triton.jit
def _above_and_tied(x_ptr, n, state_ptr, block, NAN_KEY: tl.constexpr, BLOCK: tl.constexpr):
    """Positions of block j and, as int64 0/1, which of their keys are > K and == K."""
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    key = capped_key(tl.load(x_ptr + offsets, mask=inside, other=0), NAN_KEY).to(tl.int64)
    kth = tl.load(state_ptr)
    return offsets, (inside & (key > kth)).to(tl.int64), (inside & (key == kth)).to(tl.int64)


@triton.jit
def _tie_count_kernel(x_ptr, n, state_ptr, counts_ptr, num_blocks,
                      NAN_KEY: tl.constexpr, BLOCK: tl.constexpr):
    """counts[j] = keys > K in block j, counts[num_blocks + j] = keys == K."""
    block = tl.program_id(0).to(tl.int64)
    _, above, tied = _above_and_tied(x_ptr, n, state_ptr, block, NAN_KEY, BLOCK)
    tl.store(counts_ptr + block, tl.sum(above, 0).to(tl.int32))
    tl.store(counts_ptr + num_blocks + block, tl.sum(tied, 0).to(tl.int32))


@triton.jit
def _topk_compact_kernel(x_ptr, n, state_ptr, ends_ptr, num_blocks, index_ptr,
                         NAN_KEY: tl.constexpr, BLOCK: tl.constexpr):
    """Writes every entry > K and the first ``need`` entries == K at their ascending slots."""
    block = tl.program_id(0).to(tl.int64)
    offsets, above, tied = _above_and_tied(x_ptr, n, state_ptr, block, NAN_KEY, BLOCK)
    need = tl.load(state_ptr + 1)   # how many entries == K are taken: the lowest-indexed ones
    above_before = tl.load(ends_ptr + block) - tl.sum(above, 0) + tl.cumsum(above, 0) - above
    tied_before = (tl.load(ends_ptr + num_blocks + block) - tl.sum(tied, 0)
                   + tl.cumsum(tied, 0) - tied)
    take = (above > 0) | ((tied > 0) & (tied_before < need))
    slot = above_before + tl.minimum(tied_before, need)
    tl.store(index_ptr + slot, offsets.to(index_ptr.dtype.element_ty), mask=take)


def topk_abs(x: torch.Tensor, k: int, index_dtype: torch.dtype) -> torch.Tensor | None:
    """Ascending indices of the k entries of largest |x| (flattened): -0 == +0, NaN above +Inf,
    ties at the k-th magnitude to the lowest indices. No host synchronization."""
    n = x.numel()
    if x.dtype not in FLOATS or index_dtype not in INDICES or not 0 <= k <= n:
        return None
    if index_dtype == torch.int32 and n > torch.iinfo(torch.int32).max:
        return None
    if k == 0 or k == n:
        return torch.arange(k, dtype=index_dtype, device=x.device)
    flat = x.reshape(-1) if x.is_contiguous() else x.contiguous().reshape(-1)
    with on_device(flat.device):
        return _select_topk(flat, k, index_dtype)


def _select_topk(flat: torch.Tensor, k: int, index_dtype: torch.dtype) -> torch.Tensor:
    """topk_abs for 0 < k < numel, on a contiguous 1-D tensor."""
    n = flat.numel()
    block = _common.BLOCK
    nan = nan_key(flat.dtype)
    significant = _SIGNIFICANT[torch.finfo(flat.dtype).bits]
    shifts = list(range(significant - significant % DIGIT_BITS, -1, -DIGIT_BITS))
    # [prefix of K found so far, rank of the k-th entry among the entries matching it]
    state = torch.zeros(2, dtype=torch.int64, device=flat.device)
    state[1:].fill_(k)   # a fill on the device, not a copy from the host (which would sync)
    hist = torch.zeros(len(shifts), BINS, dtype=torch.int64, device=flat.device)
    num_blocks = blocks(n, block)
    programs = min(num_blocks, _common.HISTOGRAM_PROGRAMS)
    iterations = blocks(num_blocks, programs)
    programs = blocks(num_blocks, iterations)
    for p, shift in enumerate(shifts):
        high_mask = ((1 << significant) - 1) & ~((1 << (shift + DIGIT_BITS)) - 1)
        _histogram_kernel[(programs,)](flat, n, state, hist[p], high_mask, iterations,
                                       SHIFT=shift, NAN_KEY=nan, BLOCK=block, BINS=BINS)
        _choose_digit_kernel[(1,)](state, hist[p], SHIFT=shift, BINS=BINS)
    counts = torch.empty(2 * num_blocks, dtype=torch.int32, device=flat.device)
    _tie_count_kernel[(num_blocks,)](flat, n, state, counts, num_blocks, NAN_KEY=nan, BLOCK=block)
    ends = torch.cumsum(counts.view(2, num_blocks), dim=1)
    index = torch.empty(k, dtype=index_dtype, device=flat.device)
    _topk_compact_kernel[(num_blocks,)](flat, n, state, ends, num_blocks, index,
                                        NAN_KEY=nan, BLOCK=block)
    return index
