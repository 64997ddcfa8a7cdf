"""MiCRO (docs/algorithms.md#micro): exclusive, rotating partitions with an online-scaled threshold.

The flat model vector is cut into N contiguous partitions; at step t rank r owns partition
(t + r) mod N and sends every entry of its accumulated vector there with |a| >= λ (at least one:
a fallback index when nothing passes). Partitions are disjoint, so the union of all selections is
their concatenation: no gradient build-up, and each rank scans only n/N entries. Every rank then
allreduces its own values on the whole union and clears its residual there (the union pattern).

λ is identical on every rank because it is driven only by global facts (the previous union
size). Paper mode (the authors' final code, commit 3e050e3): λ0 = 1/(2√k), then λ ← λ·s(K_prev/k)
with s = 1.005 above a 1.1 band, 1.00125 inside (0.909, 1.1] -- the code's 0.9987 branch inside the
band can never run (docs/algorithms.md#dead-branch) -- and 0.995 below. Options, off in paper mode:

* ``threshold_band="symmetric"``: inside the band, 1.00125 above target and 0.9987 below (what
  the dead branch presumably meant).
* ``threshold_scaling="tracking"``: a controller that holds the density at target after a short warm-up
  even when gradients shrink fast. Every rank also counts its partition's entries at λ/c and λ·c;
  the fractions ride on the step's existing value allreduce (no extra collective), so every rank
  knows the global local slope α = -dlnK/dlnλ and takes the same damped Newton step in log space,
  λ ← λ·(K/(k·b))^(0.5/α) clipped to [1/4, 4], with a slow outer loop on b that puts the mean
  count, not its geometric mean, at k (see ``tracking_factor``).
* ``tracking_gain="adaptive"`` (what ``"auto"``, the default, means under the momentum
  correction and on the Adam path, whose first moment is a momentum too; otherwise ``"auto"`` is
  ``"fixed"``, the rule above): the Newton step is scaled by
  a gain that halves whenever the count's log error changes sign from one step to the next (the
  controller overshot) and grows by a quarter while it keeps its sign, within [1/32, 1]
  (``adapt_gain``). Under the momentum correction the count answers a small change of λ with a
  burst or a drought many times k (entries piled up just under λ are released at once, or none
  crosses for several steps), the fixed step overshoots, and λ settles into a limit cycle whose
  mean count is well above k; the gain falls until the loop is stable.
* ``threshold_start="local"``: the first step does not select with λ0 = 1/(2√k), which knows
  nothing of the gradient's scale (on a 1e8-entry model it picks 30% of the entries, and the
  step's messages and memory grow with that): each rank selects its partition's share of k by
  magnitude, with a threshold of its own (``local_start``), and the ranks' thresholds ride on the
  value allreduce so that every rank continues from their geometric mean (``agreed_start``).

This module holds what MiCRO and ExDyna share (ExDyna = MiCRO + blocks + rebalancing, exdyna.py).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any, ClassVar, Unpack

import numpy as np

from ..backends import Selected, index_dtype_for
from ..comm import Protocol, finished
from ..errors import ConfigurationError, renamed_options
from .base import MODEL, UNION, Algorithm, StepContext, StepOutcome, check_choice
from .blocks import CONTROL_FORMAT, unreadable_control_state
from .corrections import CorrectionOptions

if TYPE_CHECKING:
    from .blocks import BlockLayout

THRESHOLD_SCALINGS = ("paper", "tracking")
THRESHOLD_BANDS = ("code", "symmetric")
THRESHOLD_STARTS = ("paper", "local")
TRACKING_GAINS = ("auto", "fixed", "adaptive")
# The code's constants, kept exact (integer-safe comparisons: every rank decides identically).
UPPER_BAND, LOWER_BAND = Fraction("1.1"), Fraction("0.909")
RAISE, CREEP, LOWER, DEAD = 1.005, 1.00125, 0.995, 0.9987
TRACKING_PROBE = math.sqrt(2.0)     # c: the extra counts are taken at λ/c and λ·c
TRACKING_MAX_FACTOR = 4.0
TRACKING_SLOPE = (0.5, 8.0)         # clip of the measured slope α
TRACKING_GAIN = 0.5                 # fraction of the Newton step taken
TRACKING_BIAS_RATE = 0.05           # speed of the outer loop on the mean count
# The outer loop's error K/k - 1 is clipped against outliers, but not symmetrically: it cannot
# fall below -1, while the bursts error feedback causes (K/k up to 5-10 at k ~ 40) are exactly the
# mass the mean is made of; clipped at +1, they left the mean count 16-39% above k on the digits
# CNN at ρ = 0.001 (0.99 with +8).
TRACKING_BIAS_CLIP = (-1.0, 8.0)
TRACKING_SAMPLE = 8                 # probes read 1/8 of the partition on large models
# tracking_gain="adaptive": the gain's factor after an overshoot (the log error changed sign) and
# after a step on the same side, and its range. A gain of 1 is the fixed controller's step.
GAIN_DOWN, GAIN_UP, GAIN_RANGE = 0.5, 1.25, (1.0 / 32.0, 1.0)


def initial_threshold(k: int) -> float:
    """λ0 = 1/(2√k), the hard-threshold heuristic (docs/algorithms.md#threshold)."""
    return 1.0 / (2.0 * math.sqrt(k))


def share_of_k(k: int, lo: int, hi: int, numel: int) -> int:
    """A partition's share of k, in proportion to its length (at least 1 for a non-empty one)."""
    return min(hi - lo, max(1, round(k * (hi - lo) / numel))) if hi > lo else 0


def local_start(magnitudes: np.ndarray) -> float:
    """A rank's threshold at the local start's first step, from the magnitudes of its partition's
    share of k largest entries: the smallest positive one (a zero is never worth sending), +inf
    when there is none (the rank then sends only its fallback index)."""
    positive = magnitudes[magnitudes > 0]
    return float(positive.min()) if positive.size else math.inf


def agreed_start(log_sum: float, contributors: float, k: int) -> float:
    """The threshold every rank continues with after the local start: the geometric mean
    of the ranks' own thresholds (their logs and their number summed by the value allreduce), or
    λ0 when no rank had one to give."""
    if contributors < 0.5 or not math.isfinite(log_sum):
        return initial_threshold(k)
    return math.exp(log_sum / round(contributors))


def paper_factor(union: int, k: int, band: str = "code") -> float:
    """The code's multiplicative step from the previous union size K and the target k."""
    if union * UPPER_BAND.denominator > UPPER_BAND.numerator * k:        # K/k > 1.1
        return RAISE
    if union * LOWER_BAND.denominator > LOWER_BAND.numerator * k:        # 0.909 < K/k <= 1.1
        if band == "symmetric" and union < k:
            return DEAD
        return CREEP
    return LOWER                                                          # K/k <= 0.909


def tracking_factor(union: int, k: int, below: float, above: float, bias: float,
                    gain: float = 1.0) -> tuple[float, float]:
    """One step of the tracking controller: (threshold factor, new bias).

    ``below``/``above`` are the global fractions of entries at λ/c and λ·c, so
    α = ln(below/above) / (2 ln c) is the local slope of the count curve and λ·(K/k)^(1/α) would
    be a Newton step to the target. Error feedback makes counts bursty (lowering λ releases the
    residual mass piled up just under it), so the step is damped (gain ``TRACKING_GAIN``), and a
    slow outer loop on the linear error corrects ``bias`` so that the *mean* count, not the
    geometric one, sits at k. ``gain`` scales the Newton step (``adapt_gain``; 1: the fixed
    controller, bit for bit)."""
    slope = TRACKING_SLOPE[1]
    if below > 0 and above > 0:
        slope = math.log(below / above) / (2.0 * math.log(TRACKING_PROBE))
    slope = min(max(slope, TRACKING_SLOPE[0]), TRACKING_SLOPE[1])
    ratio = max(union, 1) / k
    factor = (ratio / bias) ** (gain * TRACKING_GAIN / slope)
    low, high = TRACKING_BIAS_CLIP
    bias *= math.exp(-TRACKING_BIAS_RATE * min(max(ratio - 1.0, low), high))
    bias = min(max(bias, 1.0 / TRACKING_MAX_FACTOR), TRACKING_MAX_FACTOR)
    return min(max(factor, 1.0 / TRACKING_MAX_FACTOR), TRACKING_MAX_FACTOR), bias


def adapt_gain(gain: float, error_prev: float, union: int, k: int, bias: float) -> tuple[float, float]:
    """``tracking_gain="adaptive"``: (the gain of this step's Newton step, the log error it
    corrects). The error is ln(K/(k·b)), what the step acts on; when its sign differs from the
    previous step's the last step overshot and the gain halves, when it is the same the gain grows
    by a quarter (a drift the controller trails), within ``GAIN_RANGE``; an error of exactly 0
    leaves it. A pure function of global facts: every rank computes the same gain."""
    error = math.log(max(union, 1) / k) - math.log(bias)
    if error * error_prev < 0.0:
        gain = max(gain * GAIN_DOWN, GAIN_RANGE[0])
    elif error * error_prev > 0.0:
        gain = min(gain * GAIN_UP, GAIN_RANGE[1])
    return gain, error


def owned_partition(rank: int, step: int, size: int) -> int:
    """Rank r owns partition (t + r) mod N at step t (docs/algorithms.md#rotation)."""
    return (step + rank) % size


def owner_of(partition: int, step: int, size: int) -> int:
    """The rank that owns ``partition`` at ``step``: the inverse of ``owned_partition``."""
    return (partition - step) % size


def rank_counts(partition_counts: np.ndarray, step: int) -> np.ndarray:
    """Per-rank counts from per-partition counts of the same step."""
    size = len(partition_counts)
    return np.array([partition_counts[owned_partition(r, step, size)] for r in range(size)],
                    dtype=np.int64)


def refuse_fewer_entries_than_ranks(method: str, numel: int, size: int) -> None:
    """Every rank owns a partition of at least one entry; refuse, on every rank alike (n and N
    are the same everywhere), a model too small for that."""
    if numel < size:
        raise ConfigurationError(
            f"{method} gives every rank its own partition of the model and needs at least as many "
            f"gradient entries as ranks: the model has {numel}, the job {size} ranks; use a larger "
            "model, fewer ranks, or a method without partitions (e.g. TopK)")


def equal_chunks(n: int, size: int) -> np.ndarray:
    """MiCRO's fixed partitions: N element chunks differing by at most one, as N+1 bounds."""
    lengths = np.full(size, n // size, dtype=np.int64)
    lengths[: n % size] += 1
    return np.concatenate([[0], np.cumsum(lengths)])


@dataclass
class ExclusiveControl:
    """Control state shared by every rank (identical everywhere)."""

    k: int
    threshold: float
    bounds: np.ndarray | None             # N+1 element bounds of the partitions (None: not
                                          # known on this rank, ExDyna's neighbour mode)
    union_prev: int | None = None         # K of the previous step
    counts_prev: np.ndarray | None = None  # per-partition counts of the previous step
    moves: int = 0                        # boundaries moved by the last rebalance
    last_step: int = 0                    # step the counts belong to
    own: tuple[int, int] = (0, 0)         # this rank's element range in the last step
    used_threshold: float = 0.0           # the threshold the last step selected with (the local
                                          # start's first step: this rank's own, local_start)
    probes: Any = None                    # this step's local fractions at λ/c, λ·c (tracking)
    bias: float = 1.0                     # tracking: outer-loop correction of the count target
    gain: float = 1.0                     # tracking_gain="adaptive": the Newton step's gain
    error_prev: float = 0.0               # tracking_gain="adaptive": the last step's log error
    layout: BlockLayout | None = None     # ExDyna's blocks (None for MiCRO)


class MiCRO(Algorithm):
    """MiCRO: exclusive rotating partitions, threshold selection, online threshold scaling.

    Args:
        density: target fraction of entries aggregated per step, in (0, 1].
        threshold_scaling: how λ is scaled online: "paper" (the code's multiplicative rule) or
            "tracking" (see module docstring). Formerly ``threshold``.
        threshold_band: the scaling rule's band, "code" (paper mode, dead branch included) or
            "symmetric". Formerly ``band``.
        threshold_start: the first step's threshold: "paper" (λ0 = 1/(2√k) on every rank) or
            "local" (each rank's share of k by magnitude; see module docstring). Default "paper",
            and "local" on the Adam path, whose accumulated update is in units of the learning
            rate, where λ0 would send nearly everything.
        tracking_gain: the tracking controller's step: "fixed", "adaptive" (see module
            docstring) or "auto" (adaptive under the momentum correction, fixed otherwise).
    """

    name = "micro"
    patterns = (UNION,)
    scopes = (MODEL,)
    exclusive = True
    control_keys: ClassVar[tuple[str, ...]] = ("threshold", "bounds", "union_prev", "counts_prev")

    @renamed_options(threshold="threshold_scaling", band="threshold_band")
    def __init__(self, density: float = 0.001, *, threshold_scaling: str = "paper",
                 threshold_band: str = "code", threshold_start: str | None = None,
                 tracking_gain: str = "auto", **corrections: Unpack[CorrectionOptions]):
        super().__init__(density, **corrections)
        if threshold_start is None:
            threshold_start = "local" if self.corrections.adam is not None else "paper"
        self.threshold_scaling = check_choice("threshold_scaling", threshold_scaling,
                                              THRESHOLD_SCALINGS)
        self.threshold_band = check_choice("threshold_band", threshold_band, THRESHOLD_BANDS)
        self.threshold_start = check_choice("threshold_start", threshold_start, THRESHOLD_STARTS)
        self.tracking_gain = check_choice("tracking_gain", tracking_gain, TRACKING_GAINS)
        if self.tracking_gain != "auto" and self.threshold_scaling != "tracking":
            raise ConfigurationError(
                f"tracking_gain={tracking_gain!r} sets the tracking controller's step, but "
                f"threshold_scaling={threshold_scaling!r} does not use it: pass "
                "threshold_scaling='tracking', or leave tracking_gain at 'auto'")

    @property
    def adaptive_gain(self) -> bool:
        """Whether the tracking controller adapts its gain (``tracking_gain``)."""
        if self.threshold_scaling != "tracking" or self.tracking_gain == "fixed":
            return False
        return (self.tracking_gain == "adaptive" or self.corrections.momentum > 0.0
                or self.corrections.adam is not None)

    # --- partitions (MiCRO: fixed equal chunks; ExDyna overrides) ------------------------------
    def reset_partitions(self, control: ExclusiveControl, ctx: StepContext) -> None:
        """Set the partitions of step ``ctx.step`` as at the start of training."""
        control.bounds = equal_chunks(ctx.numel, ctx.size)

    def rebalance_partitions(self, control: ExclusiveControl, ctx: StepContext) -> Protocol:
        """Move partition boundaries before the step from what earlier steps observed (ExDyna);
        MiCRO's are fixed."""
        return finished(None)

    def own_range(self, control: ExclusiveControl, ctx: StepContext) -> tuple[int, int]:
        """This rank's partition this step, [start, stop) of the model vector; it rotates every step."""
        p = owned_partition(ctx.rank, ctx.step, ctx.size)
        return int(control.bounds[p]), int(control.bounds[p + 1])

    # --- the step ---------------------------------------------------------------------------------
    def init_control(self, ctx: StepContext) -> ExclusiveControl:
        """Even partitions and the paper's starting threshold, 1/(2 sqrt(k))."""
        refuse_fewer_entries_than_ranks(type(self).__name__, ctx.numel, ctx.size)
        k = self.k(ctx.numel, self.step_density(ctx))
        control = ExclusiveControl(k=k, threshold=initial_threshold(k), bounds=None)
        self.reset_partitions(control, ctx)
        return control

    def prepare(self, control: ExclusiveControl, ctx: StepContext) -> Protocol:
        """Rebalance (once something has been observed), then fix this step's own range and
        threshold, before the gradient is read."""
        if ctx.step > 0 and control.union_prev is not None:
            yield from self.rebalance_partitions(control, ctx)
        control.k = self.k(ctx.numel, self.step_density(ctx))   # moves only during a density warm-up
        control.own = self.own_range(control, ctx)
        control.used_threshold = control.threshold

    def probes(self, control: ExclusiveControl, ctx: StepContext) -> tuple[list[float], int]:
        """Thresholds the tracking controller counts at, and the sampling (``count_at_least``)."""
        if self.threshold_scaling != "tracking":
            return [], 1
        # The probes only feed a slope estimate: from 1/8 of the partition once the expected
        # local count is large enough for the sample to hold hundreds of entries.
        every = TRACKING_SAMPLE if control.k >= 1024 * ctx.size else 1
        return [control.threshold / TRACKING_PROBE, control.threshold * TRACKING_PROBE], every

    def starting(self, control: ExclusiveControl) -> bool:
        """The first step under ``threshold_start="local"`` (no step observed yet): every rank
        selects its partition's share of k by magnitude, with a threshold of its own."""
        return self.threshold_start == "local" and control.union_prev is None

    def select_local(self, acc: Any, control: ExclusiveControl, ctx: StepContext) -> Any:
        """Indices of this rank's partition at or above the threshold (on the first step with
        threshold_start="local": its share of k by magnitude)."""
        if self.starting(control):
            return self._select_start(acc, control, ctx)
        probes, every = self.probes(control, ctx)
        idx, counts = ctx.backend.select_at_least(acc, *control.own, control.used_threshold, probes, every)
        self._keep_probes(control, counts, ctx)
        return idx

    def _select_start(self, acc: Any, control: ExclusiveControl, ctx: StepContext) -> Any:
        b, (lo, hi) = ctx.backend, control.own
        part = b.slice(acc, lo, hi)
        top = b.topk_abs_indices(part, share_of_k(control.k, lo, hi, ctx.numel))
        magnitudes = np.abs(b.to_numpy(b.cast(b.take(part, top), "float64")))
        control.used_threshold = local_start(magnitudes)
        control.probes = None
        return b.select_at_least(acc, lo, hi, control.used_threshold)[0]

    def accumulate_select(self, residual: Any, tensors: list, control: ExclusiveControl, ctx: StepContext,
                          clear_inputs: bool, check_finite: bool) -> Selected | None:
        """Accumulate and select the own partition in one pass (the fused op); None on the first step of
        threshold_start="local", which selects after accumulating."""
        if self.starting(control):
            return None   # accumulate, then select_local (two reads, on this step only)
        probes, every = self.probes(control, ctx)
        selected = ctx.backend.accumulate_select(
            residual, tensors, *control.own, control.used_threshold, probes, every,
            index_dtype_for(ctx.numel), clear_inputs, check_finite, ctx.momentum)
        if selected.finite:
            self._keep_probes(control, selected.counts, ctx)
        return selected

    def _keep_probes(self, control: ExclusiveControl, counts: list[float], ctx: StepContext) -> None:
        if self.threshold_scaling == "tracking":
            control.probes = np.asarray(counts, dtype=np.float64) / ctx.numel

    def fallback(self, control: ExclusiveControl, ctx: StepContext) -> Any:
        """One index inside the own partition, rotating with the step (so never a duplicate)."""
        lo, hi = self.own_range(control, ctx)
        index = lo + ctx.step % (hi - lo)
        return ctx.backend.arange(index, index + 1)

    def piggyback(self, control: ExclusiveControl, ctx: StepContext) -> Any:
        """What the step's count allgather carries besides the counts: the ranks' starting thresholds on
        the first step, the tracking probes later."""
        if self.starting(control):   # (ln λ_r, 1), or (0, 0) from a rank without a threshold
            own = control.used_threshold
            start = [math.log(own), 1.0] if 0 < own < math.inf else [0.0, 0.0]
            return ctx.backend.from_numpy(np.asarray(start, dtype=np.float32))
        if self.threshold_scaling != "tracking":
            return None
        return ctx.backend.from_numpy(control.probes.astype(np.float32))

    def record_counts(self, control: ExclusiveControl, outcome: StepOutcome, ctx: StepContext) -> None:
        """Keep the step's per-partition counts, read off the gathered indices (no message), for
        the next rebalance and the statistics."""
        control.counts_prev = ctx.backend.count_in_ranges(outcome.gathered_indices, control.bounds)

    def observe(self, control: ExclusiveControl, outcome: StepOutcome, ctx: StepContext) -> Any:
        """Scale the threshold from the global count (the paper's rule or tracking) and record the
        partitions' loads, the same on every rank."""
        union = int(outcome.union_size)
        self.record_counts(control, outcome, ctx)
        control.last_step = ctx.step
        if self.starting(control) and outcome.piggyback is not None:
            log_sum, contributors = (float(x) for x in outcome.piggyback)
            control.threshold = agreed_start(log_sum, contributors, control.k)
        elif self.threshold_scaling == "tracking" and outcome.piggyback is not None:
            below, above = (float(x) for x in outcome.piggyback)
            gain = 1.0
            if self.adaptive_gain:
                control.gain, control.error_prev = adapt_gain(control.gain, control.error_prev, union,
                                                              control.k, control.bias)
                gain = control.gain
            factor, control.bias = tracking_factor(union, control.k, below, above, control.bias, gain)
            control.threshold *= factor
        else:
            control.threshold *= paper_factor(union, control.k, self.threshold_band)
        control.union_prev = union
        return control

    # --- statistics and checkpoints ---------------------------------------------------------------
    def control_stats(self, control: ExclusiveControl) -> dict:
        """Threshold, partition bounds and rebalancer moves, for ``stats()``."""
        out = {"threshold": control.used_threshold, "next_threshold": control.threshold,
               "rebalance_moves": control.moves,
               "partition": None if control.bounds is None else control.bounds.tolist(),
               "own_partition": list(control.own)}
        if control.counts_prev is not None:
            counts = rank_counts(control.counts_prev, control.last_step)
            out.update(counts=counts.tolist(), imbalance=imbalance(counts))
        return out

    def control_state(self, control: ExclusiveControl) -> dict:
        """Plain data (no hvd_sparse class), so that a checkpoint loads without this module. The
        adaptive gain's state only where it is used (other checkpoints stay as they were)."""
        state = {"format": CONTROL_FORMAT, "k": control.k, "threshold": control.threshold,
                 "bias": control.bias,
                 "bounds": None if control.bounds is None else control.bounds.tolist(),
                 "union_prev": control.union_prev,
                 "counts_prev": None if control.counts_prev is None else control.counts_prev.tolist()}
        if self.adaptive_gain:
            state.update(gain=control.gain, error_prev=control.error_prev)
        return state

    def load_control(self, state: dict, ctx: StepContext, saved_size: int) -> ExclusiveControl:
        """Restore threshold and partitions; at another world size, even partitions and the saved
        threshold."""
        check_control_state(state, type(self).__name__, self.control_keys)
        control = self.init_control(ctx)
        control.threshold = float(state["threshold"])
        control.bias = float(state.get("bias", 1.0))
        control.gain = float(state.get("gain", 1.0))
        control.error_prev = float(state.get("error_prev", 0.0))
        control.union_prev = state["union_prev"]
        if saved_size == ctx.size:
            if state["bounds"] is not None:
                control.bounds = np.asarray(state["bounds"], dtype=np.int64)
            if state["counts_prev"] is not None:
                control.counts_prev = np.asarray(state["counts_prev"], dtype=np.int64)
        else:
            warnings.warn(f"hvd_sparse: {type(self).__name__} partitions rebuilt for {ctx.size} ranks "
                          f"(checkpoint from {saved_size}); the threshold carries over", stacklevel=2)
            control.union_prev = None
        return control


def check_control_state(state: Any, method: str, keys: tuple[str, ...]) -> None:
    """Refuse, naming the fix, a checkpoint's control state this version cannot read."""
    if not isinstance(state, dict):
        raise unreadable_control_state(method, f"a {type(state).__name__}, not a dict")
    if state.get("format", CONTROL_FORMAT) != CONTROL_FORMAT:
        raise unreadable_control_state(method, f"format {state['format']!r}")
    missing = [key for key in keys if key not in state]
    if missing:
        raise unreadable_control_state(method, f"no {', '.join(missing)}")


def imbalance(counts: np.ndarray) -> float:
    """Padding waste of a padded index allgather: N·max(c) / Σc − 1 (docs/algorithms.md#metrics)."""
    total = int(np.sum(counts))
    return len(counts) * int(np.max(counts)) / total - 1.0 if total else 0.0
