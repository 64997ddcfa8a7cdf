"""Float64 sums with a known rounding depth on the GPU: Gaussian-k's moments and DEFT's unit norms,
alone or right after the error-feedback accumulation (accumulate.py) -- the reference
``mean_std`` and ``segment_norms`` results bit for bit.

The callers (hvd_sparse/backends/exact.py: ``mean_std_from_sums``, ``float32_norms``) turn a float64
sum and the most roundings any of its terms went through into the exactly rounded float32 result,
or fall back to an exact sum where the bound cannot decide; so any order will do as long as its
depth is known, and is small. Here each segment (the whole vector for the moments, a unit for the
norms) is cut into tiles of at most ``TILE_BLOCKS`` blocks of ROWS x COLS entries; a program sums
its tile block by block into a ROWS x COLS accumulator (each element a sequential sum: at most
TILE_BLOCKS roundings), then over rows and over columns (``tl.sum``: at most ROWS - 1 and COLS - 1
more, whatever order it takes); a second kernel sums each segment's tile sums the same way. A GPU
may fuse ``acc + d * d`` into one FMA, which only rounds less. No atomics: the result does not
depend on scheduling. One host synchronization reads the sums (with the finite flag, when there
is one).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from hvd_sparse.backends.contract import Moments, Norms
from hvd_sparse.backends.exact import float32_norms, mean_std_from_sums

from ._common import RESIDUALS, on_device
from .accumulate import _accumulate_into, _nonfinite_into, _residual_supported

# Module attributes so that tests can shrink them (several tiles and chunks out of a few thousand
# entries in the interpreter).
ROWS, COLS = 32, 32
TILE_BLOCKS = 64


@triton.jit
def _tile_sums_kernel(x_ptr, tile_start_ptr, tile_end_ptr, out_ptr, iterations,
                      MOMENTS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """out[2t], out[2t + 1] = Σd, Σd² over tile t (d = x - x[0]) with MOMENTS, else 0, Σx²."""
    tile = tl.program_id(0)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    shift = tl.load(x_ptr).to(tl.float64)
    grid = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    first = tl.zeros([ROWS, COLS], dtype=tl.float64)
    second = tl.zeros([ROWS, COLS], dtype=tl.float64)
    for step in range(0, iterations):
        offsets = start + step * (ROWS * COLS) + grid
        inside = offsets < end
        v = tl.load(x_ptr + offsets, mask=inside, other=0).to(tl.float64)
        if MOMENTS:
            v = tl.where(inside, v - shift, 0.0)
            first += v
        second += v * v
    tl.store(out_ptr + 2 * tile, tl.sum(tl.sum(first, 1), 0))
    tl.store(out_ptr + 2 * tile + 1, tl.sum(tl.sum(second, 1), 0))


@triton.jit
def _segment_totals_kernel(tile_sums_ptr, first_tile_ptr, tiles_ptr, out_ptr,
                           ROWS: tl.constexpr, COLS: tl.constexpr):
    """out[2s], out[2s + 1] = the sums of segment s's tiles, in chunks of ROWS x COLS tiles."""
    segment = tl.program_id(0)
    first_tile = tl.load(first_tile_ptr + segment)
    tiles = tl.load(tiles_ptr + segment)
    grid = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    first = tl.zeros([ROWS, COLS], dtype=tl.float64)
    second = tl.zeros([ROWS, COLS], dtype=tl.float64)
    for chunk in range(0, tiles, ROWS * COLS):
        which = chunk + grid
        inside = which < tiles
        at = 2 * (first_tile + which)
        first += tl.load(tile_sums_ptr + at, mask=inside, other=0.0)
        second += tl.load(tile_sums_ptr + at + 1, mask=inside, other=0.0)
    tl.store(out_ptr + 2 * segment, tl.sum(tl.sum(first, 1), 0))
    tl.store(out_ptr + 2 * segment + 1, tl.sum(tl.sum(second, 1), 0))


class _Tiles:
    """The tiles of consecutive segments of the given lengths (none crosses a segment border),
    as device tensors, and each segment's rounding depth."""

    def __init__(self, lengths: list[int], device: torch.device):
        block = ROWS * COLS
        tile = block * TILE_BLOCKS
        counts = [-(-length // tile) for length in lengths]
        starts = np.cumsum([0, *lengths])[:-1]
        tile_starts = np.concatenate([start + tile * np.arange(count, dtype=np.int64)
                                      for start, count in zip(starts, counts, strict=True)] or [[]])
        tile_ends = np.minimum(tile_starts + tile, np.repeat(starts + np.asarray(lengths), counts))
        self.count = int(sum(counts))
        self.iterations = TILE_BLOCKS
        self.starts = torch.from_numpy(tile_starts.astype(np.int64)).to(device)
        self.ends = torch.from_numpy(tile_ends.astype(np.int64)).to(device)
        self.first = torch.from_numpy(np.cumsum([0, *counts])[:-1].astype(np.int64)).to(device)
        self.tiles = torch.tensor(counts, dtype=torch.int64).to(device)
        # A term: TILE_BLOCKS additions in its accumulator element, at most ROWS - 1 and COLS - 1
        # in the tile's two sums, one per chunk of tiles and ROWS - 1 + COLS - 1 in the segment's.
        self.depths = [TILE_BLOCKS + 2 * (ROWS + COLS - 2) + -(-count // block) for count in counts]


def _segment_sums(x: torch.Tensor, lengths: list[int], moments: bool) -> tuple[torch.Tensor, list[int]]:
    """Device float64 [2 * segments]: (Σd, Σd²) or (0, Σx²) per segment; and their depths."""
    tiles = _Tiles(lengths, x.device)
    tile_sums = torch.empty(2 * max(tiles.count, 1), dtype=torch.float64, device=x.device)
    totals = torch.empty(2 * len(lengths), dtype=torch.float64, device=x.device)
    with on_device(x.device):
        if tiles.count:
            _tile_sums_kernel[(tiles.count,)](x, tiles.starts, tiles.ends, tile_sums, tiles.iterations,
                                              MOMENTS=moments, ROWS=ROWS, COLS=COLS)
        _segment_totals_kernel[(len(lengths),)](tile_sums, tiles.first, tiles.tiles, totals,
                                                ROWS=ROWS, COLS=COLS)
    return totals, tiles.depths


def _moments(x: torch.Tensor, flag: torch.Tensor | None) -> tuple[bool, tuple[float, float]]:
    """(finite, mean_std) from one host copy of [flag, x[0], Σd, Σd²]."""
    n = x.numel()
    totals, depths = _segment_sums(x, [n], moments=True)
    head = [flag.to(torch.float64)] if flag is not None else []
    values = torch.cat([*head, x[:1].to(torch.float64), totals]).tolist()   # the one synchronization
    if flag is not None and values.pop(0) != 0:
        return False, (0.0, 0.0)
    shift, t1, t2 = values
    # shift and square: two roundings more
    return True, mean_std_from_sums(n, shift, t1, t2, depths[0] + 2, lambda: x.cpu().numpy())


def _norms(x: torch.Tensor, lengths: list[int]) -> np.ndarray:
    totals, depths = _segment_sums(x, lengths, moments=False)
    sums = totals.view(-1, 2)[:, 1].tolist()   # the one synchronization
    starts = np.cumsum([0, *lengths]).tolist()
    return float32_norms(sums, [d + 1 for d in depths],   # the square: one rounding more
                         lambda i: x[starts[i]:starts[i + 1]].cpu().numpy())


def _vector(x: torch.Tensor) -> torch.Tensor | None:
    """x as a contiguous 1-D fp32/fp64 vector, or None."""
    if x.dtype not in RESIDUALS:
        return None
    flat = x.reshape(-1)
    return flat if flat.is_contiguous() else flat.contiguous()


def _lengths_fit(lengths: list[int], n: int) -> bool:
    return bool(lengths) and all(length >= 0 for length in lengths) and sum(lengths) == n


# --- the ops ------------------------------------------------------------------------------------------
def mean_std(x: torch.Tensor) -> tuple[float, float] | None:
    """The reference ``mean_std``, in one read of x and one host synchronization."""
    flat = _vector(x)
    if flat is None or flat.numel() < 2:
        return None
    return _moments(flat, None)[1]


def segment_norms(x: torch.Tensor, lengths: list[int]) -> np.ndarray | None:
    """The reference ``segment_norms``, in one read of x and one host synchronization."""
    flat = _vector(x)
    if flat is None or not _lengths_fit(lengths, flat.numel()):
        return None
    return _norms(flat, lengths)


def accumulate_moments(residual: torch.Tensor, tensors: list[torch.Tensor], clear_inputs: bool,
                       check_finite: bool) -> Moments | None:
    """The finite check when asked, ``accumulate`` (gated by it on the device) and the moments of
    the result, read with the flag in ONE host synchronization. Not finite: nothing was written,
    moments None."""
    if not _residual_supported(residual, tensors) or residual.numel() < 2:
        return None
    flag = None
    if check_finite:
        flag = torch.zeros(1, dtype=torch.int64, device=residual.device)
        _nonfinite_into(flag, tensors)
    _accumulate_into(residual, tensors, clear_inputs, flag, None)
    finite, moments = _moments(residual, flag)
    return Moments(residual, moments, True) if finite else Moments(residual, None, False)


def accumulate_norms(residual: torch.Tensor, tensors: list[torch.Tensor], lengths: list[int]
                     ) -> Norms | None:
    """``accumulate``, then the reference ``segment_norms`` of the result (one synchronization)."""
    if not _residual_supported(residual, tensors) or not _lengths_fit(lengths, residual.numel()):
        return None
    _accumulate_into(residual, tensors, False, None, None)
    return Norms(residual, _norms(residual, lengths))
