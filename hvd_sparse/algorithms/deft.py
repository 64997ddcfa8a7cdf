"""DEFT: norm-proportional per-layer k and bin-packed layer ownership (docs/algorithms.md#deft).

The model is one flat vector cut into *units* (docs/algorithms.md#units): a tensor of over n/N entries is
split into N near-equal units, any other tensor is one unit. Every step, on every rank:

1. each unit's L2 norm from this rank's own accumulated vector ``a = g + e``;
2. a greedy split of k = int(density * n) over the units in proportion to their norms, largest
   norm first, each unit getting at least 1 and at most its size (docs/algorithms.md#splitting-k);
3. the rotating master m = t mod N packs the units into N bins, largest estimated selection cost
   first into the least-loaded bin (cost size * log2(k_u), or size when k_u = 1); a unit whose k_u
   is its whole size is *common*: every rank sends all of it, it sits in no bin;
4. the master broadcasts the assignment (one int32 vector: the N bin sizes, then the unit ids of
   the bins in bin order followed by the common units, then with ``agreed_k`` its k_u: one
   collective, not one per vector, since each costs a round of Horovod's negotiation); rank r owns
   bin (m + r) mod N;
5. rank r sends the top-k_u entries of each unit it owns, with its *own* k_u;
6. union pattern: the gathered selections (disjoint by construction) followed by every index of
   every common unit; every rank sends its own values there, the average is applied and every rank
   clears its residual on the whole union.

Paper mode (the defaults) follows the authors' code, including its quirks: k_u comes from each
rank's own norms, so the total only approximates k, and the floor of 1 can overshoot it
(docs/algorithms.md#local-k-in-deft). Guards, which change nothing the authors' code computes
without crashing (docs/algorithms.md#deft-guards): q is clamped at 0 and R_w must stay positive;
non-finite norms count as 0 (the code would fail on int(nan), on that rank only, and hang the
others); zero-size units (a tensor of fewer than N entries that still has more than n/N) are
dropped, where the code would call top-k on an empty slice. Norms are float32 -- the precision
of the authors' torch.norm -- and exactly float32(sqrt(S)) for the exact sum of squares S
(``Backend.segment_norms``), so every backend and kernel splits k identically (the split is
sensitive to single bits: the last unit gets int(R_k * w / R_w) with w / R_w near 1).

Host work per step: the L norms, the broadcast vectors and the gathered indices (for the
per-rank counts) are read back to the host, which synchronizes a GPU three times per step.

Named options, each off in paper mode:

* ``agreed_k=True``: the master also broadcasts its k_u and every rank uses them, so the
  aggregated count is exactly the master's sum of k_u (docs/algorithms.md#local-k-in-deft).
* ``packing="heap"``: the same packing by sorting plus a heap of bins, O(L log L) instead of the
  code's O(L^2) linear scans; it yields the identical assignment (tested).

A rank whose bin is empty contributes nothing in the authors' code; a Horovod collective must
never be empty, so such a rank sends one index instead: the i-th such rank (in rank order) sends
the i-th element of the common units' indices, and the union appends the common units without
those elements, so no index is aggregated twice and the union is exactly what paper mode
aggregates. With at least as many entries as ranks, there are always at least as many common
elements as empty bins (an empty bin means fewer than N units outside the common set, and there
are at least N units); smaller models are refused.
"""

from __future__ import annotations

import heapq
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Unpack

import numpy as np

from ..comm import BROADCAST, Collective, Protocol
from ..errors import ConfigurationError
from .base import MODEL, UNION, Algorithm, StepContext, StepOutcome, check_choice
from .corrections import CorrectionOptions

PACKINGS = ("linear", "heap")
CONTROL_FORMAT = 1


# --- control decisions: small pure functions every rank computes identically -------------------

@dataclass(frozen=True)
class UnitTable:
    """Contiguous units of the flat model vector, in parameter order."""

    starts: tuple[int, ...]
    sizes: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.sizes)


def build_unit_table(tensor_sizes: Sequence[int], world_size: int) -> UnitTable:
    """docs/algorithms.md#units: a tensor of strictly more than n/N entries becomes N units whose sizes
    differ by at most one (the first ``size mod N`` get the extra entry); any other tensor is one
    unit. Empty units are dropped (guard: see module docstring)."""
    n = sum(tensor_sizes)
    starts: list[int] = []
    sizes: list[int] = []
    position = 0
    for size in tensor_sizes:
        if size > n / world_size:
            base, extra = divmod(size, world_size)
            pieces = [base + (1 if i < extra else 0) for i in range(world_size)]
        else:
            pieces = [size]
        for piece in pieces:
            if piece > 0:
                starts.append(position)
                sizes.append(piece)
            position += piece
    return UnitTable(tuple(starts), tuple(sizes))


def float32_norms(norms: Sequence[float] | np.ndarray) -> list[float]:
    """Norms at float32 precision, non-finite ones as 0 (guards: see module docstring)."""
    out = []
    for w in np.asarray(norms, dtype=np.float64).astype(np.float32).tolist():
        out.append(w if math.isfinite(w) and w > 0 else 0.0)
    return out


def split_k(norms: Sequence[float], sizes: Sequence[int], k: int) -> list[int]:
    """k split in proportion to the units' norms (docs/algorithms.md#splitting-k), largest first (ties:
    higher unit index first, as a stable sort reversed). Each unit gets ``size`` if the
    proportional share q exceeds it, else max(1, q); what a unit does not take is left to the
    units after it. The total can exceed k by one per unit that received the floor of 1."""
    weights = [float(w) for w in norms]
    order = np.argsort(np.asarray(weights), kind="stable")[::-1].tolist()
    remaining_k = k
    remaining_w = sum(weights)
    k_units = [0] * len(weights)
    for u in order:
        q = int(remaining_k * (weights[u] / remaining_w)) if remaining_w > 0 else 0
        q = max(q, 0)   # docs/algorithms.md#deft-guards: a negative remainder truncates toward zero; clamp it
        k_units[u] = sizes[u] if sizes[u] < q else max(1, q)
        remaining_k -= k_units[u]
        remaining_w -= weights[u]
    return k_units


def unit_cost(size: int, k: int) -> float:
    """Estimated cost of a heap top-k of k out of ``size`` entries: size * log2(k), or size."""
    return size * math.log2(k) if k > 1 else float(size)


@dataclass(frozen=True)
class Packing:
    """The master's assignment: unit ids per bin (in insertion order), common units, bin loads."""

    bins: tuple[tuple[int, ...], ...]
    common: tuple[int, ...]
    loads: tuple[float, ...]


def pack_linear(k_units: Sequence[int], sizes: Sequence[int], n_bins: int) -> Packing:
    """docs/algorithms.md#packing as the authors' code does it: L times, a linear scan for the unit of largest
    remaining cost (ties: lowest id) and one for the least-loaded bin (ties: lowest index). A unit
    with k_u == size is common and adds no load. O(L^2)."""
    costs = [unit_cost(s, k) for s, k in zip(sizes, k_units, strict=True)]
    remaining = list(costs)
    loads = [0.0] * n_bins
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    common: list[int] = []
    for _ in range(len(costs)):
        unit = remaining.index(max(remaining))
        target = loads.index(min(loads))
        if k_units[unit] == sizes[unit]:
            common.append(unit)
        else:
            bins[target].append(unit)
            loads[target] += costs[unit]
        remaining[unit] = -1.0   # every real cost is >= 1
    return Packing(tuple(map(tuple, bins)), tuple(common), tuple(loads))


def pack_heap(k_units: Sequence[int], sizes: Sequence[int], n_bins: int) -> Packing:
    """The same packing in O(L log L): units sorted by (cost descending, id), bins in a heap of
    (load, index). Loads are summed in the same order, so the result is identical."""
    costs = [unit_cost(s, k) for s, k in zip(sizes, k_units, strict=True)]
    loads = [0.0] * n_bins
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    common: list[int] = []
    heap = [(0.0, b) for b in range(n_bins)]   # sorted, hence a heap
    for unit in sorted(range(len(costs)), key=lambda u: (-costs[u], u)):
        if k_units[unit] == sizes[unit]:
            common.append(unit)
            continue
        load, target = heapq.heappop(heap)
        bins[target].append(unit)
        loads[target] = load + costs[unit]
        heapq.heappush(heap, (loads[target], target))
    return Packing(tuple(map(tuple, bins)), tuple(common), tuple(loads))


def encode_assignment(packing: Packing) -> tuple[np.ndarray, np.ndarray]:
    """The two int32 vectors the master's broadcast begins with: bin sizes, then the bins' unit
    ids in bin order followed by the common unit ids."""
    bin_sizes = np.array([len(b) for b in packing.bins], dtype=np.int32)
    unit_ids = np.array([u for b in packing.bins for u in b] + list(packing.common), dtype=np.int32)
    return bin_sizes, unit_ids


def decode_assignment(bin_sizes: np.ndarray, unit_ids: np.ndarray
                      ) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Bins and common units from the broadcast vectors."""
    ids = [int(u) for u in unit_ids]
    bins, position = [], 0
    for count in (int(c) for c in bin_sizes):
        bins.append(tuple(ids[position:position + count]))
        position += count
    return tuple(bins), tuple(ids[position:])


def owned_bin(rank: int, master: int, world_size: int) -> int:
    """docs/algorithms.md#assignment: rank r takes bin (m + r) mod N (the master itself bin 2m mod N)."""
    return (master + rank) % world_size


def common_indices(table: UnitTable, common: Sequence[int]) -> np.ndarray:
    """Every index of every common unit, unit by unit in broadcast order, ascending inside."""
    if not common:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(table.starts[u], table.starts[u] + table.sizes[u], dtype=np.int64)
                           for u in common])


def empty_bin_ranks(bins: Sequence[Sequence[int]], master: int) -> list[int]:
    """Ranks, ascending, whose bin is empty this step."""
    n = len(bins)
    return [r for r in range(n) if not bins[owned_bin(r, master, n)]]


def per_rank_counts(gathered: np.ndarray, table: UnitTable, bins: Sequence[Sequence[int]],
                    master: int, fallback_ranks: Sequence[int]) -> list[int]:
    """How many indices each rank contributed to the gather, from the gathered indices: each
    index belongs to one unit, each unit to the rank owning its bin; a rank whose bin is empty
    sent exactly one (fallback) index."""
    n = len(bins)
    owner = np.full(len(table), -1, dtype=np.int64)
    for b, units in enumerate(bins):
        owner[list(units)] = (b - master) % n
    unit_of = np.searchsorted(np.asarray(table.starts, dtype=np.int64), gathered, side="right") - 1
    owners = owner[unit_of]
    counts = np.bincount(owners[owners >= 0], minlength=n)
    counts[list(fallback_ranks)] += 1
    return [int(c) for c in counts]


# --- the method ---------------------------------------------------------------------------------

@dataclass
class DeftControl:
    """DEFT's host state. Only the unit table persists across steps; the rest describes the
    current step (the assignment, the fallback indices, the common indices to append) and the
    statistics of the last one."""

    table: UnitTable
    world_size: int
    step: int = 0
    master: int = 0
    k_units: tuple[int, ...] = ()
    bins: tuple[tuple[int, ...], ...] = ()
    common: tuple[int, ...] = ()
    fallback_ranks: tuple[int, ...] = ()
    fallback_index: dict[int, int] = field(default_factory=dict)
    common_appended: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    device_like: Any = None
    stats: dict = field(default_factory=dict)
    norms: tuple | None = None   # (accumulated vector, its unit norms), from accumulate to select


class DEFT(Algorithm):
    """DEFT (docs/algorithms.md#deft): per-unit k in proportion to the gradient norm, units packed into
    one bin per rank by a rotating master, each rank selecting top-k inside its own units.

    Args:
        density: target fraction of entries aggregated per step, in (0, 1]; k = int(density * n).
        agreed_k: option (off in paper mode): the master also broadcasts its per-unit k and every
            rank uses it, so the aggregated count is exactly the master's total.
        packing: "linear" (paper mode: the code's O(L^2) scans) or "heap" (O(L log L), identical
            result).
    """

    name = "deft"
    patterns = (UNION,)
    scopes = (MODEL,)
    exclusive = True

    def __init__(self, density: float = 0.001, *, agreed_k: bool = False, packing: str = "linear",
                 **corrections: Unpack[CorrectionOptions]):
        super().__init__(density, pattern=UNION, scope=MODEL, **corrections)
        if not isinstance(agreed_k, bool):
            raise ConfigurationError(f"agreed_k must be True or False, got {agreed_k!r}")
        self.agreed_k = agreed_k
        self.packing = check_choice("packing", packing, PACKINGS)

    @property
    def select_collectives(self) -> bool:
        """Yes: the master broadcasts the bin assignment in ``select``."""
        return True   # the master broadcasts the bin assignment in ``select``

    # --- control state ----------------------------------------------------------------------------
    def init_control(self, ctx: StepContext) -> DeftControl:
        """The unit table of the bucket for this world size, at the step it is made."""
        return DeftControl(self._unit_table(ctx), ctx.size, step=ctx.step)

    def _unit_table(self, ctx: StepContext) -> UnitTable:
        if ctx.numel < ctx.size:
            raise ConfigurationError(
                f"DEFT needs at least as many gradient entries as ranks: the model has {ctx.numel}, "
                f"the job {ctx.size} ranks; use a larger model or another method (e.g. TopK)")
        sizes = ctx.sizes or (ctx.numel,)
        if sum(sizes) != ctx.numel:
            raise ConfigurationError(f"tensor sizes {sizes} do not add up to the bucket's {ctx.numel}")
        return build_unit_table(sizes, ctx.size)

    def control_state(self, control: DeftControl) -> dict:
        """Step, world size and unit table, as plain data."""
        return {"format": CONTROL_FORMAT, "step": control.step, "world_size": control.world_size,
                "unit_starts": list(control.table.starts), "unit_sizes": list(control.table.sizes)}

    def load_control(self, state: dict, ctx: StepContext, saved_size: int) -> DeftControl:
        """The checkpoint's unit table, or one rebuilt (with a warning) at another world size."""
        table = self._unit_table(ctx)
        if saved_size != ctx.size:
            warnings.warn(f"hvd_sparse DEFT: unit table rebuilt for world size {ctx.size} (the "
                          f"checkpoint's, for {saved_size} ranks, had {len(state['unit_sizes'])} "
                          f"units; now {len(table)})", stacklevel=2)
        elif (tuple(state["unit_starts"]), tuple(state["unit_sizes"])) != (table.starts, table.sizes):
            raise ConfigurationError(
                "the checkpoint's DEFT unit table does not match this model's tensors: load a "
                "checkpoint of the same model")
        return DeftControl(table, ctx.size, step=ctx.step)

    # --- selection --------------------------------------------------------------------------------
    def accumulate(self, residual: Any, tensors: list, control: DeftControl, ctx: StepContext) -> Any:
        """Error feedback with the units' norms taken in the same pass (``Backend.accumulate_norms``),
        so that ``select`` does not read the vector again for them."""
        acc, norms = ctx.backend.accumulate_norms(residual, tensors, list(control.table.sizes),
                                                  ctx.momentum)
        control.norms = (acc, norms)
        return acc

    def select(self, acc: Any, control: DeftControl, ctx: StepContext) -> Protocol:
        """Per-unit k from the norms, the master's bin packing broadcast, and this rank's selection in its
        bins (module docstring)."""
        b, table, n_ranks = ctx.backend, control.table, ctx.size
        # The norms of accumulate, where this is the vector it made (not the zeros of a step
        # whose gradient was not finite); the same values segment_norms gives.
        taken, control.norms = control.norms, None
        norms = float32_norms(taken[1] if taken is not None and taken[0] is acc
                              else b.segment_norms(acc, list(table.sizes)))
        k_units = split_k(norms, table.sizes, int(self.step_density(ctx) * ctx.numel))
        master = ctx.step % n_ranks
        if ctx.rank == master:
            pack = pack_heap if self.packing == "heap" else pack_linear
            bin_sizes, unit_ids = encode_assignment(pack(k_units, table.sizes, n_ranks))
            master_k = np.asarray(k_units, dtype=np.int32)
        else:
            bin_sizes = np.zeros(n_ranks, dtype=np.int32)
            unit_ids = np.zeros(len(table), dtype=np.int32)
            master_k = np.zeros(len(table), dtype=np.int32)
        vectors = [bin_sizes, unit_ids, master_k] if self.agreed_k else [bin_sizes, unit_ids]
        (received,) = yield [Collective(BROADCAST, f"{ctx.name}.deft.assign",
                                        b.from_numpy(np.concatenate(vectors), like=acc), master)]
        received = b.to_numpy(received)
        bins, common = decode_assignment(received[:n_ranks], received[n_ranks:n_ranks + len(table)])
        if self.agreed_k:
            k_units = [int(k) for k in received[n_ranks + len(table):]]
        self._record_assignment(control, ctx, master, tuple(k_units), bins, common, acc)

        return b.topk_abs_segments(acc, [(table.starts[unit], table.sizes[unit], k_units[unit])
                                         for unit in bins[owned_bin(ctx.rank, master, n_ranks)]])

    def _record_assignment(self, control: DeftControl, ctx: StepContext, master: int,
                           k_units: tuple[int, ...], bins: tuple, common: tuple, like: Any) -> None:
        """Keep the step's assignment, and decide the fallback indices of empty bins: the i-th
        rank with an empty bin sends the i-th common index, which the union then does not append
        again (see module docstring)."""
        everything_common = common_indices(control.table, common)
        empty = empty_bin_ranks(bins, master)
        if len(empty) > everything_common.size:  # unreachable when numel >= size (docstring)
            raise RuntimeError(f"DEFT: {len(empty)} empty bins but only {everything_common.size} "
                               "common entries to send from them")
        control.master, control.k_units, control.bins, control.common = master, k_units, bins, common
        control.fallback_ranks = tuple(empty)
        control.fallback_index = {r: int(everything_common[i]) for i, r in enumerate(empty)}
        control.common_appended = everything_common[len(empty):]
        control.device_like = like

    def fallback(self, control: DeftControl, ctx: StepContext) -> Any:
        """This rank's bin is empty: send its designated common index."""
        index = np.array([control.fallback_index[ctx.rank]], dtype=np.int64)
        return ctx.backend.from_numpy(index, like=control.device_like)

    def union_indices(self, gathered: Any, control: DeftControl, ctx: StepContext) -> Any:
        """The gathered selections (disjoint), then every common index not already gathered as
        a fallback: identical on every rank, without duplicates."""
        b = ctx.backend
        if control.common_appended.size == 0:
            return gathered
        extra = control.common_appended.astype(b.dtype_name(gathered))
        return b.concat([gathered, b.from_numpy(extra, like=gathered)])

    def observe(self, control: DeftControl, outcome: StepOutcome, ctx: StepContext) -> DeftControl:
        """The step's statistics: per-rank counts read off the gathered indices, imbalance, costs, k per
        unit."""
        n_ranks, table = ctx.size, control.table
        gathered = np.asarray(ctx.backend.to_numpy(outcome.gathered_indices), dtype=np.int64)
        counts = per_rank_counts(gathered, table, control.bins, control.master, control.fallback_ranks)
        union = outcome.union_size if outcome.union_size is not None else sum(counts)
        costs = [sum(unit_cost(table.sizes[u], control.k_units[u])
                     for u in control.bins[owned_bin(r, control.master, n_ranks)])
                 for r in range(n_ranks)]
        control.stats = {
            "counts": counts,
            "imbalance": n_ranks * max(counts) / union - 1.0,
            "costs": costs,
            "k_per_unit": {"min": min(control.k_units), "median": float(np.median(control.k_units)),
                           "max": max(control.k_units)},
            "common": int(control.common_appended.size),
            "units": len(table),
            "master": control.master,
        }
        control.step = ctx.step + 1
        control.device_like = None
        return control

    def control_stats(self, control: DeftControl) -> dict:
        """``counts`` (indices each rank contributed to the gather, by rank), ``imbalance``
        (N * max count / union - 1), ``costs`` (estimated selection cost of each rank's bin, from
        the k_u this rank holds: its own, or the master's with agreed_k), ``k_per_unit``
        (min/median/max of those k_u), ``common`` (entries of common units appended to the union
        besides the gathered ones: union == sum(counts) + common), ``units``, ``master``."""
        return dict(control.stats)
