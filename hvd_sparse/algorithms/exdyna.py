"""ExDyna (docs/algorithms.md#exdyna): MiCRO's exclusive rotating partitions, made of fixed-size blocks
whose boundaries move to balance the ranks' selection loads.

Paper mode reproduces the authors' code: the flat vector is cut into 1024 blocks of
floor(n/1024) rounded down to a multiple of 32 elements, the tail going to the last partition;
partitions start with 1024/N blocks each (the first 1024 mod N one more); before every step
after the first, a left-to-right sweep over the boundaries moves one block from an over-loaded
partition (load > 1.05 × mean) to an under-loaded neighbour (load < 0.95238 × mean), never
shrinking a partition to min_blk = 1024/(4N) blocks or fewer, and updates the predicted loads as
it goes (Gauss-Seidel). Every rank runs the sweep on the per-partition counts of the previous
step, which it reads off the gathered indices: no message of its own, and integer decisions, so
every rank holds the same table.

Named options (off in paper mode):

* ``rebalance="neighbour"``: the boundary decisions use counts exchanged only with ranks r-1 and
  r+1: under an MPI job with MPI_THREAD_MULTIPLE, mpi4py non-blocking point-to-point, O(1)
  messages per rank whatever N is; under Gloo (or where MPI does not allow it) a Horovod alltoall
  with neighbour-only splits, which still touches every peer, ~4(N-1) messages per rank per step
  (comm/neighbours.py). Red-black activation (boundary p|p+1 only when
  p ≡ t mod 2) keeps two moves from meeting in one partition; after deciding, each rank hands its
  partition's new range to rank r-1, which owns it next step. Jacobi-style, so it is not
  bit-identical to the sweep; it converges at about half the speed (docs/algorithms.md#neighbour-rebalancing).
* ``rebalance="histogram"``: every rank also reads the per-block counts off the gathered indices
  (no message), keeps a decaying average of them (``histogram_decay``, default 0.8) and places
  the boundaries where the cumulative load crosses p/N of the total, at least one block per
  partition. The sweep moves one block per boundary per step from per-partition counts, which on
  a model whose load sits in a small region takes hundreds of steps (char-LSTM of 1.2M
  parameters, N = 4, ρ = 0.01: padding waste 43% with the sweep, 10% with the histogram).
* ``rebalance="off"``: fixed blocks (no boundary moves).
* ``num_blocks``: another block count, or "auto" = max(1024, 16·N), which lifts the paper's
  N ≤ 256 limit (with 1024 blocks a partition needs more than 1024/(4N) ≥ 1 blocks to give one).
* ``overload_ratio`` / ``underload_ratio``: the load band (formerly ``over_band`` /
  ``under_band``): over- and under-loaded relative to the mean load.
* Small models (n < 32 × num_blocks, where the paper's rule would make zero-size blocks) get
  n // 32 blocks of 32 elements instead; a model with fewer than 32·N elements gets N blocks of
  n // N elements. Never a zero-size block.
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from typing import Unpack

import numpy as np

from ..comm import NEIGHBOURS, Collective, Protocol
from ..errors import ConfigurationError, renamed_options
from .base import StepContext, StepOutcome, check_choice, is_integer
from .blocks import BlockLayout
from .corrections import CorrectionOptions
from .micro import (
    ExclusiveControl,
    MiCRO,
    owned_partition,
    refuse_fewer_entries_than_ranks,
)

REBALANCE_MODES = ("exact", "neighbour", "histogram", "off")
PAPER_BLOCKS = 1024
BLOCK_ALIGN = 32


def block_layout(n: int, size: int, num_blocks: int) -> tuple[int, int, int]:
    """(number of blocks, block size, tail) for n elements: the paper's rule, and for small
    models the fallbacks described in the module docstring."""
    refuse_fewer_entries_than_ranks("ExDyna", n, size)
    block = (n // num_blocks) // BLOCK_ALIGN * BLOCK_ALIGN
    if block == 0:
        num_blocks = n // BLOCK_ALIGN
        block = BLOCK_ALIGN
        if num_blocks < size:
            num_blocks, block = size, n // size
    return num_blocks, block, n - num_blocks * block


def initial_blocks(num_blocks: int, size: int) -> list[int]:
    """Blocks per partition at t = 0: floor(B/N), the first B mod N partitions one more."""
    return [num_blocks // size + (1 if p < num_blocks % size else 0) for p in range(size)]


def block_bounds(blocks: list[int], block: int, n: int) -> np.ndarray:
    """N+1 element bounds; the last partition also holds the tail."""
    bounds = np.concatenate([[0], np.cumsum(blocks, dtype=np.int64) * block])
    bounds[-1] = n
    return bounds


def can_give_block(blocks: int, num_blocks: int, size: int) -> bool:
    """The code's ``blk_part - 1 >= min_blk`` with min_blk = B/(4N), in integers."""
    return 4 * size * (blocks - 1) >= num_blocks


def boundary_move(load_left: int, load_right: int, mean: int, over: Fraction, under: Fraction) -> int:
    """+1 to move boundary p|p+1 right (a block from p+1 to p), -1 to move it left, 0 to keep it:
    one side over the band above the mean load, the other under the band below it."""
    def is_over(load: int) -> bool:
        return load * over.denominator > over.numerator * mean

    def is_under(load: int) -> bool:
        return load * under.denominator < under.numerator * mean

    if is_over(load_left) and is_under(load_right):
        return -1
    if is_under(load_left) and is_over(load_right):
        return +1
    return 0


def sweep(blocks: list[int], loads: list[int], union: int, n: int, block: int, num_blocks: int,
          over: Fraction, under: Fraction) -> tuple[list[int], int]:
    """The paper's left-to-right sweep (docs/algorithms.md#the-sweep): at most one block per boundary, the
    predicted loads updated after each move. Returns the new blocks per partition and the number
    of boundaries moved."""
    size = len(blocks)
    blocks, loads = list(blocks), [int(x) for x in loads]
    mean = union // size
    shift = int(block * (union / n))   # the code's float arithmetic: identical on every rank
    moves = 0
    for p in range(size - 1):
        direction = boundary_move(loads[p], loads[p + 1], mean, over, under)
        giver = p if direction < 0 else p + 1
        if direction and can_give_block(blocks[giver], num_blocks, size):
            blocks[p] += direction
            blocks[p + 1] -= direction
            loads[p] += direction * shift
            loads[p + 1] -= direction * shift
            moves += 1
    return blocks, moves


def block_edges(num_blocks: int, block: int, n: int) -> np.ndarray:
    """num_blocks+1 element bounds of the blocks; the last block also holds the tail."""
    edges = np.arange(num_blocks + 1, dtype=np.int64) * block
    edges[-1] = n
    return edges


def pair(values: np.ndarray) -> tuple[int, int]:
    """A neighbour's (count, blocks) as ints."""
    return int(values[0]), int(values[1])


def histogram_blocks(block_loads: np.ndarray, size: int) -> list[int] | None:
    """Blocks per partition that split the cumulative block load into N equal shares (each
    partition at least one block); None when there is no load to split."""
    cumulative = np.cumsum(np.asarray(block_loads, dtype=np.float64))
    num_blocks, total = len(cumulative), float(cumulative[-1])
    if total <= 0.0:
        return None
    cuts: list[int] = []
    for p in range(1, size):
        cut = int(np.searchsorted(cumulative, p * total / size, side="left")) + 1
        low = (cuts[-1] if cuts else 0) + 1      # partition p-1 keeps at least one block
        high = num_blocks - (size - p)           # and leaves one for each partition after it
        cuts.append(min(max(cut, low), high))
    return np.diff([0, *cuts, num_blocks]).tolist()


def neighbour_update(partition: int, step: int, first_block: int, blocks: int, count: int,
                     left: tuple[int, int] | None, right: tuple[int, int] | None, union: int,
                     num_blocks: int, size: int, over: Fraction, under: Fraction
                     ) -> tuple[int, int, int]:
    """One rank's side of the red-black rebalance (docs/algorithms.md#neighbour-rebalancing): its new
    (first block, blocks) and whether it moved a boundary. ``left``/``right`` are the
    (count, blocks) of partitions p-1 and p+1, or None at the ends."""
    mean = union // size
    if right is not None and partition % 2 == step % 2:          # active boundary p|p+1
        direction = boundary_move(count, right[0], mean, over, under)
        giver_blocks = blocks if direction < 0 else right[1]
        if direction and can_give_block(giver_blocks, num_blocks, size):
            return first_block, blocks + direction, 1
    if left is not None and (partition - 1) % 2 == step % 2:     # active boundary p-1|p
        direction = boundary_move(left[0], count, mean, over, under)
        giver_blocks = left[1] if direction < 0 else blocks
        if direction and can_give_block(giver_blocks, num_blocks, size):
            return first_block + direction, blocks - direction, 1
    return first_block, blocks, 0


class ExDyna(MiCRO):
    """ExDyna: block-based exclusive partitions with dynamic rebalancing and online threshold
    scaling.

    Args:
        density: target fraction of entries aggregated per step, in (0, 1].
        rebalance: "exact" (paper: replicated sweep), "neighbour" (counts exchanged with ranks
            r±1 only), "histogram" (boundaries placed from per-block loads) or "off".
        num_blocks: blocks the model is cut into (paper: 1024), or "auto" = max(1024, 16·N).
        threshold_scaling: "paper" or "tracking" (see hvd_sparse.algorithms.micro). Formerly
            ``threshold``.
        threshold_band: "code" (paper) or "symmetric" band of the threshold scaling. Formerly
            ``band``.
        overload_ratio, underload_ratio: a partition is over-loaded above overload_ratio × mean
            load and under-loaded below underload_ratio × mean (paper: "1.05", "0.95238";
            decimal strings or numbers, compared exactly). Formerly ``over_band``/``under_band``.
        histogram_decay: weight of the past in the per-block load average of
            ``rebalance="histogram"`` (0: the last step alone).
        threshold_start: "paper" (λ0 = 1/(2√k)) or "local" (the first step selects each rank's
            share of k by magnitude; see hvd_sparse.algorithms.micro). Default "paper", "local" on
            the Adam path.
        tracking_gain: "auto" (adaptive under the momentum correction and on the Adam path, fixed
            otherwise), "fixed"
            or "adaptive": the tracking controller's step (see hvd_sparse.algorithms.micro).
    """

    name = "exdyna"
    control_keys = (*MiCRO.control_keys, "layout")

    @renamed_options(threshold="threshold_scaling", band="threshold_band",
                     over_band="overload_ratio", under_band="underload_ratio")
    def __init__(self, density: float = 0.001, *, rebalance: str = "exact",
                 num_blocks: int | str = PAPER_BLOCKS, threshold_scaling: str = "paper",
                 threshold_band: str = "code", overload_ratio: str | float = "1.05",
                 underload_ratio: str | float = "0.95238", histogram_decay: float = 0.8,
                 threshold_start: str | None = None, tracking_gain: str = "auto",
                 **corrections: Unpack[CorrectionOptions]):
        super().__init__(density, threshold_scaling=threshold_scaling, threshold_band=threshold_band,
                         threshold_start=threshold_start, tracking_gain=tracking_gain, **corrections)
        self.rebalance = check_choice("rebalance", rebalance, REBALANCE_MODES)
        if not 0.0 <= float(histogram_decay) < 1.0:
            raise ConfigurationError(f"histogram_decay must be in [0, 1), got {histogram_decay!r}")
        self.histogram_decay = float(histogram_decay)
        if not (num_blocks == "auto" or (is_integer(num_blocks) and int(num_blocks) >= 1)):
            raise ConfigurationError(f"num_blocks must be a positive int or 'auto', got {num_blocks!r}")
        self.num_blocks: int | str = num_blocks if num_blocks == "auto" else int(num_blocks)
        self.overload_ratio, self.underload_ratio = str(overload_ratio), str(underload_ratio)
        self._over, self._under = Fraction(self.overload_ratio), Fraction(self.underload_ratio)
        if not self._under < 1 < self._over:
            raise ConfigurationError(f"need underload_ratio < 1 < overload_ratio, got "
                                     f"{underload_ratio} and {overload_ratio}")

    @property
    def select_collectives(self) -> bool:
        """True in neighbour mode, whose rebalancer exchanges counts with the adjacent ranks during
        selection."""
        return self.rebalance == "neighbour"   # the exchange in ``rebalance_partitions``

    # --- partitions ---------------------------------------------------------------------------------
    def reset_partitions(self, control: ExclusiveControl, ctx: StepContext) -> None:
        """The initial blocks; in neighbour mode only the partition this rank owns at this step,
        (t + r) mod N (t > 0 after a resume or an elastic reset), is known here."""
        requested = max(PAPER_BLOCKS, 16 * ctx.size) if self.num_blocks == "auto" else int(self.num_blocks)
        if 4 * ctx.size > requested:
            raise ConfigurationError(
                f"ExDyna with {requested} blocks supports at most {requested // 4} ranks (the "
                f"paper's N <= 256 for 1024 blocks); this job has {ctx.size}: pass "
                "num_blocks='auto' (max(1024, 16 N) blocks) or a larger num_blocks")
        num_blocks, block, tail = block_layout(ctx.numel, ctx.size, requested)
        blocks = initial_blocks(num_blocks, ctx.size)
        if self.rebalance == "neighbour":
            owned = owned_partition(ctx.rank, ctx.step, ctx.size)
            control.layout = BlockLayout(num_blocks, block, tail, own=(sum(blocks[:owned]), blocks[owned]))
            control.bounds = None
        else:
            control.layout = BlockLayout(num_blocks, block, tail, blocks=blocks)
            control.bounds = block_bounds(blocks, block, ctx.numel)

    def control_state(self, control: ExclusiveControl) -> dict:
        """MiCRO's control state with the block layout (fine blocks grouped into partitions)."""
        return {**super().control_state(control), "layout": control.layout.to_state()}

    def agreed_control(self, state: dict) -> dict:
        """What every rank agrees on of a rank's control state (elastic adoption); in neighbour mode a
        rank knows only its own partition."""
        if self.rebalance != "neighbour":
            return state
        # A rank knows only its own partition: another rank's is no use to the process adopting
        # this state, which starts again from the initial layout (load_control).
        layout = replace(BlockLayout.from_state(state["layout"]), own=None, own_count=None)
        return {**state, "layout": layout.to_state()}

    def load_control(self, state: dict, ctx: StepContext, saved_size: int) -> ExclusiveControl:
        """MiCRO's restore with the block layout; at another world size, the blocks regrouped evenly."""
        control = super().load_control(state, ctx, saved_size)
        if saved_size == ctx.size:
            control.layout = BlockLayout.from_state(state["layout"])
            if self.rebalance == "neighbour" and control.layout.own is None:   # agreed_control's
                self.reset_partitions(control, ctx)
                control.union_prev = None    # no rebalance before a step has been observed
        return control

    def own_range(self, control: ExclusiveControl, ctx: StepContext) -> tuple[int, int]:
        """This rank's partition, from the block layout (neighbour mode keeps only its own)."""
        if control.bounds is not None:
            return super().own_range(control, ctx)
        (first, blocks), block = control.layout.own, control.layout.block
        last = owned_partition(ctx.rank, ctx.step, ctx.size) == ctx.size - 1
        return first * block, ctx.numel if last else (first + blocks) * block

    def rebalance_partitions(self, control: ExclusiveControl, ctx: StepContext) -> Protocol:
        """Move the boundaries from the previous step's loads: the replicated sweep, the histogram
        placement, or the neighbour exchange (the one mode with collectives of its own)."""
        layout = control.layout
        if self.rebalance == "neighbour":
            yield from self._neighbour_rebalance(control, ctx)
            return
        if self.rebalance == "histogram":
            if layout.block_loads is None:   # nothing observed yet
                return
            blocks = histogram_blocks(layout.block_loads, ctx.size)
            if blocks is not None:
                control.moves = int(np.count_nonzero(   # boundaries that moved
                    np.cumsum(blocks)[:-1] != np.cumsum(layout.blocks)[:-1]))
                layout.blocks = blocks
                control.bounds = block_bounds(blocks, layout.block, ctx.numel)
            return
        if self.rebalance != "exact":
            return
        layout.blocks, control.moves = sweep(
            layout.blocks, control.counts_prev.tolist(), control.union_prev, ctx.numel,
            layout.block, layout.num_blocks, self._over, self._under)
        control.bounds = block_bounds(layout.blocks, layout.block, ctx.numel)

    def record_counts(self, control: ExclusiveControl, outcome: StepOutcome, ctx: StepContext) -> None:
        """Per-partition loads for the rebalancer (neighbour mode: this rank's own count only)."""
        layout = control.layout
        if control.bounds is None:  # neighbour mode: only the own count is known here
            layout.own_count = int(outcome.selected)
            return
        if self.rebalance != "histogram":
            super().record_counts(control, outcome, ctx)
            return
        # One count per block (one pass over the indices, one copy to the host); partitions are
        # whole blocks, so their counts are sums of these.
        edges = block_edges(layout.num_blocks, layout.block, ctx.numel)
        counts = ctx.backend.count_in_ranges(outcome.gathered_indices, edges)
        loads = counts.astype(np.float64)
        if layout.block_loads is not None:
            loads = self.histogram_decay * layout.block_loads + (1.0 - self.histogram_decay) * loads
        layout.block_loads = loads
        starts = np.concatenate([[0], np.cumsum(layout.blocks)[:-1]])
        control.counts_prev = np.add.reduceat(counts, starts)

    # --- neighbour mode: the exchange runs inside the step's protocol, before the selection -------
    def _neighbour_rebalance(self, control: ExclusiveControl, ctx: StepContext) -> Protocol:
        """Decide the boundaries of the partition this rank owned at t-1 with its neighbours'
        counts, hand the new range to rank r-1 (its owner at t) and take partition p+1's from
        rank r+1 (docs/algorithms.md#neighbour-rebalancing)."""
        b, size, layout = ctx.backend, ctx.size, control.layout
        previous = owned_partition(ctx.rank, ctx.step - 1, size)
        first, blocks = layout.own
        count = layout.own_count
        mine = b.from_numpy(np.array([count, blocks], dtype=np.int64))
        ((left, right),) = yield [Collective(NEIGHBOURS, f"{ctx.name}.loads", mine)]
        left_info = pair(b.to_numpy(left)) if previous > 0 else None
        right_info = pair(b.to_numpy(right)) if previous < size - 1 else None
        first, blocks, moved = neighbour_update(
            previous, ctx.step - 1, first, blocks, count, left_info, right_info,
            control.union_prev, layout.num_blocks, size, self._over, self._under)
        mine = b.from_numpy(np.array([first, blocks, moved], dtype=np.int64))
        ((_, from_right),) = yield [Collective(NEIGHBOURS, f"{ctx.name}.handoff", mine)]
        first, blocks, _ = (int(x) for x in b.to_numpy(from_right))
        layout.own = (first, blocks)
        control.moves = moved
