"""LAGS-SGD: layer-wise adaptive gradient sparsification (docs/algorithms.md#lags).

Paper mode (the authors' released code, HKBU-HPML/OMGS-SGD):

* **Groups.** The model's tensors are walked from the last to the first (the order in which
  backpropagation produces their gradients); consecutive tensors are merged until a group holds
  at least ``merge_threshold`` elements (default 8192; 0 = one group per tensor). The tensors
  left over at the front form a last, possibly smaller, group. Groups are named ``group0``,
  ``group1``, ... in that backward order, and each is a bucket of the engine with its own
  residual. Inside a group the tensors are laid out in backward order, as in the authors' buffer.
* **Per group and step:** ``a = g + e``, ``k = max(1, int(density * numel))``, top-k of ``|a|``,
  ``e = a`` with the selection zeroed; two allgathers (values, int32 indices) started the moment
  the group's last gradient is ready -- in PyTorch from ``compress`` of that gradient, inside the
  backward pass -- and waited for when the optimizer steps; scatter-add of all ranks' pairs and
  division by the number of ranks ("gather" pattern). The residual holds raw gradients (the
  learning rate is applied afterwards, by the optimizer).
* **Density:** the same ``density`` for every group (the authors' adaptive path is disabled in
  three ways, docs/algorithms.md#lags-adaptive-path).

Named options (off in paper mode):

* ``adaptive=True``: the adaptive per-group density (docs/algorithms.md#adaptive-density), live. Every rank
  measures, over the first ``profile_steps`` steps, when each group's last gradient arrives
  (PyTorch: the time of ``compress``), and the cost of an allgather (a short calibration: the
  fastest of ``calibration_repeats`` allgathers of each of ``calibration_sizes`` elements) unless
  ``alpha``/``beta`` are given. The per-group medians over the profiled steps and the
  calibration's timings are averaged across ranks by ONE named allreduce
  (``<prefix>.lags.profile``) so that every rank decides from the same numbers; then
  ``T_comm(m, rho) = alpha*log2(P) + 2*(P-1)*rho*m*beta`` is solved for ``T_comm = T_comp``:
  ``t = T_comp - alpha*log2(P)``; ``rho* = min_density`` if ``t <= 0`` else
  ``t / (2*(P-1)*beta*m)``, replaced by ``overflow_density`` if above 1, raised to at least
  ``min_density``; ``rho_g = max(rho*, density)`` -- never below the user's density. The
  densities are fixed from then on. ``comp_time`` chooses ``T_comp``: ``"own"`` (the backward
  time of the group's own layers: from the previous group's readiness to this group's, the
  authors' definition) or ``"remaining"`` (the backward time still to come after this group is
  ready: the time its communication can hide behind in a pipeline). The first group's own time
  is measured from the step's first gradient: the backward work before it is not observable from
  a compressor. On a GPU the PyTorch face waits for the device in each gradient hook during the
  profiled steps (only then), so the times are those of the computation, not of kernel launches.
  The calibration and the agreement run once, blocking, in the first ``decompress`` of step
  ``profile_steps - 1`` (every rank is there; no backward hook ever blocks).
  TensorFlow computes every gradient before Horovod reduces any, so there is nothing to overlap
  and no per-group time to observe: there ``adaptive=True`` warns once and keeps the uniform
  density (``stats()["adaptive_state"] == "uniform"``).
* ``check_assumption`` / ``AssumptionMonitor``: docs/algorithms.md#assumption-check on real gradients,
  ``delta = ||x - TopK(x)||^2 / ||x - RandK(x)||^2`` per layer.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Unpack

import numpy as np

from ..comm import ALLGATHER, ALLREDUCE, Collective, Protocol
from ..errors import ConfigurationError
from .base import (
    GATHER,
    TENSOR,
    Algorithm,
    StepContext,
    StepEnd,
    StepOutcome,
    check_choice,
    check_density,
    is_integer,
    is_real,
)
from .corrections import CorrectionOptions

GROUP = "group"            # scope: merged groups of consecutive tensors (merge_threshold > 0)
COMP_TIMES = ("own", "remaining")

# The authors' allgather cost model constants (docs/algorithms.md#adaptive-density), for users who want them.
PAPER_ALPHA = 1.744e-3     # seconds per allgather, times log2(P)
PAPER_BETA = 3.6e-8        # seconds per element


# --- pure rules (identical on every rank given identical inputs) -------------------------------------
def plan_groups(keys: list[str], sizes: list[int], merge_threshold: int) -> list[tuple[str, list[str]]]:
    """LAGS groups over tensors given in parameter (forward) order: walk them from last to first,
    closing a group as soon as it holds at least ``merge_threshold`` elements; what is left at
    the front is the last group. Returns (name, members in backward order), first-ready first."""
    if len(keys) != len(sizes):
        raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes")
    groups: list[tuple[str, list[str]]] = []
    members: list[str] = []
    held = 0
    for key, size in zip(reversed(keys), reversed(sizes), strict=True):
        members.append(key)
        held += int(size)
        if held >= merge_threshold:
            groups.append((f"group{len(groups)}", members))
            members, held = [], 0
    if members:
        groups.append((f"group{len(groups)}", members))
    return groups


def group_k(density: float, numel: int) -> int:
    """Entries a group sends: ``max(1, int(density * numel))`` (the authors' rule), at most all."""
    return max(1, min(numel, int(density * numel)))


def adaptive_density(comp_seconds: float, numel: int, size: int, alpha: float, beta: float,
                     density: float, min_density: float = 0.001, overflow_density: float = 0.05
                     ) -> float:
    """docs/algorithms.md#adaptive-density: the density whose allgather time equals ``comp_seconds``, with the
    authors' floor and overflow quirks, never below the user's ``density``. A world of one rank
    (or a free network, ``beta == 0``) communicates in no time: the overflow branch."""
    spare = comp_seconds - alpha * math.log2(size)
    if spare <= 0:
        best = min_density
    else:
        per_unit = 2 * (size - 1) * beta * numel
        best = spare / per_unit if per_unit > 0 else math.inf
        if best > 1.0:
            best = overflow_density
        best = max(best, min_density)
    return max(best, density)


def fit_allgather_model(sizes: tuple[int, int], seconds: tuple[float, float], world: int
                        ) -> tuple[float, float]:
    """(alpha, beta) of ``T = alpha*log2(P) + (P-1)*s*beta`` through two timed allgathers of ``s``
    elements per rank; clamped at 0 where timing noise would make them negative."""
    (small, large), (t_small, t_large) = sizes, seconds
    if world < 2:
        return 0.0, 0.0
    beta = max(0.0, (t_large - t_small) / ((world - 1) * (large - small)))
    alpha = max(0.0, (t_small - (world - 1) * small * beta) / math.log2(world))
    return alpha, beta


def backward_times(ready: Mapping[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """From one step's readiness times (seconds since the step's first gradient), per group: its
    own backward time (since the group that became ready just before it, or since the first
    gradient) and the backward time still to come after it is ready."""
    own: dict[str, float] = {}
    previous = 0.0
    for key in sorted(ready, key=lambda k: (ready[k], k)):
        own[key] = max(0.0, ready[key] - previous)
        previous = max(previous, ready[key])
    last = max(ready.values(), default=0.0)
    return own, {key: max(0.0, last - t) for key, t in ready.items()}


# --- the algorithm ----------------------------------------------------------------------------------
@dataclass
class LagsControl:
    """One group's host-side state. ``density`` is identical on every rank; the profile samples
    are this rank's own measurements until the agreement averages them."""

    density: float
    state: str = "off"                   # off | profiling | fixed | uniform (no timings)
    since: int = 0                       # the bucket's step when profiling began
    own: list = field(default_factory=list)
    remaining: list = field(default_factory=list)
    comp_seconds: float | None = None    # agreed T_comp once fixed
    alpha: float | None = None
    beta: float | None = None


class LAGS(Algorithm):
    """LAGS-SGD: per-group top-k whose allgathers start during the backward pass.

    Args:
        density: fraction of each group's entries a rank sends, in (0, 1]; with ``adaptive`` the
            floor of every group's density.
        merge_threshold: merge consecutive tensors (in backward order) until a group holds at
            least this many elements; 0 = one group per tensor. Default 8192 (the authors').
        adaptive: choose each group's density from its measured backward time and the allgather
            cost model (docs/algorithms.md#adaptive-density); PyTorch only (TensorFlow warns, stays uniform).
        comp_time: ``"own"`` (the group's own backward time, the authors' definition) or
            ``"remaining"`` (backward time left after the group is ready).
        profile_steps: steps measured before the densities are fixed.
        alpha, beta: allgather cost model (seconds per log2(P); seconds per element). Both
            ``None`` (default): measured by a calibration on the job. ``PAPER_ALPHA`` and
            ``PAPER_BETA`` are the authors' values.
        calibration_sizes: elements per rank of the two calibration allgathers.
        calibration_repeats: timed allgathers per size (the fastest is used).
        min_density, overflow_density: the rule's floor and the value it takes when the solved
            density exceeds 1 (the authors' 0.001 and 0.05).
    """

    name = "lags"
    patterns = (GATHER,)
    scopes = (TENSOR, GROUP)

    def __init__(self, density: float = 0.01, *, merge_threshold: int = 8192, adaptive: bool = False,
                 comp_time: str = "own", profile_steps: int = 5, alpha: float | None = None,
                 beta: float | None = None, calibration_sizes: tuple[int, int] = (256, 1 << 20),
                 calibration_repeats: int = 5, min_density: float = 0.001,
                 overflow_density: float = 0.05, **corrections: Unpack[CorrectionOptions]):
        if not is_integer(merge_threshold) or merge_threshold < 0:
            raise ConfigurationError(
                f"merge_threshold must be an int >= 0 (elements per group; 0 = one group per "
                f"tensor), got {merge_threshold!r}")
        super().__init__(density, pattern=GATHER, scope=TENSOR if merge_threshold == 0 else GROUP,
                         **corrections)
        self.merge_threshold = merge_threshold = int(merge_threshold)
        if not isinstance(adaptive, bool):
            raise ConfigurationError(f"adaptive must be True or False, got {adaptive!r}")
        self.adaptive = adaptive
        self.comp_time = check_choice("comp_time", comp_time, COMP_TIMES)
        if not is_integer(profile_steps) or profile_steps < 1:
            raise ConfigurationError(f"profile_steps must be an int >= 1, got {profile_steps!r}")
        self.profile_steps = int(profile_steps)
        if (alpha is None) != (beta is None):
            raise ConfigurationError(
                "give both alpha and beta (the allgather cost model), or neither to measure them "
                "on the job")
        for option, value in (("alpha", alpha), ("beta", beta)):
            if value is not None and (not is_real(value)
                                      or not math.isfinite(value) or value < 0):
                raise ConfigurationError(f"{option} must be a finite number >= 0 (seconds), got {value!r}")
        self.alpha = None if alpha is None else float(alpha)
        self.beta = None if beta is None else float(beta)
        sizes = tuple(calibration_sizes)
        if (len(sizes) != 2 or any(not is_integer(s) or s < 1 for s in sizes)
                or sizes[0] >= sizes[1]):
            raise ConfigurationError(
                f"calibration_sizes must be two increasing element counts >= 1, e.g. (256, 262144), "
                f"got {calibration_sizes!r}")
        self.calibration_sizes = (int(sizes[0]), int(sizes[1]))
        if not is_integer(calibration_repeats) or calibration_repeats < 1:
            raise ConfigurationError(f"calibration_repeats must be an int >= 1, got {calibration_repeats!r}")
        self.calibration_repeats = int(calibration_repeats)
        self.min_density = check_density(min_density)
        self.overflow_density = check_density(overflow_density)
        self._warned_untimed = False

    # --- grouping and selection -------------------------------------------------------------------
    def group(self, keys: list[str], sizes: list[int]) -> list[tuple[str, list[str]]]:
        """The merged layer groups (``plan_groups``)."""
        return plan_groups(keys, sizes, self.merge_threshold)

    def target_k(self, control: LagsControl, ctx: StepContext) -> int:
        """The group's k at its current density."""
        return group_k(self.group_density(control, ctx), ctx.numel)

    def group_density(self, control: LagsControl, ctx: StepContext) -> float:
        """The group's density this step: its own, scaled like the method's during a warm-up."""
        if self.step_density(ctx) == self.density:
            return control.density
        return min(1.0, control.density * self.step_density(ctx) / self.density)

    def select_local(self, acc: Any, control: LagsControl, ctx: StepContext) -> Any:
        """Top-k of the group at its current density."""
        b = ctx.backend
        return b.topk_abs_indices(acc, group_k(self.group_density(control, ctx), ctx.numel))

    # --- control: the adaptive density ----------------------------------------------------------------
    def init_control(self, ctx: StepContext) -> LagsControl:
        """The uniform density, profiling when ``adaptive``."""
        return LagsControl(self.density, "profiling" if self.adaptive else "off", since=ctx.step)

    def observe(self, control: LagsControl, outcome: StepOutcome, ctx: StepContext) -> LagsControl:
        """Profiling without readiness samples (TensorFlow): warn once, keep the uniform density."""
        # Every driver that measures readiness hands a sample to end_step after each step; fewer
        # samples than steps means this one cannot (TensorFlow): say so, keep the uniform density.
        if control.state == "profiling" and len(control.own) < ctx.step - control.since:
            control.state = "uniform"
            control.own, control.remaining = [], []
            if not self._warned_untimed:
                self._warned_untimed = True
                warnings.warn(
                    "hvd_sparse LAGS: adaptive=True needs the time at which each group's gradients "
                    "become ready during the backward pass, which only the PyTorch face observes (in "
                    "TensorFlow Horovod reduces after every gradient is computed, so there is no "
                    f"backward pass to overlap); every group keeps density={self.density}",
                    RuntimeWarning, stacklevel=2)
        return control

    def end_step(self, end: StepEnd, ctx: StepContext) -> Protocol:
        """While profiling: record the step's readiness times; after ``profile_steps``, agree on
        their medians over ranks (one allreduce) and fix every group's density."""
        controls: dict[str, LagsControl] = end.controls
        profiling = [c for c in controls.values() if c.state == "profiling"]
        if not profiling or end.ready is None:
            return None
        own, remaining = backward_times({key: end.ready.get(key, 0.0) for key in controls})
        for key, control in controls.items():
            if control.state == "profiling":
                control.own.append(own[key])
                control.remaining.append(remaining[key])
        if len(profiling) != len(controls) or min(len(c.own) for c in profiling) < self.profile_steps:
            return None

        # Agree on the medians with one collective, so every rank decides from the same numbers.
        keys = sorted(controls)
        local = [float(np.median(controls[k].own)) for k in keys]
        local += [float(np.median(controls[k].remaining)) for k in keys]
        calibrate = self.alpha is None
        if calibrate:
            local += yield from self._calibrate(end.like, ctx)
        b = ctx.backend
        payload = b.from_numpy(np.asarray(local, dtype=np.float64), like=end.like)
        (total,) = yield [Collective(ALLREDUCE, f"{ctx.name}.lags.profile", payload)]
        agreed = b.to_numpy(total).astype(np.float64) / ctx.size
        n = len(keys)
        if calibrate:
            alpha, beta = fit_allgather_model(self.calibration_sizes, (agreed[2 * n], agreed[2 * n + 1]),
                                              ctx.size)
        else:
            alpha, beta = self.alpha, self.beta
        for i, key in enumerate(keys):
            control = controls[key]
            comp = agreed[i] if self.comp_time == "own" else agreed[n + i]
            control.density = adaptive_density(float(comp), end.numels[key], ctx.size, alpha, beta,
                                               self.density, self.min_density, self.overflow_density)
            control.state = "fixed"
            control.comp_seconds, control.alpha, control.beta = float(comp), alpha, beta
            control.own, control.remaining = [], []
        return controls

    def measuring(self, controls: dict[str, Any]) -> bool:
        """Whether a group is still profiling (adaptive mode only)."""
        if not self.adaptive:
            return False
        return not controls or any(c.state == "profiling" for c in controls.values())

    def _calibrate(self, like: Any, ctx: StepContext) -> Protocol:
        """Per calibration size, the fastest of ``calibration_repeats`` timed allgathers (the
        least disturbed by other work), after one untimed allgather that lines the ranks up and
        warms the buffers. Drivers run end_step blocking, so the time between yielding a phase
        and resuming is its duration."""
        b = ctx.backend
        fastest = []
        for size in self.calibration_sizes:
            payload = b.zeros(size, "float32", like=like)
            yield [Collective(ALLGATHER, f"{ctx.name}.lags.calibrate.{size}.warmup", payload)]
            seconds = []
            for repeat in range(self.calibration_repeats):
                started = time.perf_counter()
                yield [Collective(ALLGATHER, f"{ctx.name}.lags.calibrate.{size}.{repeat}", payload)]
                seconds.append(time.perf_counter() - started)
            fastest.append(min(seconds))
        return fastest

    # --- statistics and checkpoints -------------------------------------------------------------------
    def model_stats(self, controls: dict[str, Any]) -> dict:
        """Per-group densities and the adaptive state, once every group has the same state."""
        lags = {key: c for key, c in controls.items() if isinstance(c, LagsControl)}
        states = {c.state for c in lags.values()}
        if len(states) != 1:  # no group yet, or some still profiling
            states = {"profiling" if self.adaptive else "off"}
        out: dict[str, Any] = {"group_densities": {key: c.density for key, c in lags.items()},
                               "adaptive_state": states.pop()}
        fixed = {key: c for key, c in lags.items() if c.state == "fixed"}
        if fixed:
            out["group_comp_seconds"] = {key: c.comp_seconds for key, c in fixed.items()}
            first = next(iter(fixed.values()))
            out["comm_alpha"], out["comm_beta"] = first.alpha, first.beta
        return out

    def control_state(self, control: LagsControl) -> dict:
        """The control's fields, as plain data."""
        return asdict(control)

    def load_control(self, state: Any, ctx: StepContext, saved_size: int) -> LagsControl:
        """The checkpoint's control, or a fresh one at another world size (the cost model depends on it)."""
        if saved_size != ctx.size:  # the cost model depends on the world size: measure again
            return self.init_control(ctx)
        return LagsControl(**state)


# --- the assumption check (docs/algorithms.md#assumption-check) ----------------------------------------
def _host(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):       # torch
        x = x.detach().cpu().numpy()
    elif hasattr(x, "numpy"):      # TensorFlow
        x = x.numpy()
    return np.asarray(x, dtype=np.float64).reshape(-1)


def _named(gradients: Mapping[str, Any] | Iterable) -> list[tuple[str, Any]]:
    if isinstance(gradients, Mapping):
        return list(gradients.items())
    items = list(gradients)
    if all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) for item in items):
        return items
    return [(str(i), item) for i, item in enumerate(items)]


def compression_errors(x: Any, density: float, randk: str = "expected",
                       rng: np.random.Generator | None = None) -> tuple[float, float]:
    """(||x - TopK(x, k)||^2, ||x - RandK(x, k)||^2) with ``k = max(1, int(density * d))``. The
    random-k error is its expectation ``(1 - k/d) ||x||^2`` (``randk="expected"``) or one draw of
    k distinct indices (``"sampled"``)."""
    v = _host(x)
    d = v.size
    k = group_k(density, d)
    squares = v * v
    total = float(squares.sum())
    kept = float(np.partition(squares, d - k)[d - k:].sum()) if k < d else total
    if randk == "expected":
        random_error = (1.0 - k / d) * total
    elif randk == "sampled":
        picked = (rng or np.random.default_rng()).choice(d, size=k, replace=False)
        random_error = total - float(squares[picked].sum())
    else:
        raise ConfigurationError(f"randk must be 'expected' or 'sampled', got {randk!r}")
    return max(0.0, total - kept), max(0.0, random_error)


def _ratio(top: float, rand: float) -> float:
    if rand > 0:
        return top / rand
    return 0.0 if top == 0 else math.inf


def check_assumption(gradients: Mapping[str, Any] | Iterable, density: float, *, randk: str = "expected",
                     rng: np.random.Generator | None = None) -> dict[str, float]:
    """delta per layer, ``||x - TopK(x)||^2 / ||x - RandK(x)||^2`` with each layer's own
    ``k = max(1, int(density * d))`` (docs/algorithms.md#assumption-check). LAGS's convergence argument needs
    ``delta <= 1`` for every layer: layer-wise top-k no worse than random-k of the same size.

    ``gradients``: a mapping name -> tensor, (name, tensor) pairs, or a sequence of tensors
    (NumPy, PyTorch or TensorFlow), e.g. each layer of a rank's accumulated vector ``g + e``.
    For the ratio of means over many steps (as the authors plot it) use ``AssumptionMonitor``."""
    density = check_density(density)
    return {name: _ratio(*compression_errors(x, density, randk, rng)) for name, x in _named(gradients)}


class AssumptionMonitor:
    """Accumulates both errors per layer over steps; ``delta()`` is the ratio of their means."""

    def __init__(self, density: float, *, randk: str = "expected", seed: int = 0):
        self.density = check_density(density)
        self.randk = check_choice("randk", randk, ("expected", "sampled"))
        self._rng = np.random.default_rng(seed)
        self._top: dict[str, float] = {}
        self._rand: dict[str, float] = {}
        self.steps = 0

    def add(self, gradients: Mapping[str, Any] | Iterable) -> None:
        """Add one step's gradients (by name) to the running sums of both compression errors."""
        for name, x in _named(gradients):
            top, rand = compression_errors(x, self.density, self.randk, self._rng)
            self._top[name] = self._top.get(name, 0.0) + top
            self._rand[name] = self._rand.get(name, 0.0) + rand
        self.steps += 1

    def delta(self) -> dict[str, float]:
        """Per tensor: top-k's error over random-k's, summed since the last reset."""
        return {name: _ratio(self._top[name], self._rand[name]) for name in self._top}

    def reset(self) -> None:
        """Forget the sums."""
        self._top.clear()
        self._rand.clear()
        self.steps = 0
