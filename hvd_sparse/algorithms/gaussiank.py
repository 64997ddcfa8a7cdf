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
``Backend.accumulate_moments``); a read that selects at λ also counts at the thresholds the next
loops can reach (rescale: the tree of λ·0.5 and λ·1.5 two loops deep; original, in a run of "too
few": the next λ·0.1^i), so that the loops those counts decide need no read of their own. The
decisions are the loop's, on the same counts.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Unpack

import numpy as np

from ..backends import Selected
from ..errors import ConfigurationError
from .base import GATHER, MODEL, TENSOR, Algorithm, StepContext, is_integer
from .corrections import CorrectionOptions

VARIANTS = ("original", "rescale")
_DEFAULT_LOOPS = {"original": 100, "rescale": 3}
RESCALE_AHEAD = 3   # loops of "rescale" one read of a decides: 2 + 4 probe counts
ORIGINAL_AHEAD = 8  # "too few" loops of "original" a read of a can decide: the next λ·0.1^i


@dataclass
class GaussianControl:
    """One bucket's control state on this rank."""
    threshold: float | None = None   # the last λ this rank used for the bucket


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


def band(acc: Any, idx: Any, lower: float | None, upper: float | None, dtype: str, b: Any) -> Any:
    """The entries of ``idx`` (ascending) with lower <= |a| < upper (None: no bound), in order;
    |a| < upper as -|a| > -upper."""
    if lower is not None:
        idx = b.take(idx, b.indices_where_at_least(b.abs(b.take(acc, idx)), lower))
    if upper is not None:
        below = b.scale(b.abs(b.take(acc, idx)), -1.0)
        idx = b.take(idx, b.indices_where_at_least(below, strictly_above(-upper, dtype)))
    return idx


def bands(acc: Any, idx: Any, lowers: list[float], upper: float | None, dtype: str, b: Any) -> list:
    """The deferred bands out of ``idx`` (which holds every entry with |a| >= lowers[-1]):
    lowers[0] <= |a| < upper, then lowers[1] <= |a| < lowers[0], ..."""
    return [band(acc, idx, lower, high, dtype, b)
            for lower, high in zip(lowers, [upper, *lowers], strict=False)]


@dataclass
class OriginalLoop:
    """The state of the "original" loop over one bucket's accumulated vector ``acc``.

    The candidates: their magnitudes and where they are in the bucket. While they are the whole
    bucket less those kept (all with |a| >= ``kept_from``), both stay implicit (None): counts are
    read off ``acc`` itself in one pass, and no vector of the bucket's size is made.

    A run of "too few" loops in that state keeps the bands least_i <= |a| < least_{i-1} of λ,
    λ·0.1, λ·0.01, ...: a read of ``acc`` there also counts |a| >= t at the next ORIGINAL_AHEAD of
    them (``total``), so that the loops they decide need no read of their own; their bands
    (``deferred``: each band's lower end; the first one's upper end is ``deferred_from``) are cut
    out of the next read, which selects all of them.
    """

    acc: Any
    b: Any                                   # the backend
    dtype: str
    k: int
    numel: int
    threshold: float                         # λ of the next loop
    candidates: Any = None
    positions: Any = None
    kept_from: float | None = None
    kept: list = field(default_factory=list)
    n_kept: int = 0
    last_too_many: bool = False
    total: dict[float, int] = field(default_factory=dict)
    deferred: list[float] = field(default_factory=list)
    deferred_from: float | None = None

    def none_left(self, least: float) -> bool:
        """Implicit candidates, and λ rounds to where it was (0): none left."""
        return self.candidates is None and self.kept_from is not None and not least < self.kept_from

    def defer_known_too_few(self, least: float) -> bool:
        """Whether the last read's counts already say "too few" at ``least``; if so, the loop's
        band is deferred (cut out later) and λ moves on, without a read."""
        if self.candidates is not None or self.none_left(least) or self.threshold < 0:
            return False
        if not self.total.get(least, 2 * self.k / 3) < 2 * self.k / 3:
            return False
        if not self.deferred:
            self.deferred_from = self.kept_from
        self.deferred.append(least)
        self.n_kept, self.kept_from = self.total[least], least
        self.threshold *= 0.1
        return True

    def above(self, least: float) -> Any:
        """The candidates with |a| >= ``least``: as positions in ``candidates`` when those are
        explicit, else as indices of the bucket."""
        if self.candidates is not None:
            return self.b.indices_where_at_least(self.candidates, least)
        if self.none_left(least):
            return self.b.arange(0, 0, like=self.acc)   # no read
        return self.read(least)

    def read(self, least: float) -> Any:
        """One pass over ``acc``: the entries with |a| >= ``least`` not kept earlier, the counts of
        the next "too few" thresholds, and the deferred bands, kept."""
        b = self.b
        probes = ([strictly_above(self.threshold * 0.1 ** (i + 1), self.dtype) for i in range(ORIGINAL_AHEAD)]
                  if self.kept_from is not None and self.threshold >= 0 else [])
        above, counts = b.select_at_least(self.acc, 0, self.numel, least, probes)
        self.total = dict(zip(probes, (round(c) for c in counts), strict=True)) if probes else {}
        self.kept += bands(self.acc, above, self.deferred, self.deferred_from, self.dtype, b)
        self.deferred = []
        if self.kept_from is not None:   # drop those kept earlier: |a| < kept_from
            above = band(self.acc, above, None, self.kept_from, self.dtype, b)
        return above

    def keep(self, above: Any) -> None:
        """Keep ``above`` (as indices of the bucket)."""
        self.kept.append(above if self.positions is None else self.b.take(self.positions, above))
        self.n_kept += self.b.numel(above)

    def judge(self, above: Any, least: float) -> bool:
        """Apply the loop's rule to the count at ``least``; whether the loop goes on."""
        count = self.n_kept + self.b.numel(above)
        self.last_too_many = False
        if count < 2 * self.k / 3:
            self.keep_too_few(above, least)
            return True
        if count > 4 * self.k / 3:
            self.narrow(above)
            return True
        self.keep(above)
        return False

    def keep_too_few(self, above: Any, least: float) -> None:
        """Keep ``above``, remove it from the candidates and lower λ ×0.1. λ keeps its sign (it is
        only ever scaled by positive factors): for λ >= 0 the candidates left are those below λ;
        for λ < 0 every candidate was above it, so none is left."""
        b = self.b
        self.keep(above)
        if self.threshold >= 0:
            if self.candidates is None:
                self.kept_from = least
            else:
                self.candidates = b.zero_at(self.candidates, above)
        else:
            nothing = b.arange(0, 0, like=self.acc)
            self.candidates, self.positions = b.abs(b.take(self.acc, nothing)), nothing
        self.threshold *= 0.1

    def narrow(self, above: Any) -> None:
        """Too many: the candidates become ``above``, and λ ×2."""
        b = self.b
        self.last_too_many = True
        self.candidates = (b.abs(b.take(self.acc, above)) if self.candidates is None
                           else b.take(self.candidates, above))
        self.positions = above if self.positions is None else b.take(self.positions, above)
        self.threshold *= 2.0

    def finish(self) -> tuple[Any, float]:
        """The indices kept, and the last λ."""
        b = self.b
        if self.deferred:   # the loops ran out in a run of known "too few": one read for their bands
            everything = b.select_at_least(self.acc, 0, self.numel, self.deferred[-1])[0]
            self.kept += bands(self.acc, everything, self.deferred, self.deferred_from, self.dtype, b)
        if self.last_too_many and self.n_kept < 2 * self.k / 3:
            self.kept.append(self.positions)
        if not self.kept:
            return b.arange(0, 0, like=self.acc), self.threshold
        return b.concat(self.kept), self.threshold


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
        """Error feedback with μ and σ taken in the accumulating pass (``Backend.accumulate_moments``),
        then the selection: one read of ``a`` fewer than ``accumulate`` and ``select_local``, the
        same decisions. A bucket packing per-tensor steps takes each tensor's μ and σ in
        ``select_local`` instead (None: the engine accumulates, then selects)."""
        if ctx.members:
            return None
        acc, moments, finite = ctx.backend.accumulate_moments(residual, tensors, clear_inputs, check_finite,
                                                             ctx.momentum)
        if not finite:
            return Selected(acc, None, [], False)
        return Selected(acc, self._select(acc, *moments, control, ctx.numel, ctx), [], True)

    def select_local(self, acc: Any, control: GaussianControl, ctx: StepContext) -> Any:
        """The selection from μ and σ (``Backend.mean_std``) of ``acc``, or of each tensor of a
        bucket packing per-tensor steps on its own (``select_per_tensor``); λ is then their mean."""
        b, thresholds = ctx.backend, []

        def select(part: Any, numel: int) -> Any:
            idx = self._select(part, *b.mean_std(part), control, numel, ctx)
            thresholds.append(control.threshold)
            return idx

        idx = self.select_per_tensor(acc, control, ctx, select)
        control.threshold = float(np.mean(thresholds))
        return idx

    def _select(self, acc: Any, mean: float, std: float, control: GaussianControl, numel: int,
                ctx: StepContext) -> Any:
        """The loop of ``variant`` on ``acc`` of ``numel`` entries (a bucket, or one tensor of it)."""
        k = self.k(numel, self.step_density(ctx))
        threshold = self.initial_threshold(mean, std, self.step_density(ctx))
        dtype = ctx.backend.dtype_name(acc)
        if self.variant == "rescale":
            idx, threshold = self._rescale(acc, threshold, k, dtype, numel, ctx)
        else:
            idx, threshold = self._original(acc, threshold, k, dtype, numel, ctx)
        control.threshold = threshold
        return idx

    def _original(self, acc: Any, threshold: float, k: int, dtype: str, numel: int, ctx: StepContext
                  ) -> tuple[Any, float]:
        """The "original" loop (module docstring), read off ``a`` as ``OriginalLoop`` says."""
        loop = OriginalLoop(acc, ctx.backend, dtype, k, numel, threshold)
        for _ in range(self.max_loops):
            least = strictly_above(loop.threshold, dtype)
            if loop.defer_known_too_few(least):
                continue
            if not loop.judge(loop.above(least), least):
                break
        return loop.finish()

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
