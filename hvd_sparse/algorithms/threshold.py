"""Hard-threshold sparsification with error feedback (docs/algorithms.md#threshold).

Each rank sends every entry of its accumulated vector ``a = g + e`` with ``|a| >= λ`` and keeps
the rest as its residual. λ is fixed for the whole run, so the density is *not* controlled: it
follows the gradients' magnitude (this is what MiCRO's and ExDyna's threshold scaling fix).

Paper mode: λ given by the user, or by default the authors' rule ``λ = 1/(2*sqrt(k))`` with
``k = floor(density * n)``. With ``scope="model"`` (the default) n is the whole model, which is
exactly the authors' setting (one λ for every tensor; selecting per tensor or over the
flattened model with one λ picks the same entries). Aggregation:

* ``pattern="gather"`` (the hard-threshold authors' code): allgather of (index, value) pairs,
  scatter-add, divide by N.
* ``pattern="union"`` (the ``ThreshReducer`` in the ExDyna/MiCRO authors' code): allgather of the
  indices, allreduce of every rank's values at their union; every rank clears the whole union.

An empty selection sends one index instead (``step mod n``, the engine's fallback), because a
collective must never be empty.

Option (not paper mode): ``scope="tensor"`` without an explicit ``threshold`` gives each tensor
its own λ from its own k. To reproduce the authors' per-tensor run, pass the model's λ instead:
``threshold=Threshold.default_threshold(density, model_numel)``.
The faces pack per-tensor steps (``packs_tensors``): each tensor of a packed bucket selects at its
own λ, so the decisions are a bucket per tensor's.
"""

from __future__ import annotations

import math
from typing import Any, Unpack

import numpy as np

from ..backends import Selected, index_dtype_for
from ..errors import ConfigurationError
from .base import GATHER, MODEL, TENSOR, UNION, Algorithm, StepContext, is_real
from .corrections import CorrectionOptions


class Threshold(Algorithm):
    """Error-feedback hard threshold.

    Args:
        density: only sets the default λ (``1/(2*sqrt(floor(density * n)))``); the density
            actually sent is not controlled.
        threshold: λ itself (a positive number); overrides the default rule.
        pattern: "gather" (allgather of pairs) or "union" (index allgather + value allreduce).
        scope: "model" (one λ over the flattened model) or "tensor" (one bucket per tensor).
    """

    name = "threshold"
    patterns = (GATHER, UNION)
    scopes = (MODEL, TENSOR)
    packs_tensors = True

    def __init__(self, density: float = 0.01, *, threshold: float | None = None,
                 pattern: str = GATHER, scope: str = MODEL, **corrections: Unpack[CorrectionOptions]):
        super().__init__(density, pattern=pattern, scope=scope, **corrections)
        if threshold is not None and (not is_real(threshold)
                                      or not math.isfinite(threshold) or threshold <= 0):
            raise ConfigurationError(f"threshold must be a positive number (λ), got {threshold!r}")
        self.threshold = None if threshold is None else float(threshold)

    @staticmethod
    def default_threshold(density: float, numel: int) -> float:
        """The authors' λ for a target density over ``numel`` entries: 1/(2*sqrt(k))."""
        k = max(1, min(numel, int(density * numel)))
        return 1.0 / (2.0 * math.sqrt(k))

    def init_control(self, ctx: StepContext) -> float:
        """The bucket's λ (fixed for the run); for a bucket packing per-tensor steps, the mean of
        its tensors' own (a statistic: each tensor selects at its own, ``tensor_threshold``)."""
        if self.threshold is not None:
            return self.threshold
        return float(np.mean([self.default_threshold(self.density, size)
                              for _, size, _ in self.tensor_segments(ctx)]))

    def step_threshold(self, control: float, ctx: StepContext) -> float:
        """λ of this step: the bucket's, or during a density warm-up the authors' λ for the
        step's target density (unless λ was given)."""
        if self.threshold is None and self.step_density(ctx) != self.density:
            return self.tensor_threshold(ctx.numel, ctx)
        return control

    def tensor_threshold(self, numel: int, ctx: StepContext) -> float:
        """λ of ``numel`` entries this step (one tensor of a bucket packing per-tensor steps): the
        one given, else the authors' rule for them at the step's density."""
        if self.threshold is not None:
            return self.threshold
        return self.default_threshold(self.step_density(ctx), numel)

    def select_local(self, acc: Any, control: float, ctx: StepContext) -> Any:
        """Every entry with |a| > λ; in a bucket packing per-tensor steps, each tensor's own λ
        (``select_per_tensor``)."""
        b = ctx.backend
        if not ctx.members:
            return b.select_at_least(acc, 0, ctx.numel, self.step_threshold(control, ctx))[0]
        return self.select_per_tensor(acc, control, ctx, lambda part, numel: b.select_at_least(
            part, 0, numel, self.tensor_threshold(numel, ctx))[0])

    def accumulate_select(self, residual: Any, tensors: list, control: float, ctx: StepContext,
                          clear_inputs: bool, check_finite: bool) -> Selected | None:
        """Error feedback and the selection at λ in one pass (``Backend.accumulate_select``); a
        bucket packing per-tensor steps selects at each tensor's λ in ``select_local`` instead
        (None: the engine accumulates first)."""
        if ctx.members:
            return None
        return ctx.backend.accumulate_select(
            residual, tensors, 0, ctx.numel, self.step_threshold(control, ctx), (), 1,
            index_dtype_for(ctx.numel), clear_inputs, check_finite, ctx.momentum)

    def control_stats(self, control: float) -> dict:
        """λ."""
        return {"threshold": control}
