"""The named contract of each fused op, one for the algorithms, the backends and the kernels.

A fused op (accumulate and select, accumulate and take the moments or the norms, the momentum
correction) returns the same named result wherever it is implemented:

* ``Backend.<op>`` (backends/base.py: the reference composition, and a backend's own) returns it;
* a method's ``Algorithm.accumulate_select`` returns a ``Selected`` too, or None where it does not
  fuse (the engine then calls ``accumulate`` and ``select``);
* a kernel op module (``KernelOps``: hvd_sparse/kernels/cpu, hvd_sparse/kernels/triton) returns
  it, or None where it does not handle the arguments (a dtype or layout it has no kernel for: the
  backend then runs the reference ops). Every op module has every op of ``KernelOps``, so a
  backend calls them all the same way.

A kernel writes into its first argument, so the ``acc`` of its result is that argument (the
residual); an immutable backend's ``acc`` is a new array. This module sits below both the
backends and the kernels (docs/architecture.md#layers) and imports neither.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import numpy as np

Array = Any  # a framework tensor: numpy.ndarray, torch.Tensor or tf.Tensor


def adam_constants(factor: float, second: Any) -> tuple[float, ...]:
    """The Adam path's accumulation constants as the reference computes them in Python floats, for
    the kernels to round to the residual's dtype: b1, 1 - b1, b2, 1 - b2, c1, c2, eps, the bound,
    and 1.0 where v is frozen (else 0.0) (``factor``: b1; ``second``: the backends'
    ``SecondMoment``)."""
    return (float(factor), 1.0 - float(factor), float(second.factor), 1.0 - float(second.factor),
            float(second.first_scale), float(second.second_scale), float(second.eps), float(second.bound),
            1.0 if second.frozen else 0.0)


class Selected(NamedTuple):
    """``accumulate_select``'s result: the accumulated vector, the ascending indices i in
    [lo, hi) with |acc_i| >= threshold, ``count_at_least`` at each probe, and whether the inputs
    were finite. Not finite (checked on request): nothing was written, ``idx`` is None and
    ``counts`` empty."""

    acc: Array
    idx: Array | None
    counts: list[float]
    finite: bool


class Moments(NamedTuple):
    """``accumulate_moments``' result: the accumulated vector, its (mean, std) as ``mean_std``
    gives them (``accumulate_segment_moments``: a list, each segment's), and whether the inputs
    were finite (not finite: nothing written, moments None)."""

    acc: Array
    moments: tuple[float, float] | list[tuple[float, float]] | None
    finite: bool


class Norms(NamedTuple):
    """``accumulate_norms``' result: the accumulated vector and each segment's ``segment_norms``."""

    acc: Array
    norms: np.ndarray


class Velocity(NamedTuple):
    """``momentum_accumulate``'s result: residual + the updated velocity (what is selected from),
    and the updated velocity (the momentum buffer)."""

    acc: Array
    momentum: Array


class ThresholdBand(NamedTuple):
    """How a sampled threshold adapts (``Backend.adapt_threshold_select``, DGC's): more than
    ``upper``·k chosen: the exact top-k of them with ``resample``, else threshold ×= upper; fewer
    than ``lower``·k: threshold ×= lower; at most ``iterations`` times."""

    upper: float
    lower: float
    iterations: int
    resample: bool


class SampledSegment(NamedTuple):
    """A stretch of a vector DGC selects from on its own (``Backend.sampled_threshold_select``): a
    tensor of a bucket that packs several. ``start`` counts from ``offset``."""

    offset: int       # where the segment begins in the vector
    size: int
    k: int            # entries to keep at most
    start: int        # the strided sample: seg[start::stride], threshold = its top-th magnitude
    stride: int
    top: int
    iterations: int   # adaptation passes (the band's ``iterations`` for this segment)


def sampled_plan_fits(segments: list[SampledSegment], n: int) -> bool:
    """Whether the sampled-selection kernels take these segments of a vector of ``n``: each k
    between 1 and its size, a positive stride, sizes summing to at most n (the kernels' room);
    else the reference composition runs. Other invalid plans make the kernels raise."""
    return (sum(seg.size for seg in segments) <= n
            and all(1 <= seg.k <= seg.size and seg.stride >= 1 for seg in segments))


class KernelOps(Protocol):
    """What an op module of hvd_sparse.kernels provides (``kernels.ops_for``): every op returns the
    result of the backend op it replaces, bit for bit, or None where it does not handle its
    arguments. ``clear``, ``zero_at`` and ``put_at`` write in place and return True when they
    did. Index dtypes are the framework's (``torch.int64``)."""

    def all_finite(self, tensors: list[Array]) -> bool | None:
        """Whether no tensor holds NaN or Inf."""

    def clear(self, tensors: list[Array]) -> bool | None:
        """Every tensor set to zero in place."""

    def accumulate(self, residual: Array, tensors: list[Array], clear_inputs: bool) -> Array | None:
        """residual += concat(tensors) in place; the residual."""

    def accumulate_select(self, residual: Array, tensors: list[Array], lo: int, hi: int,
                          threshold: float, probes: list[float], every: int, index_dtype: Any,
                          clear_inputs: bool) -> Selected | None:
        """``accumulate``, then the selection at ``threshold`` in [lo, hi) and the probe counts."""

    def accumulate_select_if_finite(self, residual: Array, tensors: list[Array], lo: int, hi: int,
                                    threshold: float, probes: list[float], every: int, index_dtype: Any,
                                    clear_inputs: bool) -> Selected | None:
        """``accumulate_select`` after the finite check, read with the count (one sync)."""

    def momentum_accumulate(self, residual: Array, momentum: Array, tensors: list[Array], factor: float,
                            nesterov: bool) -> Velocity | None:
        """The momentum correction (``Backend.momentum_accumulate``), in place."""

    def momentum_accumulate_select(self, residual: Array, momentum: Array, tensors: list[Array],
                                   factor: float, nesterov: bool, lo: int, hi: int, threshold: float,
                                   probes: list[float], every: int, index_dtype: Any, clear_inputs: bool,
                                   check_finite: bool) -> Selected | None:
        """``accumulate_select`` through the momentum correction, in one pass."""

    def adam_accumulate(self, residual: Array, momentum: Array, tensors: list[Array], factor: float,
                        second: Any) -> Velocity | None:
        """The Adam path's accumulation (``Backend.adam_accumulate``; ``second``: the backends'
        ``SecondMoment``), both moments in place."""

    def adam_accumulate_select(self, residual: Array, momentum: Array, tensors: list[Array], factor: float,
                               second: Any, lo: int, hi: int, threshold: float,
                               probes: list[float], every: int, index_dtype: Any, clear_inputs: bool,
                               check_finite: bool) -> Selected | None:
        """``accumulate_select`` through the Adam path's accumulation, in one pass."""

    def adam_update(self, average: Array, first: Array, second: Array, beta1: float, beta2: float,
                    first_scale: float, second_scale: float, eps: float) -> tuple[Array, Array, Array] | None:
        """The Adam path's dense update (``Backend.adam_update``): (update, m, v), in place."""

    def accumulate_moments(self, residual: Array, tensors: list[Array], clear_inputs: bool,
                           check_finite: bool) -> Moments | None:
        """``accumulate``, then ``mean_std`` of the result."""

    def accumulate_segment_moments(self, residual: Array, tensors: list[Array], lengths: list[int],
                                   clear_inputs: bool, check_finite: bool) -> Moments | None:
        """``accumulate``, then ``mean_std`` of each consecutive segment of the result."""

    def accumulate_norms(self, residual: Array, tensors: list[Array], lengths: list[int]) -> Norms | None:
        """``accumulate``, then ``segment_norms`` of the result."""

    def select_at_least(self, x: Array, lo: int, hi: int, threshold: float, probes: list[float],
                        every: int, index_dtype: Any) -> tuple[Array, list[float]] | None:
        """``Backend.select_at_least``: (indices, probe counts)."""

    def sampled_threshold_select(self, x: Array, segments: list[SampledSegment], band: ThresholdBand,
                                 index_dtype: Any) -> tuple[Array, list[float]] | None:
        """``Backend.sampled_threshold_select``: (indices, a threshold per segment)."""

    def mean_std(self, x: Array) -> tuple[float, float] | None:
        """``Backend.mean_std``."""

    def segment_norms(self, x: Array, lengths: list[int]) -> np.ndarray | None:
        """``Backend.segment_norms``."""

    def topk_abs(self, x: Array, k: int, index_dtype: Any) -> Array | None:
        """``Backend.topk_abs_indices`` in ``index_dtype``."""

    def zero_at(self, x: Array, idx: Array) -> bool | None:
        """x[idx] = 0 in place."""

    def put_at(self, x: Array, idx: Array, values: Array, offset: int = 0) -> bool | None:
        """x[idx - offset] = values in place."""


def not_handled(*args: Any, **kwargs: Any) -> None:
    """An op an op module has no kernel for: it never handles its arguments."""
    return None
