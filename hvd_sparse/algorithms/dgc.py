"""Deep Gradient Compression (Lin et al., ICLR 2018; docs/algorithms.md#dgc).

Paper mode follows the first author's PyTorch code (``synxlin/deep-gradient-compression``):

* **Momentum correction**, the engine's (algorithms/corrections.py), with DGC's defaults
  (``momentum=0.9``). DGC moves momentum *into* the compressed quantity: per bucket a momentum
  buffer ``u`` (the residual's dtype, on the framework's device) and the velocity ``v`` (the
  engine's residual): standard ``u ← μu + g; v ← v + u``, or with ``nesterov=True``
  ``u ← μ(u + g); v ← v + u + g``. ``v`` is what is sparsified, so pair DGC with an optimizer
  *without* momentum (e.g. ``torch.optim.SGD(params, lr, momentum=0)``): the momentum is already
  in the update.
* **Sampled threshold.** Sample ``|v|`` (strided with a random start, stride a multiple of 32
  plus 1, at least ``max(ceil(sample_ratio·n), ceil(2/ρ))`` samples; a tensor with
  ``n ≤ ceil(2/ρ)`` is not sampled), take λ as the smallest of the top ``ceil(ρ·samples)``
  samples and select ``|v| ≥ λ``. Then adapt a sampled λ, at most ``max_adaptation_iters`` times
  (one that read the whole tensor is kept, as the authors keep it): more than
  ``upper·k`` selected → exact top-k among them (``resample``) and stop, or λ ×= upper without
  ``resample``; between k and ``upper·k`` → stop; fewer than ``lower·k`` → λ ×= lower. Finally
  the first k selected (in index order) are kept. Here k = ceil(ρ·n) (the authors' rounding).
* **Momentum factor masking.** After the exchange the engine clears ``u`` where this rank sent,
  and ``v`` there (error feedback). On a step whose gradient was skipped as non-finite, nothing
  is cleared.
* **Warm-up.** With ``warmup_epochs = W > 0`` the density at epoch ``e < W`` is
  ``max(ρ^((e+1)/(W+1)), ρ)`` and ρ afterwards (ρ = 0.001, W = 4: 74.9%, 93.7%, 98.4%, 99.6%,
  then 99.9% sparsity). Call ``compression.set_epoch(epoch)`` at the start of every epoch on
  every rank (``hvd_sparse.tensorflow.CompressionCallback`` does it for Keras); before the
  first call the epoch is 0.
* Communication: allgather of (index, value) pairs, scatter-add, divide by N. Per tensor scope
  by default (as the authors); ``scope="model"`` treats the flattened model as one tensor.

Options (off in paper mode):

* ``clip_norm``: local gradient clipping before accumulation, each rank scaling its bucket's
  gradient to an L2 norm of at most ``clip_norm / sqrt(N)`` (the paper's ``N^-1/2`` rule; the
  authors' code takes a clipping function and clips nothing by default). It is the engine's
  correction, which every method has (algorithms/corrections.py, engine/clipping.py).

Not reproduced: the authors' training script sends 1-D parameters (biases, batch norm) densely;
here every gradient Horovod hands over is sparsified. Their strided sampling draws its random
start from Python's global ``random`` (seeded identically on every rank); here the start comes
from NumPy seeded by ``seed``, the step and the bucket, so it is also identical on every rank.
At density 1 (k = n) momentum masking is skipped, which keeps the momentum like the authors'
dense path. ``warmup_epochs`` and the engine's per-step ``warmup_steps`` are two forms of the same
schedule: give one of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Unpack

import numpy as np

from ..backends import SampledSegment, ThresholdBand, top_magnitudes
from ..errors import ConfigurationError
from .base import GATHER, MODEL, TENSOR, Algorithm, StepContext, is_integer, is_real
from .corrections import CorrectionOptions
from .randomk import bucket_seed


@dataclass
class DGCControl:
    """One bucket's DGC state on this rank."""

    threshold: float | None = None  # last λ
    density: float | None = None    # density of the last step (warm-up)
    k: int | None = None            # entries the last step aimed to send
    tensor_k: tuple[int, ...] | None = None  # the same per tensor of a packed bucket (not saved:
                                             # every step's selection sets it)


@dataclass(frozen=True)
class SamplingPlan:
    """How a bucket of ``numel`` entries is sampled at a given density (the authors' rule)."""

    numel: int
    k: int               # entries to send: ceil(density * numel)
    num_samples: int
    stride: int          # 1: the whole tensor is used, no adaptation loop
    top_samples: int     # λ is the smallest of the top ``top_samples`` samples


def sampling_plan(numel: int, density: float, sample_ratio: float) -> SamplingPlan:
    """k, the sampling stride and the sample count for ``numel`` entries at ``density``."""
    k = min(numel, max(1, math.ceil(numel * density)))
    stride, num_samples = 1, numel
    if sample_ratio < 1.0:
        wanted = max(math.ceil(numel * sample_ratio), math.ceil(2 / density))
        if numel > math.ceil(2 / density):
            stride = math.ceil(numel / wanted / 32) * 32 + 1
            num_samples = numel // stride
            while num_samples < wanted:
                stride -= 8
                num_samples = numel // stride
    top_samples = min(num_samples, max(1, math.ceil(num_samples * density)))
    return SamplingPlan(numel, k, num_samples, stride, top_samples)


def warmup_density(density: float, warmup_epochs: int, epoch: int) -> float:
    """DGC's exponential warm-up: max(ρ^((e+1)/(W+1)), ρ) during the first W epochs, then ρ."""
    if warmup_epochs <= 0 or epoch >= warmup_epochs:
        return density
    coefficient = density ** (1.0 / (warmup_epochs + 1))
    return max(coefficient ** (epoch + 1), density)


def _number(option: str, value: Any, low: float, high: float, low_open: bool = False) -> float:
    if not is_real(value) or not math.isfinite(value):
        raise ConfigurationError(f"{option} must be a number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ConfigurationError(f"{option} must be in {bracket}{low}, {high}], got {value!r}")
    return float(value)


class DGC(Algorithm):
    """Deep Gradient Compression: momentum correction and factor masking, sampled threshold,
    optional local clipping, density warm-up.

    Args:
        density: fraction of entries each rank sends per step after warm-up, in (0, 1];
            k = ceil(density * n).
        momentum: μ of the momentum correction (0 disables it: plain error feedback); the
            engine's correction, which every method has (algorithms/corrections.py). Default
            0.9, and 0 on the Adam path (``adam``), whose momentum is Adam's.
        nesterov: Nesterov form of the momentum correction.
        momentum_masking: clear ``u`` where this rank sent (the paper's factor masking).
        sample_ratio: fraction of entries sampled for the threshold (the authors' floor of
            0.01 applies).
        strided_sample: strided sampling with a random start (else uniform with replacement).
        upper, lower: the adaptation band around k (1.3 and 0.8).
        max_adaptation_iters: adaptation loops at most (10).
        resample: above ``upper * k``, take the exact top-k of the selection.
        warmup_epochs: epochs of exponential density warm-up (0: none); see ``set_epoch``.
        seed: seeds the sampling start (with the step and the bucket).
        scope: "tensor" (per gradient tensor) or "model".
    """

    name = "dgc"
    patterns = (GATHER,)
    scopes = (TENSOR, MODEL)
    packs_tensors = True

    # momentum, nesterov and momentum_masking are DGC's own (its momentum is None by default), which
    # the corrections' TypedDict also names: mypy's overlap check is silenced for that reason.
    def __init__(self, density: float = 0.001, *, momentum: float | None = None, nesterov: bool = False,  # type: ignore[misc]
                 momentum_masking: bool = True, sample_ratio: float = 0.01, strided_sample: bool = True,
                 upper: float = 1.3, lower: float = 0.8, max_adaptation_iters: int = 10,
                 resample: bool = True, warmup_epochs: int = 0, seed: int = 0, scope: str = TENSOR,
                 **corrections: Unpack[CorrectionOptions]):
        if momentum is None:   # the paper's 0.9; the Adam path's momentum is Adam's own
            momentum = 0.0 if corrections.get("adam") is not None else 0.9
        super().__init__(density, scope=scope, momentum=momentum, nesterov=nesterov,
                         momentum_masking=momentum_masking, **corrections)
        for option, flag in (("strided_sample", strided_sample), ("resample", resample)):
            if not isinstance(flag, bool):
                raise ConfigurationError(f"{option} must be True or False, got {flag!r}")
        self.sample_ratio = min(max(_number("sample_ratio", sample_ratio, 0.0, 1.0, True), 0.01), 1.0)
        self.strided_sample = strided_sample
        self.upper = _number("upper", upper, 1.0, math.inf)
        self.lower = _number("lower", lower, 0.0, 1.0, True)
        for option, count in (("max_adaptation_iters", max_adaptation_iters),
                              ("warmup_epochs", warmup_epochs), ("seed", seed)):
            if not is_integer(count) or count < 0:
                raise ConfigurationError(f"{option} must be a non-negative integer, got {count!r}")
        self.max_adaptation_iters = int(max_adaptation_iters)
        self.resample = resample
        self.warmup_epochs = int(warmup_epochs)
        if self.warmup_epochs and self.corrections.warmup_steps:
            raise ConfigurationError(
                "give warmup_epochs (DGC's per-epoch schedule, with set_epoch) or warmup_steps (the "
                "same schedule per step), not both")
        self.seed = int(seed)
        self._epoch = 0

    # --- warm-up ----------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Enter ``epoch`` (0-based) of the warm-up schedule; call it on every rank."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ConfigurationError(f"epoch must be a non-negative integer, got {epoch!r}")
        self._epoch = int(epoch)

    @property
    def current_density(self) -> float:
        """The density of the current epoch's warm-up (``warmup_epochs``)."""
        return warmup_density(self.density, self.warmup_epochs, self._epoch)

    def step_density(self, ctx: StepContext) -> float:
        """This step's density: the per-epoch warm-up, or the engine's per-step schedule."""
        return ctx.density if ctx.density is not None else self.current_density

    def k(self, numel: int, density: float | None = None) -> int:
        """k at ``density`` (default the current warm-up density), as the sampling plan rounds it."""
        density = self.current_density if density is None else density
        return sampling_plan(numel, density, self.sample_ratio).k

    def init_control(self, ctx: StepContext) -> DGCControl:
        """No threshold yet."""
        return DGCControl()

    # --- selection -------------------------------------------------------------------------------------
    def select_local(self, acc: Any, control: DGCControl, ctx: StepContext) -> Any:
        """The sampled threshold, and the entries above it (module docstring), in each tensor of a
        bucket packing per-tensor steps on its own: one backend call
        (``Backend.sampled_threshold_select``, one kernel call where there is one)."""
        b, density = ctx.backend, self.step_density(ctx)
        plans = [(offset, sampling_plan(size, density, self.sample_ratio), key)
                 for offset, size, key in self.tensor_segments(ctx)]
        control.tensor_k = tuple(plan.k for _, plan, _ in plans)
        control.density, control.k = density, sum(control.tensor_k)
        band = ThresholdBand(self.upper, self.lower, self.max_adaptation_iters, self.resample)
        if self.strided_sample or all(plan.stride == 1 for _, plan, _ in plans):
            idx, thresholds = b.sampled_threshold_select(acc, [self._segment(offset, plan, ctx, key)
                                                               for offset, plan, key in plans], band)
        else:
            idx, thresholds = self._uniform_select(acc, plans, band, ctx)
        control.threshold = float(np.mean(thresholds))
        return idx

    def _segment(self, offset: int, plan: SamplingPlan, ctx: StepContext, key: str) -> SampledSegment:
        """A tensor's strided sample: a random start (seed, step, tensor), and the authors' adaptation
        of a sampled λ only (stride 1, nothing sampled, keeps the k-th largest |a|)."""
        if plan.stride == 1:
            return SampledSegment(offset, plan.numel, plan.k, 0, 1, plan.top_samples, 0)
        start = int(self._rng(ctx, key).integers(0, plan.stride))
        return SampledSegment(offset, plan.numel, plan.k, start, plan.stride, plan.top_samples,
                              self.max_adaptation_iters)

    def _uniform_select(self, acc: Any, plans: list, band: ThresholdBand, ctx: StepContext
                        ) -> tuple[Any, list[float]]:
        """``strided_sample=False``: each tensor's λ from a uniform sample with replacement."""
        b, parts, thresholds = ctx.backend, [], []
        for offset, plan, key in plans:
            part = acc if len(plans) == 1 else b.slice(acc, offset, offset + plan.numel)
            iterations = band.iterations if plan.stride > 1 else 0
            if plan.stride == 1:
                sample = b.abs(part)
            else:
                where = self._rng(ctx, key).integers(0, plan.numel, plan.num_samples, dtype=np.int64)
                sample = b.abs(b.take(part, b.from_numpy(where, like=acc)))
            threshold = top_magnitudes(b, sample, plan.top_samples)[1]
            idx, threshold = b.adapt_threshold_select(part, threshold, plan.k,
                                                      band._replace(iterations=iterations))
            parts.append(idx + offset if offset else idx)
            thresholds.append(threshold)
        return (parts[0] if len(parts) == 1 else b.concat(parts)), thresholds

    def _rng(self, ctx: StepContext, key: str) -> np.random.Generator:
        """A tensor's sample's random source: the same on every rank (seed, step, the tensor's
        bucket key), made only for a sampled tensor (a generator costs more than a small tensor's
        selection)."""
        return np.random.default_rng([self.seed, ctx.step, bucket_seed(key)])

    def target_k(self, control: DGCControl, ctx: StepContext) -> int:
        """The k of the step's selection, or of the step's density before one."""
        if control.k is not None:
            return control.k
        density = self.step_density(ctx)
        return sum(self.k(size, density) for _, size, _ in self.tensor_segments(ctx))

    def masks_momentum(self, control: DGCControl, ctx: StepContext) -> bool | list[bool]:
        """The authors' dense path (k = n) keeps the momentum: per tensor of a packed bucket, from
        the k the step's selection took for each."""
        if control.tensor_k is None:   # asked only after a selection, which sets it
            return True
        segments = self.tensor_segments(ctx)
        masks = [k < size for k, (_, size, _) in zip(control.tensor_k, segments, strict=True)]
        return masks if len(set(masks)) > 1 else masks[0]

    # --- statistics and checkpoints ----------------------------------------------------------------------
    def control_stats(self, control: DGCControl) -> dict:
        """The last threshold, and the warm-up's density as ``density_target``."""
        out = {}
        if control.threshold is not None:
            out["threshold"] = control.threshold
        if control.density is not None:
            out["density_target"] = control.density
        return out

    def control_state(self, control: DGCControl) -> dict:
        """Threshold, density and k of the last step."""
        return {"threshold": control.threshold, "density": control.density, "k": control.k}

    def load_control(self, state: dict, ctx: StepContext, saved_size: int) -> DGCControl:
        """The checkpoint's threshold, density and k (older checkpoints' momentum is read by the engine)."""
        # Checkpoints before the engine kept the momentum had it here (per rank): the engine
        # reads it from there (Engine._restore).
        known = {k: v for k, v in state.items() if k in ("threshold", "density", "k")}
        return DGCControl(**known)

