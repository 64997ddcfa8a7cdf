"""Gaussian-k with error feedback (docs/algorithms.md#gaussiank).

Each rank models the entries of its accumulated vector ``a = g + e`` as Gaussian, takes the
two-sided tail threshold ``λ = μ + σ·Φ⁻¹(1 − ρ/2)`` (μ, σ: mean and sample standard deviation of
the signed ``a``) that would leave k = floor(ρ·n) entries above it, and refines λ until the
count is near k. μ and σ are exactly rounded to float32 from the exact sums Σa and Σa², identical
on every backend and kernel (``Backend.mean_std``): a framework's ``std_mean`` rounds in its own
order, and the slightest change of λ changes the index set. Selection is O(n) per loop instead
of top-k's O(n log k). What is not sent stays in the residual; aggregation is the allgather of
(index, value) pairs.

Refinement (``variant``):

* ``"original"`` (paper mode: the authors' ``GaussianCompressor``): up to ``max_loops=100``
  loops over a shrinking candidate set. Let c be the count of candidates with ``|a| > λ`` plus
  those kept earlier. If c < 2k/3, keep those candidates, remove them from the candidate set and
  set λ ×= 0.1; if c > 4k/3, restrict the candidates to them and set λ ×= 2; otherwise keep them
  and stop. If the last loop found too many and fewer than 2k/3 are kept, the remaining
  candidates are kept too.
* ``"rescale"`` (option: the simpler loop of ``GaussianCompressor2`` and the SIDCo
  re-implementation, without their bookkeeping quirks): λ ×= 0.5 while fewer than 2k/3 entries
  exceed it, ×= 1.5 while more than 4k/3 do, for at most ``max_loops`` loops (default 3, SIDCo's);
  then every entry with ``|a| > λ`` is sent.

The count is therefore only approximately k. ``stats()["threshold"]`` is the last λ (averaged
over buckets, and over the tensors of a packed one).

Per-tensor steps pack (``packs_tensors``): each tensor of the bucket is selected in on its own,
its μ and σ from its own entries, so the decisions are a bucket per tensor's.

Reads of ``a`` (docs/kernels.md): μ and σ come with the accumulation (``accumulate_select``:
``Backend.accumulate_moments``, or each tensor's, ``accumulate_segment_moments``); a read that
selects at λ also counts at the thresholds the next loops can reach, so that the loops those
counts decide need no read of their own. "rescale" counts the tree of λ·0.5 and λ·1.5 two loops
deep. "original" runs in threshold form (``OriginalLoop``): its candidates are always an interval
of |a|, so each loop only asks where a count of |a| > t falls (``region``), and once a read has
selected the entries above a threshold that leaves more than 4k/3 but few, sorted on the host
they answer every remaining loop (up to 100, often circling among a few clustered candidates)
(``OriginalCounts``). The decisions are the loop's, on the same counts.
"""

from __future__ import annotations

import math
import statistics
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Unpack, cast

import numpy as np

from ..backends import Selected
from ..errors import ConfigurationError
from .base import GATHER, MODEL, TENSOR, Algorithm, StepContext, is_integer
from .corrections import CorrectionOptions

VARIANTS = ("original", "rescale")
_DEFAULT_LOOPS = {"original": 100, "rescale": 3}
RESCALE_AHEAD = 3   # loops of "rescale" one read of a decides: 2 + 4 probe counts
PROBES = 8          # probe counts a read takes on every path (the kernels' limit)
HOST_ENTRIES = 1 << 15   # "original": candidates this few are counted on the host
EXPLORED_LOOPS = 32      # "original": loops a read's lookahead follows on known counts, at most


@dataclass
class GaussianControl:
    """One bucket's control state on this rank."""
    threshold: float | None = None   # the last λ this rank used for the bucket
    # "original", each tensor of the bucket: where its last step's reads settled, over its λ
    # rounded (None: nowhere). Only a hint where the next step's first read selects: no decision
    # depends on it.
    settled: tuple[float | None, ...] | None = None


def strictly_above(threshold: float, dtype: str) -> float:
    """The smallest value of ``dtype`` greater than ``threshold`` rounded to ``dtype``, so that
    ``x >= strictly_above(t)`` is ``x > t`` as a framework compares a tensor with a Python float."""
    t = np.dtype(dtype).type(threshold)
    return float(np.nextafter(t, np.dtype(dtype).type(np.inf)))


def rescale_tree(threshold: float, levels: int) -> list[float]:
    """The thresholds the "rescale" loop can try in its next ``levels`` loops from ``threshold``,
    as a heap: entry i is followed by entry 2i + 1 (too few: ×0.5) or 2i + 2 (too many: ×1.5)."""
    tree = [threshold]
    while len(tree) < 2 ** levels - 1:
        i = len(tree)
        tree.append(tree[(i - 1) // 2] * (0.5 if i % 2 else 1.5))
    return tree


_PACKED = {"float32": struct.Struct("f"), "float16": struct.Struct("e")}


def rounding(dtype: str) -> Callable[[float], float]:
    """x rounded to ``dtype`` (as a float; beyond its range ±Inf): the value a framework compares a
    tensor with. struct rounds as NumPy does, in a fifth of the time (the loop rounds each λ)."""
    packed = _PACKED.get(dtype)
    if packed is None:
        kind = np.dtype(dtype).type
        return lambda x: float(kind(x))

    def rounded(x: float) -> float:
        try:
            return packed.unpack(packed.pack(x))[0]
        except OverflowError:
            return math.copysign(math.inf, x)
    return rounded


FEW, BETWEEN, MANY = -1, 0, 1   # where a count falls: below 2k/3, in [2k/3, 4k/3], above 4k/3


def region(count: float, k: int) -> int:
    """FEW, BETWEEN or MANY: all the "original" loop asks of a count."""
    return FEW if count < 2 * k / 3 else (MANY if count > 4 * k / 3 else BETWEEN)


@dataclass
class OriginalLoop:
    """The "original" loop in threshold form (pure: no tensor in sight).

    Each rule cuts the candidates at λ: "too few" keeps those above it and leaves those below,
    "too many" leaves those above. So the candidates are always the entries with lo < |a| <= hi
    and those kept the entries with |a| > hi, and the loop ends with one selection, |a| >
    ``cut()``. Each loop asks only where the count of |a| > t falls (``region``): those kept are
    always FEW (they grow only by a FEW count) and, once lo is a λ, those above lo MANY. These are
    the mask form's decisions (tests/reference/gaussiank.py), made on counts (``OriginalCounts``).
    """

    threshold: float                 # λ of the next loop
    k: int
    loops: int                       # loops left
    lo: float = -math.inf            # a λ once a loop found MANY
    hi: float = math.inf
    last_too_many: bool = False

    def run(self, rounded: Callable[[float], float], where: Callable[[float], int | None]) -> float | None:
        """Run loops (λ rounded by ``rounded``) while it is known where their counts fall: by the
        loop itself (no candidate above λ, or all of them) or by ``where``. Returns the t whose
        count of |a| > t the next loop needs and ``where`` does not place, or None once the loop
        has ended."""
        while self.loops > 0:
            least = rounded(self.threshold)
            if not least < self.hi:   # NaN included: only those kept
                known = FEW
            elif least <= self.lo > -math.inf:   # all candidates
                self.double_up_to_lo(rounded)
                continue
            else:
                known = where(max(least, self.lo))
                if known is None:
                    return max(least, self.lo)
            self.turn(least, known)
        return None

    def double_up_to_lo(self, rounded: Callable[[float], float]) -> None:
        """The run of "too many" loops while λ rounds to lo or below (every candidate is above it),
        at once: λ·2^m is m doublings exactly, and rounds to the rounded λ·2^m, so the run ends at
        the first m whose λ·2^m rounds above lo (found from log2, then checked)."""
        lam, lo = self.threshold, self.lo
        if lam <= 0:   # λ·2^m <= λ rounds to lo or below, for good
            m = self.loops
        else:
            start = rounded(lam)
            m = max(1, math.floor(math.log2(lo / start)) + 1) if start > 0 and lo > 0 else 1
            while m > 1 and rounded(math.ldexp(lam, m - 1)) > lo:
                m -= 1
            while m < self.loops and rounded(math.ldexp(lam, m)) <= lo:
                m += 1
        m = min(m, self.loops)
        if not math.isfinite(math.ldexp(lam, m)):   # overflow: one loop at a time
            m = 1
        self.threshold, self.loops, self.last_too_many = math.ldexp(lam, m), self.loops - m, True

    def turn(self, least: float, known: int) -> None:
        """The loop at ``least`` (λ rounded), the count above it with those kept being ``known``."""
        self.loops -= 1
        self.last_too_many = known == MANY
        if known == FEW:             # keep those above λ, and go on with those below
            if least < self.hi:
                self.hi = max(least, self.lo)
            self.threshold *= 0.1
        elif known == MANY:          # go on with those above λ
            self.lo = max(least, self.lo)
            self.threshold *= 2.0
        else:                        # between: keep those above λ, and stop
            self.hi, self.loops = max(least, self.lo), 0

    def cut(self) -> float:
        """Where the selection starts: those kept, and after a last "too many" (those kept being
        fewer than 2k/3) the candidates too."""
        return self.lo if self.last_too_many else self.hi

    def ahead(self, rounded: Callable[[float], float], where: Callable[[float], int | None]) -> list[float]:
        """Where the loop needs a count next, then where it needs one after that either way (too
        few, too many): a copy of it runs on the counts ``where`` places, EXPLORED_LOOPS loops at
        most each way."""
        first = replace(self, loops=min(self.loops, EXPLORED_LOOPS))
        wanted = [first.run(rounded, where)]
        for outcome in (FEW, MANY):
            branch = replace(first)
            branch.turn(rounded(branch.threshold), outcome)
            wanted.append(branch.run(rounded, where))
        return [t for t in dict.fromkeys(wanted) if t is not None]


class OriginalCounts:
    """Where the counts of |a| > t fall for ``OriginalLoop``, over one bucket's ``acc``, which it
    reads rarely.

    A read selects the entries above one threshold and counts those above up to PROBES others.
    Counts only fall as t grows, so a count known at u <= t bounds that at t from above and one at
    u >= t from below: where both bounds fall alike, so does the count. Selected entries that are
    at most HOST_ENTRIES are kept (``floor``: every entry above it), their magnitudes sorted on the
    host, which counts above the floor by a binary search; a floor that leaves more than 4k/3
    settles every count (``settling``), and the loops that circle among a few clustered
    candidates (up to 100) read nothing more.
    """

    def __init__(self, acc: Any, numel: int, dtype: str, k: int, b: Any, first: float | None = None):
        self.acc, self.numel, self.dtype, self.k, self.b = acc, numel, dtype, k, b
        self.first = first                          # where the first read selects (default: ahead[0])
        self.known: dict[float, int] = {}
        self.floor = math.inf                       # the host holds every entry with |a| > floor
        self.indices = self.magnitudes = None       # those entries (on the backend)
        self.sorted = np.empty(0)                   # their magnitudes, ascending (host)
        self.last: tuple[float, Any] | None = None  # the last read's threshold and selection

    def count(self, t: float) -> int | None:
        """Entries with |a| > t, where known exactly without a read."""
        if t >= self.floor:
            return self.sorted.size - int(np.searchsorted(self.sorted, t, side="right"))
        return self.known.get(t)

    def bounds(self, t: float) -> tuple[float, float]:
        """Bounds on the count of |a| > t from the counts known at other thresholds (the floor's
        among them: a read that sets it notes its count)."""
        high = min((c for u, c in self.known.items() if u <= t), default=self.numel)
        low = max((c for u, c in self.known.items() if u >= t), default=0)
        return high, low

    def where(self, t: float) -> int | None:
        """``region`` of the count of |a| > t, where known without a read."""
        exact = self.count(t)
        if exact is not None:
            return region(exact, self.k)
        high, low = self.bounds(t)
        return region(high, self.k) if region(high, self.k) == region(low, self.k) else None

    def read(self, ahead: list[float], rounded: Callable[[float], float]) -> None:
        """One read of ``acc`` that settles the count at ``ahead[0]`` (where the loop stands).

        Where a threshold is known to leave more than 4k/3 but at most HOST_ENTRIES, the read
        selects above the one of them that leaves the fewest: the host's entries then answer every
        count from there up, and below it every count is more than 4k/3. Otherwise it
        selects above ``ahead[0]`` unless that may select many (a dense selection costs a read over
        again; a first read trusts the Gaussian model), and counts at the next thresholds the loop
        may need (``ahead``) and at a ladder that looks for such a threshold (``ladder``)."""
        t, settling = ahead[0], self.settling()
        wanted: list[float]
        if self.numel <= HOST_ENTRIES:   # the whole vector
            at, wanted = -math.inf, []
        elif settling is not None:       # the fewest that settle every count
            at, wanted = settling, []
        elif self.known:
            at = t if self.bounds(t)[0] <= HOST_ENTRIES else math.inf
            wanted = [*ahead, 0.0, *self.ladder(t, rounded)]
        elif self.first is not None:   # a first read at the hint (``GaussianControl.settled``): it
            at, wanted = self.first, [t, 0.0]   # likely settles every count, so it counts little
        else:                          # a first read where the loop stands
            at, wanted = t, [0.0, *self.ladder(t, rounded)]
        probes = [u for u in dict.fromkeys(wanted) if u != at and u not in self.known][:PROBES]
        idx, counts = self.b.select_at_least(self.acc, 0, self.numel, strictly_above(at, self.dtype),
                                             [strictly_above(u, self.dtype) for u in probes])
        self.known.update(zip(probes, (round(c) for c in counts), strict=True))
        if at == math.inf:   # counted only (what it selected, the ±Inf entries, is not wanted)
            return
        self.known[at], self.last = self.b.numel(idx), (at, idx)
        if self.known[at] <= HOST_ENTRIES and at < self.floor:
            self.floor, self.indices = at, idx
            self.magnitudes = self.b.abs(self.b.take(self.acc, idx))
            self.sorted = np.sort(self.b.to_numpy(self.magnitudes).astype(np.float64))

    def settling(self) -> float | None:
        """The known threshold that leaves the fewest entries above 4k/3 but at most HOST_ENTRIES:
        selected, those answer every count that remains (None: none known)."""
        k = self.k
        return min(((c, u) for u, c in self.known.items() if 4 * k / 3 < c <= HOST_ENTRIES),
                   default=(None, None))[1]

    def ladder(self, t: float, rounded: Callable[[float], float]) -> list[float]:
        """Thresholds to count at in search of one that leaves more than 4k/3 but at most
        HOST_ENTRIES: spaced evenly in log |a| between the highest known to leave more than
        HOST_ENTRIES and the lowest known to leave at most 4k/3, or around t while neither is."""
        k = self.k
        above = [u for u, c in self.known.items() if c > HOST_ENTRIES and u > 0]
        below = [u for u, c in self.known.items() if c <= 4 * k / 3 and u > 0]
        low, high = max(above, default=None), min(below, default=None)
        if low is not None and high is not None and low < high:
            factors = [(high / low) ** (i / 6) for i in range(1, 6)]
            base = low
        elif high is not None:
            factors, base = [0.85, 0.7, 0.5, 0.3, 0.1, 0.03], high
        elif low is not None:
            factors, base = [1.2, 1.5, 2.0, 3.0, 5.0, 10.0], low
        else:
            factors, base = [0.85, 0.7, 0.5, 0.3, 0.1, 1.3, 2.0], t
        return [rounded(base * f) for f in factors] if base > 0 else []

    def select(self, cut: float) -> Any:
        """The ascending indices with |a| > ``cut``, from the host's entries or the last read where
        they hold them, else from one more read."""
        b = self.b
        if cut == math.inf:
            return b.arange(0, 0, like=self.acc)
        if cut == self.floor:
            return self.indices
        if cut > self.floor:
            return b.take(self.indices, b.indices_where_at_least(self.magnitudes,
                                                                 strictly_above(cut, self.dtype)))
        if self.last is not None and self.last[0] == cut:
            return self.last[1]
        return b.select_at_least(self.acc, 0, self.numel, strictly_above(cut, self.dtype))[0]


class GaussianK(Algorithm):
    """Error-feedback Gaussian-k.

    Args:
        density: target fraction of entries each rank sends per step, in (0, 1]; k = floor(density
            * n), at least 1. The count sent is only approximately k.
        variant: "original" (paper mode) or "rescale" (see module docstring).
        max_loops: refinement loops at most (default 100 for "original", 3 for "rescale").
        scope: "tensor" (per gradient tensor) or "model" (the whole model).
    """

    name = "gaussiank"
    patterns = (GATHER,)
    scopes = (TENSOR, MODEL)
    packs_tensors = True

    def __init__(self, density: float = 0.01, *, variant: str = "original", max_loops: int | None = None,
                 scope: str = TENSOR, **corrections: Unpack[CorrectionOptions]):
        super().__init__(density, scope=scope, **corrections)
        if variant not in VARIANTS:
            raise ConfigurationError(f"variant must be one of {VARIANTS}, got {variant!r}")
        if max_loops is None:
            max_loops = _DEFAULT_LOOPS[variant]
        if not is_integer(max_loops) or max_loops < 0:
            raise ConfigurationError(f"max_loops must be a non-negative integer, got {max_loops!r}")
        self.variant = variant
        self.max_loops = int(max_loops)

    def initial_threshold(self, mean: float, std: float, density: float | None = None) -> float:
        """λ = μ + σ·Φ⁻¹(1 − ρ/2): the upper edge of the two-sided Gaussian tail of mass ρ
        (ρ: ``density``, default the method's)."""
        density = self.density if density is None else density
        return mean + std * statistics.NormalDist().inv_cdf(1.0 - density / 2.0)

    def init_control(self, ctx: StepContext) -> GaussianControl:
        """No threshold yet."""
        return GaussianControl()

    def accumulate_select(self, residual: Any, tensors: list, control: GaussianControl, ctx: StepContext,
                          clear_inputs: bool, check_finite: bool) -> Selected:
        """Error feedback with μ and σ taken in the accumulating pass (``Backend.accumulate_moments``;
        in a bucket packing per-tensor steps each tensor's, ``accumulate_segment_moments``), then the
        selection: one read of ``a`` fewer than ``accumulate`` and ``select_local``, the same
        decisions."""
        b, options = ctx.backend, (clear_inputs, check_finite, ctx.momentum)
        moments: list[tuple[float, float]]
        if ctx.members:
            acc, found, finite = b.accumulate_segment_moments(residual, tensors, list(ctx.sizes), *options)
            moments = cast("list[tuple[float, float]]", found)
        else:
            acc, whole, finite = b.accumulate_moments(residual, tensors, *options)
            moments = [cast("tuple[float, float]", whole)]
        if not finite:
            return Selected(acc, None, [], False)
        return Selected(acc, self._select_tensors(acc, moments, control, ctx), [], True)

    def select_local(self, acc: Any, control: GaussianControl, ctx: StepContext) -> Any:
        """The selection from μ and σ (``Backend.mean_std``) of ``acc``, or of each tensor of a bucket
        packing per-tensor steps."""
        b = ctx.backend
        moments = [b.mean_std(b.slice(acc, offset, offset + size))
                   for offset, size, _ in self.tensor_segments(ctx)]
        return self._select_tensors(acc, moments, control, ctx)

    def _select_tensors(self, acc: Any, moments: list[tuple[float, float]], control: GaussianControl,
                        ctx: StepContext) -> Any:
        """The selection in each tensor of ``tensor_segments`` on its own (``select_per_tensor``), from
        its (μ, σ) in ``moments``; λ is then their mean."""
        thresholds: list[float] = []
        settled: list = []
        tensor_moments = iter(moments)
        hints = control.settled or ()

        def select(part: Any, numel: int) -> Any:
            hint = hints[len(settled)] if len(settled) < len(hints) else None
            idx, threshold, settles = self._select(part, *next(tensor_moments), numel, hint, ctx)
            thresholds.append(threshold)
            settled.append(settles)
            return idx

        idx = self.select_per_tensor(acc, control, ctx, select)
        control.threshold, control.settled = float(np.mean(thresholds)), tuple(settled)
        return idx

    def _select(self, acc: Any, mean: float, std: float, numel: int, hint: float | None, ctx: StepContext
                ) -> tuple[Any, float, float | None]:
        """The loop of ``variant`` on ``acc`` of ``numel`` entries (a bucket, or one tensor of it):
        the indices, the last λ, and where "original"'s reads settled (``GaussianControl``)."""
        k = self.k(numel, self.step_density(ctx))
        threshold = self.initial_threshold(mean, std, self.step_density(ctx))
        dtype = ctx.backend.dtype_name(acc)
        if self.variant == "rescale":
            return *self._rescale(acc, threshold, k, dtype, numel, ctx), None
        return self._original(acc, threshold, k, dtype, numel, hint, ctx)

    def _original(self, acc: Any, threshold: float, k: int, dtype: str, numel: int, hint: float | None,
                  ctx: StepContext) -> tuple[Any, float, float | None]:
        """The "original" loop (module docstring): ``OriginalLoop`` on ``OriginalCounts``, whose first
        read selects at ``hint`` times λ rounded (where the last step's settled), else at λ."""
        loop, rounded = OriginalLoop(threshold, k, self.max_loops), rounding(dtype)
        start = rounded(threshold)
        first = rounded(start * hint) if hint is not None and start > 0 else None
        counts = OriginalCounts(acc, numel, dtype, k, ctx.backend, first)
        with np.errstate(over="ignore"):   # λ beyond the dtype rounds to ±Inf, as a framework's compare
            while loop.run(rounded, counts.where) is not None:
                counts.read(loop.ahead(rounded, counts.where), rounded)
        settling = counts.settling()
        settled = settling / start if settling is not None and settling > 0 and start > 0 else None
        return counts.select(loop.cut()), loop.threshold, settled

    def _rescale(self, acc: Any, threshold: float, k: int, dtype: str, numel: int, ctx: StepContext
                 ) -> tuple[Any, float]:
        """The loop above, read off ``a`` in passes that each decide up to RESCALE_AHEAD loops: a
        pass selects |a| > λ and counts |a| > t for every t the next loops can reach from λ (the
        tree of λ·0.5 and λ·1.5, each computed as the loop computes it); the counts then walk the
        loop. The loop stops at λ (its entries are in hand), at a later t (one more pass selects
        there), or runs out of loops (likewise)."""
        b = ctx.backend
        loops = self.max_loops
        while True:
            ahead = min(loops, RESCALE_AHEAD)
            tree = rescale_tree(threshold, ahead)
            idx, counts = b.select_at_least(acc, 0, numel, strictly_above(threshold, dtype),
                                            [strictly_above(t, dtype) for t in tree[1:]])
            node = 0
            for _ in range(ahead):
                count = b.numel(idx) if node == 0 else round(counts[node - 1])
                if count < 2 * k / 3:
                    node, threshold = 2 * node + 1, threshold * 0.5
                elif count > 4 * k / 3:
                    node, threshold = 2 * node + 2, threshold * 1.5
                elif node == 0:
                    return idx, threshold   # this pass's entries: no further read
                else:
                    break
            if node == 0:   # no loop left
                return idx, threshold
            loops -= ahead
            if node < len(tree):   # stopped at a counted λ: one more pass selects there
                return b.select_at_least(acc, 0, numel, strictly_above(threshold, dtype))[0], threshold

    def control_stats(self, control: GaussianControl) -> dict:
        """The last λ, once there is one."""
        return {} if control.threshold is None else {"threshold": control.threshold}
